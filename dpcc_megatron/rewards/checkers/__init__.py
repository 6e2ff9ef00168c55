"""Built-in rule checkers; importing this package registers them (see ``..registry``)."""
from . import answer, code, format, json, language, math, penalties  # noqa: F401
