import os
import tempfile
from pathlib import Path

import pytest

# Ranks and tests share few cores: keep each process single-threaded unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:  # Hypothesis keeps its example database and caches in ./.hypothesis by default: not in the checkout.
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass
else:
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "dpcc-megatron-hypothesis"))

CHECKOUT = Path(__file__).resolve().parents[1]
_checkout_before = pytest.StashKey[dict]()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``nemo`` (live NeMo) run only when asked for with ``-m nemo``."""
    if "nemo" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="live NeMo test: opt in with -m nemo (needs the nemo extra)")
    for item in items:
        if item.get_closest_marker("nemo") is not None:
            item.add_marker(skip)


def _checkout_skips(config) -> list[Path]:
    basetemp = config.getoption("basetemp", None)
    return [Path(basetemp)] if basetemp else []


def pytest_sessionstart(session):
    from tests.checkout import snapshot

    session.config.stash[_checkout_before] = snapshot(CHECKOUT, _checkout_skips(session.config))


def pytest_sessionfinish(session, exitstatus):
    """Tests write only to temporary directories: a run that leaves the checkout changed fails, naming
    what changed (runs/ of a config with relative paths, a hypothesis database, ...)."""
    from tests.checkout import changes, snapshot

    before = session.config.stash.get(_checkout_before, None)
    if before is None or hasattr(session.config, "workerinput"):
        return
    diff = changes(before, snapshot(CHECKOUT, _checkout_skips(session.config)))
    if not diff:
        return
    shown = "\n".join(f"  {line}" for line in diff[:50]) + (f"\n  ... and {len(diff) - 50} more" if len(diff) > 50 else "")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"the test run changed the checkout {CHECKOUT} (tests must write only to temporary directories):\n{shown}"
    if reporter is not None:
        reporter.write_sep("=", "checkout changed", red=True, bold=True)
        reporter.write_line(message)
    else:
        print(message)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
