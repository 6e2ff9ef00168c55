"""Registry of rule checkers, filled by the ``@register_checker`` decorator.

A checker is ``fn(sample, ctx, **params) -> float | None``:

* a **score** checker returns a score in [0, 1] (1 = passes) and is averaged
  into the base track with its configured weight;
* a **penalty** checker returns a penalty in [0, 1] that is subtracted, times
  its weight, from that average;
* returning ``None`` means "does not apply to this sample" (e.g. ``format``
  without a pattern); the checker is left out of the average.

A checker that raises scores 0 and is counted as an error; raising
:class:`CheckerTimeout` counts as a timeout instead, and :class:`CheckerSkipped` leaves the
checker out of that sample's score and counts a skip. Checkers flagged
``sandboxed`` run untrusted code in a subprocess and are dispatched to a small
thread pool so a batch does not take ``n * timeout``.

The built-in checkers (:mod:`.checkers`) register themselves when the ``rewards`` package is
imported (its ``__init__`` imports them, and Python imports a package before any of its
modules), so this module never imports the checkers that import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

from .sample import Sample


class CheckerTimeout(Exception):
    """A checker gave up because its sandboxed run hit the time limit."""


class CheckerSkipped(Exception):
    """The checker could not judge the sample for a reason outside it (e.g. the sandbox service
    failed): the checker is left out of the sample's score and the skip is counted."""


@dataclass(frozen=True)
class CheckContext:
    """What a checker may need besides the sample and its params."""

    sandbox: "object"  # SandboxLimits or a built sandbox backend; typed loosely to keep this module import-light


CheckerFn = Callable[..., Optional[float]]


@dataclass(frozen=True)
class Checker:
    name: str
    fn: CheckerFn
    kind: Literal["score", "penalty"] = "score"
    sandboxed: bool = False

    def __call__(self, sample: Sample, ctx: CheckContext, **params) -> Optional[float]:
        return self.fn(sample, ctx, **params)


_REGISTRY: dict[str, Checker] = {}


def register_checker(name: str, *, kind: Literal["score", "penalty"] = "score",
                     sandboxed: bool = False) -> Callable[[CheckerFn], CheckerFn]:
    """Decorator: register ``fn`` under ``name``; a second registration of a name is refused."""
    if kind not in ("score", "penalty"):
        raise ValueError(f"checker kind must be 'score' or 'penalty', got {kind!r}")

    def deco(fn: CheckerFn) -> CheckerFn:
        if name in _REGISTRY:
            prev = _REGISTRY[name].fn
            raise ValueError(f"checker {name!r} is already registered by {prev.__module__}.{prev.__qualname__}")
        _REGISTRY[name] = Checker(name=name, fn=fn, kind=kind, sandboxed=sandboxed)
        return fn

    return deco


def unregister_checker(name: str) -> None:
    """Remove a checker (plugins reloading themselves, tests)."""
    _REGISTRY.pop(name, None)


def get_checker(name: str) -> Checker:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown checker {name!r} (registered: {', '.join(sorted(_REGISTRY))})") from None


def list_checkers() -> list[str]:
    return sorted(_REGISTRY)
