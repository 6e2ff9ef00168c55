"""Attacks found by an adversarial review of the sandbox, each a case that got through before its fix:
trusted-side code chosen by the solution, a look-alike of a module the tests use, a hash-collision
answer that held the trusted process past the deadline, and kernel memory outside the scratch cap."""
import json
import os
import time

import pytest

from dpcc_megatron.rewards.registry import CheckerTimeout
from dpcc_megatron.rewards.sandbox import SandboxLimits, build_sandbox
from dpcc_megatron.rewards.sandbox.driver import MAX_HASH_REPEATS, decode
from dpcc_megatron.rewards.sandbox.judge import _trusted_module

from .test_sandbox_escape import LIMITS, score

_M = (1 << 61) - 1  # k * _M all hash to 0


@pytest.fixture(scope="module")
def sandbox():
    sb = build_sandbox(LIMITS)
    assert sb.mode in ("bwrap", "namespaces"), sb.describe()
    return sb


def test_a_module_name_chosen_by_the_solution_runs_nothing_here(sandbox):
    # a module object's __name__ is the solution's to set; importing `venv.__main__` here ran venv's
    # command line in the trainer and raised SystemExit through the reward layer
    code = "import sys\nm = type(sys)('venv.__main__')\nt = type(sys)('test.autotest')\ndef f():\n    return 1\n"
    assert score(code, "assert f() == 1\nassert m is None or m.__name__ != 'venv.__main__'\n") == 0.0  # m not in scope
    assert score(code) == 1.0  # the honest part still works; nothing ran here
    for name in ("venv.__main__", "test.autotest", "idlelib.idle", "json._x", "antigravity"):
        assert _trusted_module(name) is None, name
    assert _trusted_module("math").__name__ == "math"


def test_a_look_alike_of_numpy_decides_no_assert(sandbox):
    fake = "class np:\n    allclose = staticmethod(lambda *a, **k: True)\ndef area(r):\n    return 0\n"
    assert score(fake, "assert np.allclose(area(1), 3.14159, atol=1e-3)\n") == 0.0
    honest = "import numpy as np\ndef area(r):\n    return np.pi * r * r\n"
    assert score(honest, "assert np.allclose(area(1), 3.14159, atol=1e-3)\n") == 1.0


def test_a_hash_collision_answer_is_refused_not_waited_for(sandbox):
    # the answer is written straight into the protocol channel (cheap for the solution); building the
    # set on the trusted side was quadratic: 60,000 such ints held a 3 s run for over a minute
    body = ",".join(str(_M * k) for k in range(1, 60001))
    code = ("import os, time\ndef f():\n    os.write(4, b'{\"ok\": {\"$s\": [%s]}}\\n')\n    time.sleep(30)\n" % body)
    start = time.monotonic()
    assert score(code, "assert f() == {1}\n", limits=SandboxLimits(timeout_s=3.0, memory_mb=512)) == 0.0
    assert time.monotonic() - start < 12  # was over 60 s; loose for a loaded machine
    with pytest.raises(ValueError, match="same hash"):
        decode(json.loads('{"$d": [%s]}' % ",".join("[%d, 0]" % (_M * k) for k in range(1, 200))), None)
    # honest sets and dicts, a few repeated hashes included (hash(-1) == hash(-2)), still decode
    assert decode({"$s": list(range(-2, 1000))}, None) == set(range(-2, 1000))
    assert len(decode({"$s": [_M * k for k in range(1, MAX_HASH_REPEATS)]}, None)) == MAX_HASH_REPEATS - 1


def test_no_writable_place_but_the_capped_scratch(sandbox):
    # bubblewrap's /dev is an uncapped tmpfs: /dev/shm took 300 MiB past a 64 MiB scratch
    shm = "def f():\n    open('/dev/shm/x', 'wb').write(b'x')\n    return 1\n"
    assert score(shm) == 0.0
    assert score("def f():\n    open('/dev/null', 'wb').write(b'x')\n    return 1\n") == 1.0


def test_open_files_are_bounded(sandbox):
    # pipe buffers are kernel memory outside RLIMIT_AS: with the host's 20,000 fds a run buffered 124 MiB
    code = ("import os\ndef f():\n    fds = []\n    try:\n        while len(fds) < 5000:\n            fds += os.pipe()\n"
            "    except OSError:\n        pass\n    return len(fds)\n")
    assert score(code, "assert f() <= 256\n") == 1.0


def test_forged_names_cannot_replace_the_tests_builtins(sandbox):
    # the solution answers the setup itself on the protocol channel (fds 3 and 4), naming a
    # `__builtins__` whose `abs` is its own function, then serves every call with 0
    code = ("import os, json\n"
            "os.write(4, json.dumps({'ok': {'__builtins__': {'$d': [['abs', {'$h': 0}]]}, 'f': {'$h': 0}}}).encode() + b'\\n')\n"
            "for line in os.fdopen(3, 'r'):\n    os.write(4, b'{\"ok\": 0, \"after\": []}\\n')\n")
    assert score(code, "assert abs(f(1) - 3.14159) < 1e-6\n") == 0.0


