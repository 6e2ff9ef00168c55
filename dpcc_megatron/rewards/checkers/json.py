"""``json``: the response (or its ```json block) parses as JSON and, optionally, satisfies a JSON Schema."""
from __future__ import annotations

import functools
import json
import re
from typing import Any, Optional

from ..registry import register_checker

_FENCE_RE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_json(text: str, strict: bool = False) -> tuple[bool, Any]:
    """(found, value): the whole response, else a fenced block, else (unless ``strict``) the first JSON value in it."""
    candidates = [text.strip()]
    if not strict:
        candidates += [b.strip() for b in _FENCE_RE.findall(text)]
    for cand in candidates:
        try:
            return True, json.loads(cand)
        except ValueError:
            pass
    if not strict:
        decoder = json.JSONDecoder()
        for m in re.finditer(r"[\[{]", text):
            try:
                return True, decoder.raw_decode(text, m.start())[0]
            except ValueError:
                continue
    return False, None


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str):
    import jsonschema

    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)  # a broken schema is a config error: raises, counted as a checker error
    return cls(schema)


@register_checker("json")
def check_json(sample, ctx, *, schema: Optional[dict] = None, strict: bool = False,
               partial: bool = True) -> float:
    """1 for valid JSON matching the schema (``sample.schema`` over the ``schema`` param).

    With a schema and ``partial``, valid JSON that violates it scores 0.5.
    """
    found, value = extract_json(sample.response, strict=strict)
    if not found:
        return 0.0
    schema = sample.schema if sample.schema is not None else schema
    if schema is None:
        return 1.0
    validator = _validator(json.dumps(schema, sort_keys=True))
    if validator.is_valid(value):
        return 1.0
    return 0.5 if partial else 0.0
