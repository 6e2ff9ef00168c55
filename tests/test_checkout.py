"""The guard that fails a test run which leaves the checkout changed (tests/conftest.py)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.checkout import changes, snapshot

REPO = Path(__file__).resolve().parents[1]


def _tree(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "README.md").write_text("hi\n")
    return root


def test_a_new_file_or_folder_in_runs_is_reported(tmp_path):
    root = _tree(tmp_path / "checkout")
    before = snapshot(root)
    (root / "runs" / "tiny_cpu" / "checkpoints" / "iter_0000002").mkdir(parents=True)
    (root / "runs" / "tiny_cpu" / "checkpoints" / "latest").write_text("iter_0000002\n")
    assert changes(before, snapshot(root)) == [
        "added runs/", "added runs/tiny_cpu/", "added runs/tiny_cpu/checkpoints/",
        "added runs/tiny_cpu/checkpoints/iter_0000002/", "added runs/tiny_cpu/checkpoints/latest"]


def test_modified_and_removed_files_are_reported(tmp_path):
    root = _tree(tmp_path / "checkout")
    before = snapshot(root)
    os.remove(root / "README.md")
    (root / "pkg" / "mod.py").write_text("x = 22\n")
    assert changes(before, snapshot(root)) == ["removed README.md", "modified pkg/mod.py"]


def test_python_and_pytest_caches_venvs_and_skipped_paths_are_not_reported(tmp_path):
    root = _tree(tmp_path / "checkout")
    before = snapshot(root, skip=[root / "tmp-base"])
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (root / ".pytest_cache" / "v").mkdir(parents=True)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (root / "tmp-base" / "test_x0").mkdir(parents=True)
    assert changes(before, snapshot(root, skip=[root / "tmp-base"])) == []
    (root / ".hypothesis" / "examples").mkdir(parents=True)  # not a cache of Python or pytest: reported
    assert changes(before, snapshot(root, skip=[root / "tmp-base"])) == ["added .hypothesis/",
                                                                         "added .hypothesis/examples/"]


def test_a_session_that_writes_into_the_checkout_fails_and_names_the_path(tmp_path):
    """The conftest hook end to end, on a copy: a test that writes into the copy's runs/ makes the
    session exit 1 naming the file; a test that writes only to its tmp_path leaves it exiting 0."""
    checkout = tmp_path / "checkout"
    (checkout / "tests").mkdir(parents=True)
    for name in ("__init__.py", "conftest.py", "checkout.py"):
        shutil.copy(REPO / "tests" / name, checkout / "tests" / name)
    (checkout / "tests" / "test_probe.py").write_text(
        "from pathlib import Path\n\n\n"
        "def test_writes_into_the_checkout():\n"
        "    (Path(__file__).parents[1] / 'runs').mkdir()\n"
        "    (Path(__file__).parents[1] / 'runs' / 'latest').write_text('iter_0000002')\n\n\n"
        "def test_writes_to_its_tmp_path(tmp_path):\n"
        "    (tmp_path / 'latest').write_text('iter_0000002')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(test):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"--basetemp={tmp_path / 'base'}", f"tests/test_probe.py::{test}"],
                              cwd=checkout, env=env, capture_output=True, text=True, timeout=300)

    good = run("test_writes_to_its_tmp_path")
    assert good.returncode == 0, good.stdout + good.stderr
    bad = run("test_writes_into_the_checkout")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "1 passed" in bad.stdout, bad.stdout  # the test itself passed: the guard failed the run
    assert "checkout changed" in bad.stdout, bad.stdout
    assert "added runs/\n" in bad.stdout and "added runs/latest\n" in bad.stdout, bad.stdout