def test_remote_replays_of_a_nondeterministic_solution_score_zero_not_skip():
    from .fake_sandbox_fusion import FakeSandboxFusion
    from .test_sandbox_remote import _remote

    # each replay answered f() differently, so the dependent call never matched: 64 service requests,
    # then a counted skip instead of a 0
    liar = "import random\ndef f():\n    return random.random()\ndef g(x):\n    return 0\n"
    honest = "def f():\n    return {'apple', 'pear', 'fig'}\ndef g(x):\n    return len(x)\n"  # set order varies per run
    with FakeSandboxFusion() as service:
        sb = build_sandbox(_remote(service.url))
        got = sb.run_tests(liar, "x = f()\nassert g(x) == 1\n")
        assert got["passed"] == 0 and "differently" in got["error"] and len(service.requests) <= 3
        assert sb.run_tests(honest, "x = f()\nassert g(x) == 3\n")["passed"] == 1


def test_no_memory_outside_the_address_space_limit(sandbox):
    # memfds and System V segments are shared memory that RLIMIT_AS does not count: 600 MiB were held
    # under a 256 MiB limit, and with 20,000 fds or 4,096 segments far more
    memfd = "import os\ndef f():\n    fd = os.memfd_create('m')\n    os.write(fd, b'x' * (1 << 20))\n    return 1\n"
    sysv = ("import ctypes\ndef f():\n    libc = ctypes.CDLL(None)\n    return 1 if libc.shmget(0, 1 << 20, 0o1600) >= 0 else 0\n")
    mq = "import ctypes\ndef f():\n    return 1 if ctypes.CDLL(None).msgget(0, 0o1600) >= 0 else 0\n"
    for attack in (memfd, sysv, mq):
        assert score(attack) == 0.0, attack


@pytest.mark.parametrize("mode", ["bwrap", "namespaces"])
def test_a_solution_cannot_outlive_its_timeout(mode):
    # clearing the parent-death signal and leaving the process group let a sleeping solution live on
    # as an orphan after its run was killed (namespaces mode; bwrap is checked too)
    from .test_sandbox_escape import _cmdline

    limits = SandboxLimits(timeout_s=1.0, memory_mb=256, isolation=mode)
    build_sandbox(limits)
    code = ("import ctypes, os, time\nctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\ntry:\n    os.setsid()\nexcept OSError:\n"
            "    pass\ndef f():\n    time.sleep(1000)\n")
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    with pytest.raises(CheckerTimeout):
        score(code, limits=limits)
    time.sleep(0.3)
    left = [p for p in os.listdir("/proc") if p.isdigit() and p not in before and "_serve()" in _cmdline(p)]
    for p in left:  # do not leave them running if the assertion below fails
        os.kill(int(p), 9)
    assert not left


def test_the_namespaces_scratch_caps_its_files():
    # inodes are kernel memory outside the size cap: 170,000 empty files in 2 s
    limits = SandboxLimits(timeout_s=10.0, memory_mb=256, isolation="namespaces")
    build_sandbox(limits)
    code = ("import os\ndef f():\n    n = 0\n    try:\n        while n < 20000:\n"
            "            os.close(os.open('f%d' % n, os.O_CREAT | os.O_WRONLY)); n += 1\n    except OSError:\n        pass\n    return n\n")
    assert score(code, "assert f() < 20000\n", limits=limits) == 1.0


def test_threads_are_bounded_below_the_hosts_pid_max():
    # raw clone() threads on 16 KiB stacks: RLIMIT_AS alone allowed tens of thousands, the host's whole
    # pid_max. The namespaces mode caps its PID namespace (Linux >= 6.14); bubblewrap cannot (docs).
    limits = SandboxLimits(timeout_s=10.0, memory_mb=512, isolation="namespaces")
    build_sandbox(limits)
    if score("def f():\n    return int(open('/proc/sys/kernel/pid_max').read())\n", "assert f() == 512\n",
             limits=limits) == 0.0:
        pytest.skip("pid_max is not per PID namespace on this kernel (Linux < 6.14)")
    threads = ("import ctypes\ndef f():\n    libc = ctypes.CDLL(None)\n    flags = 0x100 | 0x200 | 0x400 | 0x800 | 0x10000 | 0x40000\n"
               "    stacks, n = [], 0\n    while n < 1000:\n        st = ctypes.create_string_buffer(16384); stacks.append(st)\n"
               "        top = ctypes.c_void_p(ctypes.addressof(st) + 16384 - 64)\n"
               "        if libc.clone(ctypes.cast(libc.pause, ctypes.c_void_p), top, flags, None) < 0:\n            break\n"
               "        n += 1\n    return n\n")
    assert score(threads, "assert f() < 512\n", limits=limits) == 1.0
    # and the solution cannot raise it again
    reraise = "def f():\n    open('/proc/sys/kernel/pid_max', 'w').write('32768')\n    return 1\n"
    assert score(reraise, limits=limits) == 0.0


def test_an_alias_cannot_name_another_trusted_module(sandbox):
    # a module crosses by the name the solution gives it: `np` naming `math` is still numpy here
    code = "import sys\nnp = type(sys)('math')\ndef f():\n    return 0\n"
    assert score(code, "assert np.__name__ == 'numpy'\n") == 1.0
