"""OS isolation of one sandbox process: namespaces, a read-only runtime, a private scratch, seccomp.

Modes (``reward.sandbox.isolation``):

* ``bwrap``: bubblewrap (Debian package ``bubblewrap``) builds the sandbox: new user, mount, PID,
  network, IPC, UTS and cgroup namespaces, all capabilities dropped, ``--die-with-parent``,
  ``--new-session`` (no terminal injection), a root that holds only the read-only runtime (``/usr``
  and the Python installation) plus fresh ``/proc`` and ``/dev``, and a size-capped tmpfs scratch.
  Preferred: it is a small, audited setuid-free tool that does the mount dance correctly.
* ``namespaces``: the same namespaces through util-linux ``unshare`` (always installed) and a short
  set-up in the sandboxed interpreter (:data:`NSINIT`) that bind-mounts the runtime read-only into
  a tmpfs root and ``chroot``s into it. For hosts without bubblewrap.
* ``none``: a plain subprocess with rlimits only; the host file system and network are reachable.
  Never chosen by ``auto``, and warned about at every start.

In both isolated modes the driver then sets rlimits (address space, CPU time, file size, no core
files) and installs a seccomp filter (:func:`seccomp_program`, x86-64) before the first byte of
the solution runs. The filter denies creating processes (``fork``, ``vfork``, ``clone`` without
``CLONE_THREAD``; ``clone3`` answers ENOSYS so threads fall back to ``clone``), ``execve``,
``ptrace``, raising resource limits, sockets, mounts and namespaces, and a few kernel attack
surfaces (bpf, io_uring, userfaultfd, perf, keyrings), and memory that RLIMIT_AS does not count
(memfd, System V shared memory and message queues, POSIX message queues); nor can it leave the
reach of the timeout's kill (``setsid``, ``setpgid``, ``prctl(PR_SET_PDEATHSIG)``). This is what holds for root, where
RLIMIT_NPROC does not: the process cannot create another process. Threads are bounded by the
address-space limit and, in the ``namespaces`` mode on Linux >= 6.14, by the PID namespace's
pid_max (:data:`SANDBOX_PID_MAX`); under bwrap only by the former, so ``auto`` prefers ``namespaces``
on such kernels (:func:`auto_order`). Landlock is not used: the mount namespace already reduces the visible file
system to the read-only runtime and the scratch.
"""
from __future__ import annotations

import functools
import os
import platform
import shutil
import struct
import subprocess
import sys
from typing import Sequence

from ...config.base import ConfigError


MODES = ("auto", "bwrap", "namespaces", "none")
BWRAP_INSTALL = "apt-get install -y bubblewrap"

# --- seccomp (classic BPF) -------------------------------------------------------------------------
_AUDIT_ARCH_X86_64 = 0xC000003E
_RET_ALLOW, _RET_KILL, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
# x86-64 syscall numbers denied with EPERM.
_DENY_X86_64 = {
    "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "ptrace": 101, "setrlimit": 160,
    "socket": 41, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272,
    "setns": 308, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250, "add_key": 248,
    "request_key": 249, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "process_vm_readv": 310, "process_vm_writev": 311, "personality": 135, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "kexec_load": 246, "reboot": 169, "swapon": 167,
    "swapoff": 168, "acct": 163, "open_by_handle_at": 304, "name_to_handle_at": 303,
    # memory outside RLIMIT_AS and the scratch cap: memfds, System V shared memory and message
    # queues, POSIX message queues (each run held 600 MiB under a 256 MiB limit through them)
    "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "mq_open": 240,
    # leaving the process group the timeout kills (with prctl(PR_SET_PDEATHSIG, 0) below, a sleeping
    # solution outlived its run as an orphan in the namespaces mode)
    "setsid": 112, "setpgid": 109,
}
_CLONE, _CLONE3, _PRLIMIT64, _PRCTL, _PR_SET_PDEATHSIG = 56, 435, 302, 157, 1


