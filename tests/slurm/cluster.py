"""A one-node Slurm on localhost for the tests: install, configure, start, query, stop.

Runs only as root with apt-get (as in CI); otherwise :func:`start_local_slurm` raises
:class:`SlurmUnavailable` with the reason. Daemons already answering on our config are
reused and left running; the ones started here are stopped by PID. One test session at a
time holds the cluster (an exclusive lock on ``BASE/session.lock``): a second session waits
for it, so nobody stops the daemons under another's jobs.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BASE = Path(os.environ.get("DPCC_TEST_SLURM_DIR", "/tmp/dpcc-slurm"))
MUNGE_KEY = Path("/etc/munge/munge.key")


class SlurmUnavailable(RuntimeError):
    """This machine cannot run a local Slurm; the message says why."""


def _run(cmd: list[str], timeout: float, env: Optional[dict] = None, check: bool = False
         ) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=check)
    except subprocess.TimeoutExpired as e:
        raise SlurmUnavailable(f"`{' '.join(cmd)}` timed out after {timeout:.0f}s") from e


def _install(timeout: float) -> None:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if not shutil.which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed and apt-get is not available")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    upd = _run(["apt-get", "update"], timeout, env)
    if upd.returncode != 0:
        raise SlurmUnavailable(f"apt-get update failed: {upd.stderr.strip()[-400:]}")
    # policy-rc.d answering 101 stops the packages from starting daemons on install.
    policy = Path("/usr/sbin/policy-rc.d")
    had_policy = policy.exists()
    if not had_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        inst = _run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES], timeout, env)
    finally:
        if not had_policy:
            policy.unlink(missing_ok=True)
    if inst.returncode != 0:
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {inst.stderr.strip()[-400:]}")


def slurm_conf_text(base: Path, host: str, cpus: int) -> str:
    return "\n".join([
        "ClusterName=dpcc-test",
        f"SlurmctldHost={host}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobRequeue=1",
        "MinJobAge=600",          # keep finished jobs visible to scontrol (no accounting here)
        "KillWait=5",             # SIGTERM -> SIGKILL grace on cancel / time limit
        # A requeued job waits cred_expire + 1 s before it may start again (default 120 s).
        "AuthInfo=cred_expire=5",
        "SchedulerParameters=sched_interval=2",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        f"StateSaveLocation={base}/state",
        f"SlurmdSpoolDir={base}/spool",
        f"SlurmctldPidFile={base}/slurmctld.pid",
        f"SlurmdPidFile={base}/slurmd.pid",
        f"SlurmctldLogFile={base}/slurmctld.log",
        f"SlurmdLogFile={base}/slurmd.log",
        f"NodeName={host} CPUs={cpus} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ])


@dataclass
class LocalSlurm:
    """Handle on the running local cluster; ``env`` points the Slurm clients at it."""

    base: Path
    conf: Path
    env: dict
    started: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    lock: Optional[int] = None
    """File descriptor of the session lock, released by :meth:`stop`."""

    def sbatch(self, args: list[str], env: Optional[dict] = None, attempts: int = 3) -> int:
        """Submit; a busy slurmctld (socket time-out) gets two more tries."""
        for attempt in range(attempts):
            res = _run(["sbatch", "--parsable", *args], 60, env or self.env)
            if res.returncode == 0:
                return int(res.stdout.strip().split(";")[0])
            time.sleep(2)
        raise RuntimeError(f"sbatch {' '.join(args)} failed {attempts} times (status {res.returncode}): "
                           f"{res.stderr.strip()} {res.stdout.strip()}")

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, ...)."""
        res = _run(["scontrol", "show", "job", "-o", str(job_id)], 15, self.env)
        if res.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {res.stderr.strip()}")
        return dict(re.findall(r"(\w+)=(\S*)", res.stdout))

    def signal_batch(self, job_id: int, sig: str) -> None:
        """Signal the batch shell only, as ``--signal=B:SIG@N`` does before the time limit."""
        res = _run(["scancel", "--batch", f"--signal={sig}", str(job_id)], 15, self.env)
        if res.returncode != 0:
            raise RuntimeError(f"scancel --batch --signal={sig} {job_id}: {res.stderr.strip()}")

    def wait(self, job_id: int, timeout: float, states: tuple[str, ...] = (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE")) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info = self.job(job_id)
        while info.get("JobState") not in states:
            if time.monotonic() > deadline:
                _run(["scancel", str(job_id)], 15, self.env)
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f}s")
            time.sleep(0.5)
            info = self.job(job_id)
        return info

    def stop(self) -> None:
        for name, proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self.started.clear()
        if self.lock is not None:
            os.close(self.lock)  # releases the flock
            self.lock = None


def _up(env: dict) -> bool:
    try:
        ping = _run(["scontrol", "ping"], 10, env)
        state = _run(["sinfo", "-h", "-o", "%t"], 10, env)
    except SlurmUnavailable:
        return False
    return "UP" in ping.stdout and state.stdout.strip().rstrip("*") in ("idle", "mix", "alloc")


def _munge_ok() -> bool:
    """A credential made by munge decodes with unmunge: munged is up and the key is readable."""
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, text=True, timeout=10)
        if cred.returncode != 0:
            return False
        return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, text=True,
                              timeout=10).returncode == 0
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return False


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _wait_for(pred, timeout: float, what: str, procs: list[tuple[str, subprocess.Popen]], base: Path) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for name, p in procs:
            if p.poll() is not None:
                log = (base / f"{name}.log")
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                raise SlurmUnavailable(f"{name} exited with {p.returncode} while waiting for {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.3)


def _session_lock(path: Path, timeout: float) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise SlurmUnavailable(f"another test session held the local Slurm ({path}) for {timeout:.0f}s")
            time.sleep(1)


def start_local_slurm(install_timeout: float = 300, start_timeout: float = 60,
                      lock_timeout: float = 600) -> LocalSlurm:
    """Install (if needed), configure and start a one-node Slurm; reuse one already up."""
    if os.geteuid() != 0:
        if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
            raise SlurmUnavailable("the local Slurm runs its daemons as root; the tests are not root")
        raise SlurmUnavailable("Slurm is not installed and the tests are not running as root")
    BASE.mkdir(parents=True, exist_ok=True)
    lock = _session_lock(BASE / "session.lock", lock_timeout)
    try:
        _install(install_timeout)
        cluster = _start_cluster(start_timeout)
    except BaseException:
        os.close(lock)
        raise
    cluster.lock = lock
    return cluster


def _start_cluster(start_timeout: float) -> LocalSlurm:
    for sub in ("state", "spool"):
        (BASE / sub).mkdir(exist_ok=True)
    host = socket.gethostname().split(".")[0]
    conf = BASE / "slurm.conf"
    text = slurm_conf_text(BASE, host, os.cpu_count() or 1)
    env = dict(os.environ, SLURM_CONF=str(conf))
    if conf.exists() and conf.read_text() == text and _up(env):
        return LocalSlurm(BASE, conf, env)
    _stop_stale(BASE, conf)
    conf.write_text(text)
    cluster = LocalSlurm(BASE, conf, env)
    try:
        if not _munge_ok():
            _start_munge(cluster)
        cluster.started.append(("slurmctld", _start(["slurmctld", "-D", "-c", "-f", str(conf)],
                                                    BASE / "slurmctld.out")))
        _wait_for(lambda: "UP" in _run(["scontrol", "ping"], 10, env).stdout, start_timeout,
                  "slurmctld to answer", cluster.started, BASE)
        cluster.started.append(("slurmd", _start(["slurmd", "-D", "-f", str(conf)], BASE / "slurmd.out")))
        _wait_for(lambda: _up(env), start_timeout, f"node {host} to be idle in sinfo", cluster.started, BASE)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _stop_stale(base: Path, conf: Path, timeout: float = 15) -> None:
    """Stop daemons an earlier run left on this config (found by their pid files in ``base``)."""
    for name in ("slurmd", "slurmctld"):
        pidfile = base / f"{name}.pid"
        try:
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if name not in cmdline or str(conf) not in cmdline:
            continue  # the pid was reused by something else
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)


def _start_munge(cluster: LocalSlurm) -> None:
    if not MUNGE_KEY.exists():
        MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
        MUNGE_KEY.write_bytes(os.urandom(1024))
    shutil.chown(MUNGE_KEY, "munge", "munge")
    MUNGE_KEY.chmod(0o400)
    for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    # -F: stay in the foreground so the PID we hold is munged itself.
    cluster.started.append(("munged", _start(["setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "munged", "-F"],
                                             BASE / "munged.out")))
    _wait_for(_munge_ok, 30, "munged", cluster.started, BASE)
