"""The trusted half of a code verdict: the tests run here, the solution runs in the sandbox.

The test file (from the data set, trusted) is executed statement by statement in this process.
Every name the solution defines appears in the tests' scope either as a plain value or as a
:class:`Remote` proxy; calling a proxy sends the (plain-data) arguments to the sandbox over the
session and returns the decoded (plain-data) result. Consequences:

* the verdict (which statements raised) is decided here, never in the process the solution
  controls: frame inspection, patched builtins, ``sys.exit``/``os._exit`` and printed verdicts
  cannot reach it (an early exit kills the channel, and every statement after fails);
* only built-in ``None``/``bool``/``int``/``float``/``complex``/``str``/``bytes`` and
  ``list``/``tuple``/``dict``/``set``/``frozenset`` of them cross; any other object stays in the
  sandbox behind a proxy that can be called, indexed, iterated and asked for attributes or its
  length, but never compared by value nor used as a truth value, so a rigged ``__eq__`` or
  ``__bool__`` cannot pass an assert;
* the test file never enters the sandbox, so the solution cannot read the expected answers.

Limits (see docs/sandbox.md): tests that pass callables or instances of their own classes to the
solution, or that rely on object identity across the boundary, fail; list/dict/set arguments are
copied back after a call (in-place mutation works) but aliasing between arguments is not kept.
"""
from __future__ import annotations

import ast
import builtins
import sys
import time
from typing import Callable, Optional

from .driver import decode, encode

MAX_MESSAGE_BYTES = 16 << 20
"""Largest protocol message accepted from the sandbox; a bigger one kills the run (output flood)."""


class ChannelDead(BaseException):
    """The sandbox stopped answering (exit, crash, limit, protocol violation). A BaseException, so
    that ``except Exception`` in a test cannot turn a dead solution into a passing statement."""

    def __init__(self, reason: str, timed_out: bool = False):
        super().__init__(reason)
        self.reason, self.timed_out = reason, timed_out


class JudgeTimeout(BaseException):
    """The run's wall-clock budget ran out while the trusted tests were executing."""


class RemoteError(Exception):
    """The solution raised an exception that is not a built-in one."""


class SandboxUnavailable(Exception):
    """The sandbox itself failed (not the code under test): the sample is skipped and counted."""


def _exception(kind: str, message: str) -> BaseException:
    cls = getattr(builtins, kind, None) if type(kind) is str else None
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, StopIteration):
        try:
            return cls(message)
        except Exception:
            pass
    return RemoteError(f"{kind}: {message}")


class SandboxStop(RuntimeError):
    """The sandbox failed too often in a row (``reward.sandbox.remote.max_failures``): stop the job."""


