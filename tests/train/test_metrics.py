from dpcc_megatron.algo import combine_metrics
from dpcc_megatron.train.metrics import sample_utilization


def test_sample_utilization_is_undefined_without_advantage_tokens():
    # two steps whose groups all had equal rewards: no token carried an advantage
    none_used = combine_metrics([{"utilisation": 1.0, "num_adv_tokens": 0.0, "num_tokens": 40.0}] * 2)
    assert sample_utilization(none_used) is None
    # weighted by advantage tokens: (0.5 * 30 + 1.0 * 10) / 40
    mixed = combine_metrics([{"utilisation": 0.5, "num_adv_tokens": 30.0, "num_tokens": 40.0},
                             {"utilisation": 1.0, "num_adv_tokens": 10.0, "num_tokens": 40.0}])
    assert sample_utilization(mixed) == 0.625
    assert sample_utilization({}) is None
