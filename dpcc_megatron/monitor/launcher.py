"""Start the sidecar as a subprocess and wait until it listens (used by the demo, the
launchers and the tests). Stdlib only.

    handle = start_sidecar("runs/x/monitor/monitor.sqlite", tensorboard_dir="runs/x/monitor/tb")
    client = MonitorClient(handle.address, handle.token, run_id="x")
    ...
    handle.stop()

The token travels to the child in the environment (``DPCC_MONITOR_TOKEN``), never on
its command line. The child's output goes to ``log_path`` (never a pipe nobody reads).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

from .server import TOKEN_ENV

_PATH_FIELDS = ("db_path", "spool_path", "tensorboard_dir", "alerts_jsonl")


def resolve_paths(cfg: Any, output_dir: Optional[str] = None) -> dict[str, Optional[str]]:
    """The config's relative paths resolved against ``output_dir`` (None keeps them as given)."""
    out = {}
    for name in _PATH_FIELDS:
        value = getattr(cfg, name)
        if value is not None and output_dir is not None and not os.path.isabs(value):
            value = os.path.join(output_dir, value)
        out[name] = value
    return out


class SidecarHandle:
    """A running sidecar subprocess: ``address`` (HOST:PORT), ``token``, ``process``."""

    def __init__(self, process: subprocess.Popen, address: str, token: str, db_path: str,
                 log_path: Optional[str], argv: list[str], env: dict):
        self.process = process
        self.address = address
        self.token = token
        self.db_path = db_path
        self.log_path = log_path
        self._argv = argv
        self._env = env

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def healthz(self, timeout: float = 2.0) -> dict:
        with urllib.request.urlopen(f"{self.url}/healthz", timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGTERM, wait up to ``timeout`` s (it flushes SQLite/TensorBoard), then SIGKILL."""
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGTERM)
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
            except ProcessLookupError:
                pass
        try:
            return self.process.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL (simulates a crash; data committed so far stays in SQLite)."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "SidecarHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"SidecarHandle(address={self.address!r}, pid={self.pid}, db={self.db_path!r})"


def start_sidecar(db_path: Optional[str] = None, *, listen: str = "127.0.0.1:0", token: Optional[str] = None,
                  cfg: Any = None, config_path: Optional[str] = None, output_dir: Optional[str] = None,
                  tensorboard_dir: Optional[str] = None, alerts_jsonl: Optional[str] = None,
                  webhook_url: Optional[str] = None, log_path: Optional[str] = None,
                  ready_timeout: float = 30.0, exit_with_parent: bool = True,
                  python: Optional[str] = None) -> SidecarHandle:
    """Start ``dpcc-megatron monitor serve`` in a subprocess and wait until it listens.

    ``cfg`` (a MonitorConfig) supplies detector/sink settings and, when the arguments are
    None, ``db_path``/``tensorboard_dir``/``alerts_jsonl``/``webhook_url`` (relative ones
    resolved against ``output_dir``, else the directory of an explicit ``db_path``). ``config_path`` passes a job YAML instead. ``token`` None uses
    $DPCC_MONITOR_TOKEN, else the config's, else a fresh random one (``handle.token``).
    With ``exit_with_parent`` the sidecar shuts itself down once this process is gone."""
    if cfg is not None:
        # relative config paths: against output_dir, else next to an explicit db_path, else the cwd
        base = output_dir if output_dir is not None else (str(Path(db_path).parent) if db_path else None)
        paths = resolve_paths(cfg, base)
        db_path = db_path or paths["db_path"]
        tensorboard_dir = tensorboard_dir if tensorboard_dir is not None else paths["tensorboard_dir"]
        alerts_jsonl = alerts_jsonl if alerts_jsonl is not None else paths["alerts_jsonl"]
        webhook_url = webhook_url or cfg.webhook_url
        token = token or os.environ.get(TOKEN_ENV) or cfg.token
    if not db_path:
        raise ValueError("start_sidecar needs db_path (or cfg)")
    token = token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dpcc-monitor-"))
    ready = work / "ready.json"
    argv = [python or sys.executable, "-m", "dpcc_megatron.cli", "monitor", "serve", "--listen", listen,
            "--db", str(db_path), "--ready-file", str(ready)]
    if cfg is not None:
        from ..config.base import to_dict

        data = to_dict(cfg)
        data["token"] = None  # the token goes through the environment only
        # resolved here, absolute, so the child does not re-resolve them against its own cwd
        data["db_path"] = os.path.abspath(db_path)
        for key, value in (("tensorboard_dir", tensorboard_dir), ("alerts_jsonl", alerts_jsonl),
                           ("webhook_url", webhook_url)):
            data[key] = (os.path.abspath(value) if value and key != "webhook_url" else value) or None
        cfg_file = work / "monitor-config.yaml"  # JSON is YAML
        fd = os.open(cfg_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"monitor": data}, f)
        argv += ["--config", str(cfg_file)]
    elif config_path is not None:
        argv += ["--config", str(config_path)]
    if tensorboard_dir:
        argv += ["--tensorboard", str(tensorboard_dir)]
    if alerts_jsonl:
        argv += ["--alerts-jsonl", str(alerts_jsonl)]
    if webhook_url:
        argv += ["--webhook", webhook_url]
    if exit_with_parent:
        argv += ["--exit-with-pid", str(os.getpid())]
    env = dict(os.environ)
    env[TOKEN_ENV] = token
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_path = log_path or str(Path(db_path).with_suffix(".sidecar.log"))
    log_f = open(log_path, "ab")
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_f, stderr=subprocess.STDOUT, env=env)
    finally:
        log_f.close()
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if ready.is_file():
            try:
                info = json.loads(ready.read_text())
                address = info["address"]
            except (ValueError, KeyError):
                address = None  # being written
            if address is not None:
                shutil.rmtree(work, ignore_errors=True)
                return SidecarHandle(proc, address, token, str(db_path), log_path, argv, env)
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)
    tail = ""
    try:
        tail = Path(log_path).read_text(errors="replace")[-2000:]
    except OSError:
        pass
    shutil.rmtree(work, ignore_errors=True)
    raise RuntimeError(f"monitor sidecar did not become ready within {ready_timeout} s "
                       f"(exit code {proc.returncode}); log {log_path}:\n{tail}")