def _stmt(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def seccomp_program() -> bytes | None:
    """The filter as ``struct sock_filter[]`` bytes, or None where it is not built (not x86-64)."""
    if platform.machine() != "x86_64":
        return None
    LD_W_ABS, JEQ, JSET, JGE, RET = 0x20, 0x15, 0x45, 0x35, 0x06
    errno = lambda e: _stmt(RET, _RET_ERRNO | e)  # noqa: E731
    prog = [_stmt(LD_W_ABS, 4), _stmt(JEQ, _AUDIT_ARCH_X86_64, 1, 0), _stmt(RET, _RET_KILL),
            _stmt(LD_W_ABS, 0), _stmt(JGE, 0x40000000, 0, 1), _stmt(RET, _RET_KILL)]  # no x32 ABI
    for nr in sorted(_DENY_X86_64.values()):
        prog += [_stmt(JEQ, nr, 0, 1), errno(_EPERM)]
    prog += [_stmt(JEQ, _CLONE3, 0, 1), errno(_ENOSYS)]
    # clone: threads (CLONE_THREAD set in flags, args[0] low word at offset 16) only.
    prog += [_stmt(JEQ, _CLONE, 0, 4), _stmt(LD_W_ABS, 16), _stmt(JSET, _CLONE_THREAD, 1, 0), errno(_EPERM),
             _stmt(RET, _RET_ALLOW)]
    # prctl: anything but clearing the parent-death signal that ends the sandbox with its parent.
    prog += [_stmt(JEQ, _PRCTL, 0, 4), _stmt(LD_W_ABS, 16), _stmt(JEQ, _PR_SET_PDEATHSIG, 0, 1), errno(_EPERM),
             _stmt(RET, _RET_ALLOW)]
    # prlimit64: reading (new_limit, args[2] at offset 32/36, is NULL) only.
    prog += [_stmt(JEQ, _PRLIMIT64, 0, 5), _stmt(LD_W_ABS, 32), _stmt(JEQ, 0, 0, 2), _stmt(LD_W_ABS, 36),
             _stmt(JEQ, 0, 1, 0), errno(_EPERM), _stmt(RET, _RET_ALLOW)]
    return b"".join(prog)


# --- runtime view ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def runtime_paths(python: str) -> tuple[str, ...]:
    """Directories bound read-only into the sandbox: /usr and the Python installation (its prefix
    and base prefix, e.g. a virtualenv and the interpreter it was made from)."""
    probe = subprocess.run([python, "-I", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
                           capture_output=True, text=True, timeout=60, check=True)
    paths = ["/usr"] + [os.path.realpath(p) for p in probe.stdout.split()]
    paths.append(os.path.dirname(os.path.realpath(python)))
    out: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _root_links() -> tuple[tuple[str, str], ...]:
    """Top-level names (/bin, /lib, /lib64, /sbin) that the runtime needs: (name, symlink target or '')."""
    out = []
    for name in ("/bin", "/lib", "/lib64", "/sbin", "/lib32"):
        if os.path.islink(name):
            out.append((name, os.readlink(name)))
        elif os.path.isdir(name):
            out.append((name, ""))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _bwrap_has(option: str) -> bool:
    try:
        return option in subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False


def bwrap_argv(python: str, scratch_mb: int) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if _bwrap_has("--disable-userns"):  # bubblewrap >= 0.8; the seccomp filter denies unshare anyway
        argv.append("--disable-userns")
    for path in runtime_paths(python):
        argv += ["--ro-bind", path, path]
    for name, target in _root_links():
        argv += ["--symlink", target, name] if target else ["--ro-bind", name, name]
    # /dev is a tmpfs of bubblewrap's without a size cap (its /dev/shm took 300 MiB past a 64 MiB
    # scratch): read-only, so the size-capped scratch is the only writable place.
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--size", str(scratch_mb << 20), "--tmpfs", "/scratch",
             "--chdir", "/scratch", "--remount-ro", "/"]
    return argv + [python]


# Runs first in the sandboxed interpreter of the `namespaces` mode (inside fresh user, mount, PID,
# network, IPC and UTS namespaces from `unshare`): builds a tmpfs root holding only the read-only
# runtime, /proc, /dev/null and a size-capped scratch, then chroots into it.
NSINIT = r'''
def _nsinit(binds, links, scratch_bytes):
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    def mount(src, dst, fstype, flags, data=None):
        if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                      data and data.encode()) != 0:
            raise OSError(ctypes.get_errno(), "mount %s" % dst)
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # The new root's tmpfs must not hide a source of the binds (a checkout and its venv under /tmp).
    sources = list(binds) + [n for n, t in links if not t]
    under = lambda p, r: p == r or p.startswith(r + "/")
    root = next(r for r in ("/tmp", "/mnt", "/media", "/srv", "/opt", "/var/tmp", "/run")
                if os.path.isdir(r) and not any(under(p, r) or under(r, p) for p in sources))
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in binds:
        os.makedirs(root + path, exist_ok=True)
        mount(path, root + path, None, MS_BIND | MS_REC)
        mount(None, root + path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for name, target in links:
        if target:
            os.symlink(target, root + name)
        else:
            os.makedirs(root + name, exist_ok=True)
            mount(name, root + name, None, MS_BIND | MS_REC)
            mount(None, root + name, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV)
    try:  # Linux >= 6.14: pid_max is per PID namespace; threads otherwise only bounded by RLIMIT_AS
        with open(root + "/proc/sys/kernel/pid_max", "w") as f:
            f.write(str(SANDBOX_PID_MAX))
    except OSError:
        pass
    mount(root + "/proc/sys", root + "/proc/sys", None, MS_BIND | MS_REC)  # as bubblewrap does: sysctls read-only
    mount(None, root + "/proc/sys", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.makedirs(root + "/dev")
    open(root + "/dev/null", "w").close()
    mount("/dev/null", root + "/dev/null", None, MS_BIND)
    os.makedirs(root + "/scratch")
    mount("tmpfs", root + "/scratch", "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,nr_inodes=%d,mode=777"
          % (scratch_bytes, SCRATCH_INODES))
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.chroot(root)
    os.chdir("/scratch")
'''


SCRATCH_INODES = 16384
"""Files in the scratch (``namespaces`` mode; bubblewrap has no option for it): inodes are kernel
memory outside the size cap, and a run created 170,000 empty files in 2 s."""


SANDBOX_PID_MAX = 512
"""pid_max of the sandbox's PID namespace (``namespaces`` mode, Linux >= 6.14), which bounds its
threads: with 16 KiB stacks, RLIMIT_AS alone allowed tens of thousands, as many as the host's
pid_max (32768 here), so one run could leave the host unable to start a process."""


def namespaces_argv(python: str, scratch_mb: int, driver: str) -> list[str]:
    call = "SCRATCH_INODES, SANDBOX_PID_MAX = %d, %d\n_nsinit(%r, %r, %d)\n" % (
        SCRATCH_INODES, SANDBOX_PID_MAX, runtime_paths(python), _root_links(), scratch_mb << 20)
    return ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--kill-child", "--net",
            "--ipc", "--uts", python, "-I", "-c", NSINIT + call + driver]


