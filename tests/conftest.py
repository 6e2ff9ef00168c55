import os

# Ranks and tests share few cores: keep each process single-threaded unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``nemo`` (live NeMo) run only when asked for with ``-m nemo``."""
    import pytest

    if "nemo" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="live NeMo test: opt in with -m nemo (needs the nemo extra)")
    for item in items:
        if item.get_closest_marker("nemo") is not None:
            item.add_marker(skip)
