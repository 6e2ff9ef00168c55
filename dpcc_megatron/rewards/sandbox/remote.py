"""Remote backend: a SandboxFusion service (``POST {url}/run_code``) runs the code.

Request (SandboxFusion's ``RunCodeRequest``)::

    {"code": <driver>, "language": "python", "stdin": <protocol lines>, "run_timeout": s,
     "compile_timeout": s, "memory_limit_MB": mb, "files": {}, "fetch_files": []}

Response (``RunCodeResponse``)::

    {"status": "Success" | "Failed" | "SandboxError", "message": str, "compile_result": ...,
     "run_result": {"status": "Finished" | "Error" | "TimeLimitExceeded", "execution_time": s,
                    "return_code": int, "stdout": str, "stderr": str}, "files": {}}

``run_code`` is one-shot, so the verdict protocol of :mod:`.judge` is replayed: each round sends
the driver every request the trusted tests have made so far (the driver answers them in order,
deterministically), and the tests run again on those answers; a request with no answer yet stops
that statement, is queued, and the next statements go on (so independent asserts need two rounds).
A round whose requests diverge from the last keeps only the common prefix. The verdict is
decided here, as with the local backend.

Service failures (connection errors, HTTP errors, ``SandboxError``, malformed replies) are retried
``retries`` times; then the run is skipped (:class:`~.judge.SandboxUnavailable`, counted by the
reward layer), and after ``max_failures`` such runs in a row the job stops (:class:`SandboxStop`).
At most ``max_in_flight`` requests are in flight and ``max_queue`` runs wait; beyond that a run is
skipped at once rather than queued without bound.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request

from .driver import STARTED
from .judge import ChannelDead, SandboxStop, SandboxUnavailable, Session, run_judge, statements
from .local import DRIVER_SOURCE, rlimits

log = logging.getLogger(__name__)

MAX_ROUNDS = 64
"""Rounds of one run; a test file with more dependent calls is skipped (counted) on this backend."""


class _NeedMore(BaseException):
    """The request has no answer yet in this round."""


class _Replay:
    """Transport of one round: answers the requests sent in the previous round, queues new ones."""

    def __init__(self, sent: list[str], answers: list[dict], died: ChannelDead | None):
        self.sent, self.answers, self.died = sent, answers, died
        self.pos = 0
        self.diverged = False
        self.prefix = 0
        self.wanted: list[str] = []

    def __call__(self, line: str) -> dict:
        i = self.pos
        self.pos += 1
        if not self.diverged and i < len(self.sent) and self.sent[i] == line:
            self.prefix = i + 1
            if i < len(self.answers):
                return self.answers[i]
            raise self.died or ChannelDead("the sandbox gave no answer")
        self.diverged = True
        self.wanted.append(line)
        raise _NeedMore()


def _canonical(x):
    """An answer with set and dict contents in a fixed order (string hashes differ between runs)."""
    if type(x) is list:
        return [_canonical(v) for v in x]
    if type(x) is dict:
        if len(x) == 1 and next(iter(x)) in ("$s", "$f", "$d") and type(next(iter(x.values()))) is list:
            (tag, body), = x.items()
            return {tag: sorted(json.dumps(_canonical(v), sort_keys=True) for v in body)}
        return {k: _canonical(v) for k, v in x.items()}
    return x


def _changed(before: tuple[list[str], list[dict]], sent: list[str], answers: list[dict]) -> bool:
    """Whether this round answered a request of the previous round's (same position, same requests
    before it) differently. Replays assume deterministic answers; a solution that varies them (random,
    time) would otherwise make every round diverge until MAX_ROUNDS and turn its run into a skip."""
    old_sent, old_answers = before
    n = 0
    while n < min(len(old_sent), len(sent)) and old_sent[n] == sent[n]:
        n += 1
    n = min(n, len(old_answers), len(answers))
    return any(_canonical(a) != _canonical(b) for a, b in zip(old_answers[:n], answers[:n]))


class RemoteSandbox:
    """Runs each solution through a SandboxFusion service; the tests run here."""

    def __init__(self, limits):
        self.limits, self.remote = limits, limits.remote
        if not self.remote.url:
            from ...config.base import ConfigError

            raise ConfigError("reward.sandbox.remote.url must be set when reward.sandbox.backend is remote")
        self.url = self.remote.url.rstrip("/") + "/run_code"
        self.setup = {"rlimits": rlimits(limits), "seccomp": None}  # the service isolates; its kernel is unknown
        self._stop = SandboxStop
        self._slots = threading.BoundedSemaphore(self.remote.max_in_flight)
        self._lock = threading.Lock()
        self._waiting = 0
        self.failures_in_a_row = 0
        self.counts = {"requests": 0, "retries": 0, "failed_runs": 0, "queue_full": 0}

    def describe(self) -> str:
        return f"remote SandboxFusion at {self.url}"

    def run_tests(self, code: str, tests: str, partial: bool = False) -> dict:
        body, total, error = statements(tests)
        if body is None:
            return {"passed": 0, "total": total, "error": error, "timed_out": False}
        sent = [json.dumps({**self.setup, "source": code}) + "\n"]
        before: tuple[list[str], list[dict]] = ([], [])
        for _ in range(MAX_ROUNDS):
            answers, died = self._execute(sent)
            if _changed(before, sent, answers):  # it would never converge: a wrong answer, not a skip
                return {"passed": 0, "total": total, "timed_out": False,
                        "error": "the solution answered the same requests differently when replayed"}
            before = (sent, answers)
            replay = _Replay(sent, answers, died)
            # every round runs all statements (partial), so the later statements queue their requests too
            verdict = run_judge(Session(replay), code, self.setup, body, total, True,
                                time.monotonic() + self.limits.timeout_s)
            if verdict["timed_out"]:
                return verdict
            if not replay.wanted:
                if not partial:
                    verdict["passed"] = total if verdict["error"] is None else 0
                return verdict
            sent = sent[:replay.prefix] + replay.wanted
        raise SandboxUnavailable(f"more than {MAX_ROUNDS} rounds of dependent calls for the remote sandbox")

    # --- one run_code request -------------------------------------------------------------------
    def _execute(self, lines: list[str]) -> tuple[list[dict], ChannelDead | None]:
        payload = {"code": DRIVER_SOURCE, "language": "python", "stdin": "".join(lines),
                   "run_timeout": self.limits.timeout_s, "compile_timeout": self.limits.timeout_s,
                   "memory_limit_MB": self.limits.memory_mb, "files": {}, "fetch_files": []}
        reply = self._post(payload)
        run = reply.get("run_result") or {}
        answers = []
        for raw in str(run.get("stdout") or "").splitlines():
            try:
                answers.append(json.loads(raw))
            except ValueError:
                break
        status = run.get("status")
        if not answers or answers.pop(0) != STARTED:
            if status == "TimeLimitExceeded":
                return [], ChannelDead("timeout", True)
            raise SandboxUnavailable(f"the remote sandbox did not start the program: {run.get('status')}, "
                                     f"{str(run.get('stderr') or '')[-300:]}")
        if len(answers) >= len(lines):
            return answers, None
        timed_out = status == "TimeLimitExceeded"
        reason = "timeout" if timed_out else (f"the solution's process exited (exit {run.get('return_code')}): "
                                             f"{str(run.get('stderr') or '')[-300:]}")
        return answers, ChannelDead(reason, timed_out)

    def _post(self, payload: dict) -> dict:
        with self._lock:
            if self._waiting >= self.remote.max_in_flight + self.remote.max_queue:
                self.counts["queue_full"] += 1
                raise SandboxUnavailable(f"remote sandbox queue full ({self.remote.max_queue} runs waiting)")
            self._waiting += 1
        try:
            with self._slots:
                reply, why = None, ""
                for attempt in range(self.remote.retries + 1):
                    if attempt:
                        with self._lock:
                            self.counts["retries"] += 1
                        time.sleep(min(2.0, 0.2 * 2 ** (attempt - 1)))
                    reply, why = self._post_once(payload)
                    if reply is not None:
                        break
        finally:
            with self._lock:
                self._waiting -= 1
        with self._lock:
            if reply is not None:
                self.failures_in_a_row = 0
                return reply
            self.failures_in_a_row += 1
            self.counts["failed_runs"] += 1
            n = self.failures_in_a_row
        log.warning("remote sandbox %s failed after %d tries: %s (%d in a row)", self.url,
                    self.remote.retries + 1, why, n)
        if n >= self.remote.max_failures:
            raise self._stop(f"reward.sandbox.remote: {n} runs in a row failed at {self.url} "
                             f"(max_failures {self.remote.max_failures}); last error: {why}")
        raise SandboxUnavailable(f"remote sandbox failed: {why}")

    def _post_once(self, payload: dict) -> tuple[dict | None, str]:
        with self._lock:
            self.counts["requests"] += 1
        data = json.dumps(payload).encode("utf-8")
        req = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.remote.request_timeout_s + self.limits.timeout_s) as r:
                reply = json.loads(r.read(64 << 20))
        except urllib.error.HTTPError as e:
            return None, f"HTTP {e.code}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            return None, f"{type(e).__name__}: {e}"
        if type(reply) is not dict or reply.get("status") not in ("Success", "Failed"):
            status = reply.get("status") if type(reply) is dict else None
            message = reply.get("message") if type(reply) is dict else None
            return None, f"service status {status!r}: {str(message)[:200]}"
        if type(reply.get("run_result")) is not dict:
            return None, "reply without run_result"
        return reply, ""
