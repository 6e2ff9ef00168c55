"""The CPU layer's thread policy: an explicit OMP_NUM_THREADS wins over sharing the cores."""
import pytest

from dpcc_megatron.testing import cpu_threads


def test_explicit_omp_num_threads_wins_over_core_sharing():
    # the stability runner starts single-rank runs side by side with OMP_NUM_THREADS=1; taking
    # every core in each of them oversubscribes the machine
    assert cpu_threads(1, env={"OMP_NUM_THREADS": "1"}, cpu_count=16) == 1
    assert cpu_threads(2, env={"OMP_NUM_THREADS": " 3 "}, cpu_count=2) == 3


def test_without_omp_num_threads_the_ranks_share_the_cores():
    assert cpu_threads(1, env={}, cpu_count=16) == 16
    assert cpu_threads(4, env={"OMP_NUM_THREADS": ""}, cpu_count=16) == 4
    assert cpu_threads(4, env={}, cpu_count=2) == 1  # never below one thread
    assert cpu_threads(0, env={}, cpu_count=None) >= 1


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_malformed_omp_num_threads_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        cpu_threads(1, env={"OMP_NUM_THREADS": bad}, cpu_count=4)
