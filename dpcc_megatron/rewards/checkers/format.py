"""``format``: the response matches a regex, or a template whose ``{}`` slots match anything."""
from __future__ import annotations

import functools
import re
from typing import Optional

from ..registry import register_checker


@functools.lru_cache(maxsize=256)
def _compile(pattern: Optional[str], template: Optional[str]) -> re.Pattern:
    if template is not None:
        # "<think>{}</think>{}" -> literal text with lazy wildcards in the slots
        pattern = ".*?".join(re.escape(part) for part in template.split("{}"))
    return re.compile(pattern, re.DOTALL)


@register_checker("format")
def check_format(sample, ctx, *, pattern: Optional[str] = None, template: Optional[str] = None,
                 fullmatch: bool = False) -> Optional[float]:
    """1 if the response matches (``re.search``; whole response with ``fullmatch`` or a template).

    The sample's own ``pattern`` wins over the configured one; None when neither exists.
    """
    if sample.pattern is not None:
        pattern, template = sample.pattern, None
    if pattern is None and template is None:
        return None
    rx = _compile(pattern, template)
    if template is not None:
        match = rx.fullmatch(sample.response.strip())
    else:
        match = rx.fullmatch(sample.response) if fullmatch else rx.search(sample.response)
    return 1.0 if match else 0.0