def sandbox_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": "/scratch", "TMPDIR": "/scratch", "LANG": "C.UTF-8",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def command(mode: str, python: str, scratch_mb: int, driver: str) -> list[str]:
    """argv that runs ``driver`` (Python source) under ``mode`` (already resolved, not ``auto``)."""
    if mode == "bwrap":
        return bwrap_argv(python, scratch_mb) + ["-I", "-c", driver]
    if mode == "namespaces":
        return namespaces_argv(python, scratch_mb, driver)
    if mode == "none":
        return [python, "-I", "-c", driver]
    raise ValueError(f"unknown isolation mode {mode!r}")


_PROBE = "import os; print(len(os.listdir('/')), os.getcwd())"


@functools.lru_cache(maxsize=None)
def probe(mode: str, python: str = sys.executable) -> str:
    """'' if ``mode`` works here, else why not (one short run, cached per process)."""
    if mode == "none":
        return ""
    tool = {"bwrap": "bwrap", "namespaces": "unshare"}[mode]
    if shutil.which(tool) is None:
        return f"`{tool}` is not installed" + (f" ({BWRAP_INSTALL})" if mode == "bwrap" else "")
    try:
        r = subprocess.run(command(mode, python, 1, _PROBE), capture_output=True, text=True, timeout=60,
                           env=sandbox_env(), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{tool} failed to start: {e}"
    if r.returncode != 0 or not r.stdout.strip().endswith("/scratch"):
        return f"{tool} failed (exit {r.returncode}): {r.stderr.strip()[-300:]}"
    return ""


def pid_namespace_bounds_threads(release: str = "") -> bool:
    """Whether this kernel gives each PID namespace its own pid_max (Linux >= 6.14), which is how the
    ``namespaces`` mode bounds a run's threads; bubblewrap's sandbox cannot set it (no capability)."""
    import re

    m = re.match(r"(\d+)\.(\d+)", release or os.uname().release)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (6, 14)


def auto_order() -> tuple[str, ...]:
    """``auto``'s order: where the PID namespace bounds threads, ``namespaces`` first (under bwrap a
    run's threads are bounded only by RLIMIT_AS, enough to use up the host's process ids), else bwrap."""
    return ("namespaces", "bwrap") if pid_namespace_bounds_threads() else ("bwrap", "namespaces")


def resolve(mode: str, python: str = sys.executable) -> str:
    """The mode to use for ``reward.sandbox.isolation: mode``: ``auto`` tries :func:`auto_order`.
    Raises ``ConfigError`` naming the key when the mode (or, for auto, every mode) is unavailable."""
    if mode not in MODES:
        raise ConfigError(f"reward.sandbox.isolation must be one of {MODES}, got {mode!r}")
    tried: Sequence[str] = auto_order() if mode == "auto" else (mode,)
    why = {}
    for m in tried:
        why[m] = probe(m, python)
        if not why[m]:
            return m
    detail = "; ".join(f"{m}: {w}" for m, w in why.items())
    raise ConfigError(f"reward.sandbox.isolation: {mode}: no isolation available for model-written code "
                       f"({detail}). Install bubblewrap ({BWRAP_INSTALL}) or allow user namespaces; to run "
                       "code rewards without isolation set reward.sandbox.isolation: none explicitly")
