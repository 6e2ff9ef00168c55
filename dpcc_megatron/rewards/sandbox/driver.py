"""The only program that runs inside the sandbox: it loads the solution and answers calls on it.

This file is sent as source (``python -I -c``) into the isolated process, so it imports the
standard library only. It is also imported by the trusted side for its plain-data codec
(:func:`encode` / :func:`decode`), so both ends speak exactly the same format.

Protocol (one JSON document per line):

* first line from the trusted side: ``{"rlimits": [[name, soft, hard], ...], "seccomp": hex|null,
  "source": str}``; the driver applies the limits, installs the seccomp filter, then runs the
  solution as module ``solution`` and answers ``{"ok": {name: value, ...}}`` (its public globals;
  a module it imported as ``{"$m": module name}``) or ``{"err": [type, message]}``;
* then requests ``{"op": "call"|"attr"|"iter"|"next"|"len"|"item", "h": handle, ...}``, each
  answered by ``{"ok": value}`` (``call`` adds ``"after"``: the list/dict/set arguments after the
  call, so in-place mutation reaches the caller), ``{"stop": true}`` (``next`` at the end) or
  ``{"err": [type, message]}``.

Values cross as plain data only: ``None``, ``bool``, ``int``, ``float``, ``str`` and ``list`` as
JSON, and tagged objects for ``tuple`` (``$t``), ``set`` (``$s``), ``frozenset`` (``$f``),
``dict`` (``$d``, a list of pairs), ``bytes`` (``$b``, base64) and ``complex`` (``$c``). A subclass
of one of these (``Counter``, a ``namedtuple``, an ``IntEnum``, or one with a rigged ``__eq__``)
and a numpy scalar cross as their plain content, so its methods are never used on the trusted
side. Anything else stays in the sandbox and crosses as a handle ``{"$h": n}``: the trusted side
can call it, read attributes, iterate, index or take its length, but never compares it by value.

The solution's own stdin and stdout are /dev/null: the protocol runs on private duplicates of
fds 0 and 1, made before the solution's first byte runs.
"""
import base64
import json
import os

_TAGS = ("$t", "$s", "$f", "$d", "$b", "$c", "$h")
STARTED = {"started": True}
_BASES = (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)
MAX_HASH_REPEATS = 64
"""Most keys of one decoded set/dict that may share a hash with another key. Unequal ints can be
chosen to share a hash (``k * (2**61 - 1)``), which makes building the set quadratic: a 1 MiB
answer would hold the trusted process for a minute. Honest data almost never repeats a hash."""


def encode(x, other):
    """``x`` as JSON-ready plain data; ``other(x)`` gives the encoding of a non-plain object."""
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if t is list:
        return [encode(v, other) for v in x]
    if t is tuple:
        return {"$t": [encode(v, other) for v in x]}
    if t is set or t is frozenset:
        return {"$s" if t is set else "$f": [encode(v, other) for v in x]}
    if t is dict:
        return {"$d": [[encode(k, other), encode(v, other)] for k, v in x.items()]}
    if t is bytes:
        return {"$b": base64.b64encode(x).decode("ascii")}
    if t is complex:
        return {"$c": [x.real, x.imag]}
    for base in _BASES:  # a subclass (Counter, namedtuple, IntEnum, a rigged one) crosses as its content
        if isinstance(x, base):
            return encode(base(x), other)
    if t.__module__ == "numpy" and getattr(x, "shape", None) == ():  # numpy scalars, as Python numbers
        return encode(x.item(), other)
    return other(x)


def decode(x, handle):
    """The inverse of :func:`encode`; ``handle(n)`` turns ``{"$h": n}`` into an object. Builds only
    built-in types, whatever the input: a malformed document raises ``ValueError``."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [decode(v, handle) for v in x]
    if type(x) is not dict or len(x) != 1:
        raise ValueError("malformed value")
    (tag, body), = x.items()
    if tag == "$h" and type(body) is int:
        return handle(body)
    if tag == "$b" and type(body) is str:
        return base64.b64decode(body.encode("ascii"), validate=True)
    if type(body) is not list or tag not in _TAGS:
        raise ValueError("malformed value")
    if tag == "$c" and len(body) == 2 and all(type(v) in (int, float) for v in body):
        return complex(body[0], body[1])
    items = [decode(v, handle) for v in body]
    if tag in ("$s", "$f", "$d") and len(items) > MAX_HASH_REPEATS:
        keys = [p[0] for p in items if type(p) is list and p] if tag == "$d" else items
        if len(keys) - len({hash(k) for k in keys}) > MAX_HASH_REPEATS:
            raise ValueError("too many keys with the same hash")
    if tag == "$t":
        return tuple(items)
    if tag == "$s":
        return set(items)
    if tag == "$f":
        return frozenset(items)
    if tag == "$d" and all(type(p) is list and len(p) == 2 for p in items):
        return {k: v for k, v in items}
    raise ValueError("malformed value")


def _install_seccomp(program):
    import ctypes

    class _Filter(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    prog = _Filter(len(program) // 8, program)
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def _serve():
    import resource

    req = os.fdopen(os.dup(0), "r", encoding="utf-8", newline="\n")
    chan = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    handles = []

    def keep(obj):
        handles.append(obj)
        return {"$h": len(handles) - 1}

    def send(msg):
        chan.write(json.dumps(msg) + "\n")
        chan.flush()

    def fail(e):
        send({"err": [type(e).__name__, str(e)[:300]]})

    setup = json.loads(req.readline())
    send(STARTED)  # the sandbox itself works; whatever fails from here on is the solution's doing
    for name, soft, hard in setup["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if setup.get("seccomp"):
        _install_seccomp(bytes.fromhex(setup["seccomp"]))
    scope = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(setup.pop("source"), "solution.py", "exec"), scope)
        names = {k: {"$m": v.__name__} if type(v).__name__ == "module" else encode(v, keep)
                 for k, v in scope.items() if not k.startswith("__")}
    except BaseException as e:  # SystemExit included: exiting while loading is a failure
        fail(e)
        return
    send({"ok": names})
    arg = lambda v: decode(v, handles.__getitem__)  # noqa: E731
    for line in req:
        try:
            r = json.loads(line)
            obj = handles[r["h"]]
            op = r["op"]
            if op == "call":
                args = [arg(v) for v in r["a"]]
                out = obj(*args, **{k: arg(v) for k, v in r["k"].items()})
                after = [encode(v, keep) if type(v) in (list, dict, set) else None for v in args]
                send({"ok": encode(out, keep), "after": after})
                continue
            if op == "next":
                try:
                    out = next(obj)
                except StopIteration:
                    send({"stop": True})
                    continue
            elif op == "attr":
                out = getattr(obj, r["n"])
            elif op == "iter":
                out = iter(obj)
            elif op == "len":
                out = len(obj)
            elif op == "item":
                out = obj[arg(r["key"])]
            else:
                raise ValueError("unknown op %r" % (op,))
            send({"ok": encode(out, keep)})
        except BaseException as e:  # the solution raising SystemExit in a call is that call's error
            fail(e)


if __name__ == "__main__":
    _serve()