class Remote:
    """A solution object that is not plain data; every use is a request to the sandbox."""

    __slots__ = ("_session", "_h")

    def __init__(self, session: "Session", h: int):
        self._session, self._h = session, h

    def __call__(self, *args, **kwargs):
        return self._session.call(self._h, args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._session.op({"op": "attr", "h": self._h, "n": name})

    def __iter__(self):
        return self._session.op({"op": "iter", "h": self._h})

    def __next__(self):
        return self._session.op({"op": "next", "h": self._h})

    def __len__(self) -> int:
        return self._session.op({"op": "len", "h": self._h})

    def __getitem__(self, key):
        return self._session.op({"op": "item", "h": self._h, "key": self._session.encode(key)})

    def __bool__(self) -> bool:
        raise TypeError("a solution object that is not plain data has no truth value here")

    def __repr__(self) -> str:
        return f"<solution object #{self._h}>"


class Session:
    """Request/response with one solution. ``transport(line) -> dict`` sends one request line and
    returns the decoded answer; it raises :class:`ChannelDead` when the sandbox is gone."""

    def __init__(self, transport: Callable[[str], dict]):
        self.transport = transport
        self.dead: Optional[ChannelDead] = None

    def encode(self, value):
        def other(x):
            if isinstance(x, Remote) and x._session is self:
                return {"$h": x._h}
            raise TypeError(f"only plain data can be passed to the solution, not {type(x).__name__}")
        return encode(value, other)

    def decode(self, value):
        try:
            return decode(value, lambda h: Remote(self, h))
        except (ValueError, TypeError, RecursionError) as e:
            raise self._die(ChannelDead(f"malformed answer from the sandbox: {e}"))

    def _die(self, e: ChannelDead) -> ChannelDead:
        self.dead = self.dead or e
        return self.dead

    def request(self, msg: dict) -> dict:
        if self.dead is not None:
            raise self.dead
        try:
            line = _dumps(msg)
        except (ValueError, TypeError, RecursionError) as e:
            raise TypeError(f"cannot send this value to the solution: {e}") from None
        try:
            answer = self.transport(line)
        except ChannelDead as e:
            raise self._die(e)
        if type(answer) is not dict:
            raise self._die(ChannelDead("malformed answer from the sandbox"))
        return answer

    def _result(self, answer: dict, key: str = "ok"):
        if "err" in answer:
            err = answer["err"]
            if type(err) is not list or len(err) != 2:
                raise self._die(ChannelDead("malformed answer from the sandbox"))
            raise _exception(err[0], str(err[1])[:300])
        if key not in answer:
            raise self._die(ChannelDead("malformed answer from the sandbox"))
        return self.decode(answer[key])

    def op(self, msg: dict):
        answer = self.request(msg)
        if msg["op"] == "next" and answer.get("stop") is True:
            raise StopIteration
        return self._result(answer)

    def call(self, h: int, args: tuple, kwargs: dict):
        msg = {"op": "call", "h": h, "a": [self.encode(a) for a in args],
               "k": {str(k): self.encode(v) for k, v in kwargs.items()}}
        answer = self.request(msg)
        out = self._result(answer)
        after = answer.get("after")
        if type(after) is list and len(after) == len(args):
            for mine, theirs in zip(args, after):
                if theirs is not None and type(mine) in (list, dict, set):
                    _copy_back(mine, self.decode(theirs))
        return out

    def start(self, source: str, setup: dict) -> dict:
        """Send the solution; its public names as plain values or proxies (raises if loading failed)."""
        answer = self.request({**setup, "source": source})
        if "err" in answer:
            return self._result(answer)
        names = answer.get("ok")
        if type(names) is not dict:
            raise self._die(ChannelDead("malformed answer from the sandbox"))
        out = {}
        for k, v in names.items():
            if type(v) is dict and set(v) == {"$m"}:  # a module the solution imported: the trusted copy, if any
                module = _trusted_module(v["$m"])
                if module is not None:
                    out[str(k)] = module
            else:
                out[str(k)] = self.decode(v)
        return out


# Conventional aliases of third-party modules that tests written for one shared scope use without
# importing them (``np.allclose(...)``): like a standard-library module's name, never the solution's object.
_ALIASES = {"np": "numpy", "numpy": "numpy", "pd": "pandas", "pandas": "pandas", "scipy": "scipy"}


def _trusted_module(name):
    """The tests' own copy of a module the solution imported (tests written for one shared scope use
    e.g. ``math`` without importing it): already loaded here, or a top-level standard-library module
    (or one of :data:`_ALIASES`) imported now; else None. The name comes from the solution (a module
    object's ``__name__`` is writable), so nothing else is imported: ``venv.__main__`` or
    ``test.autotest`` would run code in this process."""
    if type(name) is not str or any(part.startswith("_") for part in name.split(".")):
        return None
    module = sys.modules.get(name)
    if module is None and "." not in name and (name in sys.stdlib_module_names or name in _ALIASES.values()) \
            and name not in ("antigravity", "this"):
        import importlib

        try:
            module = importlib.import_module(name)
        except (Exception, SystemExit):
            return None
    return module


def test_scope(names: dict, body: list[ast.stmt]) -> dict:
    """What of the solution's names the tests see. Never a built-in's name (a solution's ``all`` or
    ``isinstance`` would decide the asserts that use them); for a standard-library module's name
    the tests do not call directly (``math.isclose(...)``, not ``copy(...)``), and for a conventional
    alias such as ``np`` (:data:`_ALIASES`), the trusted module."""
    called = {n.func.id for stmt in body for n in ast.walk(stmt)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    out = {}
    for name, value in names.items():
        if hasattr(builtins, name) or name.startswith("__"):  # `__builtins__` would replace the tests' built-ins
            continue
        if name in _ALIASES and getattr(value, "__name__", None) != _ALIASES[name]:  # `class np: ...`, or another module
            value = _trusted_module(_ALIASES[name])
            if value is None:
                continue
        elif name in sys.stdlib_module_names and name not in called and not isinstance(value, type(sys)):
            value = _trusted_module(name)
            if value is None:
                continue
        out[name] = value
    return out


def _copy_back(mine, theirs) -> None:
    if type(mine) is not type(theirs):
        return
    if type(mine) is list:
        mine[:] = theirs
    else:
        mine.clear()
        mine.update(theirs)


def _dumps(msg: dict) -> str:
    import json

    return json.dumps(msg, allow_nan=True) + "\n"


def _describe(e: BaseException) -> str:
    return (type(e).__name__ + ": " + str(e))[:300]


def _deadline_tracer(deadline: float):
    def trace(frame, event, arg):
        if frame.f_code.co_filename != "tests.py":  # only the test file's own lines are traced
            return None
        if time.monotonic() > deadline:
            raise JudgeTimeout("tests exceeded the time limit")
        return trace
    return trace


def statements(tests: str) -> tuple[Optional[list[ast.stmt]], int, Optional[str]]:
    """Top-level statements of the test file, how many are checks (assert / bare expression), error."""
    try:
        body = ast.parse(tests).body
    except (SyntaxError, ValueError) as e:
        return None, 1, "tests: " + _describe(e)
    return body, max(1, sum(isinstance(s, (ast.Assert, ast.Expr)) for s in body)), None


def run_judge(session: Session, source: str, setup: dict, body: list[ast.stmt], total: int,
              partial: bool, deadline: float) -> dict:
    """Run ``body`` (trusted tests) against ``source`` in ``session``; the verdict dict
    ``{passed, total, error, timed_out}``. :class:`ChannelDead` from the transport is folded in."""
    verdict = {"passed": 0, "total": total, "error": None, "timed_out": False}
    try:
        names = session.start(source, setup)
    except ChannelDead as e:
        return {**verdict, "error": e.reason, "timed_out": e.timed_out}
    except Exception as e:
        return {**verdict, "error": "solution: " + _describe(e)}
    scope = test_scope(names, body)
    scope.update(__builtins__=builtins, __name__="tests")
    passed, first_error = 0, None
    previous = sys.gettrace()
    sys.settrace(_deadline_tracer(deadline))
    try:
        for stmt in body:
            try:
                exec(compile(ast.Module(body=[stmt], type_ignores=[]), "tests.py", "exec"), scope)
                passed += isinstance(stmt, (ast.Assert, ast.Expr))
            except (JudgeTimeout, KeyboardInterrupt):
                raise
            except BaseException as e:  # SystemExit from a test line is that line's failure
                if isinstance(e, ChannelDead) and e.timed_out:
                    raise
                first_error = first_error or f"tests line {stmt.lineno}: {_describe(e)}"
                if not partial:
                    break
    except JudgeTimeout:
        return {**verdict, "error": "timeout", "timed_out": True}
    except ChannelDead as e:
        return {**verdict, "error": e.reason, "timed_out": True}
    finally:
        sys.settrace(previous)
    if session.dead is not None:  # a test swallowed the error: the solution still failed to answer
        if session.dead.timed_out:
            return {**verdict, "error": session.dead.reason, "timed_out": True}
        first_error = first_error or session.dead.reason
        if not partial:
            passed = 0
    if not partial:
        passed = total if first_error is None else 0
    return {**verdict, "passed": passed, "error": first_error}
