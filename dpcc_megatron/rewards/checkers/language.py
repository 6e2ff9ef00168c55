"""``language``: the share of the response written in the expected script.

Units are words for alphabetic scripts and single characters for CJK (which has
no spaces), so "the 过程 by which 植物" counts four units, two per script. Code
blocks, inline code, LaTeX commands and URLs are ignored. The score ramps
linearly from 0 at ``floor`` (default 0.5, i.e. half the text in another
script) to 1 for a single-script response, so mixed-language garbage scores low.
"""
from __future__ import annotations

import re
from typing import Optional

from ..registry import register_checker

_SCRIPTS = {
    "latin": r"A-Za-z\u00c0-\u024f",
    "cjk": r"\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff",
    "cyrillic": r"\u0400-\u04ff",
    "greek": r"\u0370-\u03ff",
    "arabic": r"\u0600-\u06ff",
    "devanagari": r"\u0900-\u097f",
}
_LANG_TO_SCRIPT = {
    **{c: "latin" for c in ("en", "fr", "de", "es", "it", "pt", "nl", "sv", "pl", "tr", "vi", "id")},
    **{c: "cjk" for c in ("zh", "ja", "ko")},
    "ru": "cyrillic", "uk": "cyrillic", "el": "greek", "ar": "arabic", "hi": "devanagari",
}
_UNIT_RES = {
    name: re.compile(f"[{chars}]" if name == "cjk" else f"[{chars}]+") for name, chars in _SCRIPTS.items()
}
_NOISE_RE = re.compile(r"```.*?```|`[^`]*`|\$[^$]*\$|\\[A-Za-z]+|https?://\S+", re.DOTALL)


def script_units(text: str) -> dict[str, int]:
    """Units per script (words, or characters for CJK), ignoring code, LaTeX and URLs."""
    text = _NOISE_RE.sub(" ", text)
    return {name: len(rx.findall(text)) for name, rx in _UNIT_RES.items()}


def resolve_script(language: Optional[str]) -> Optional[str]:
    if language is None or language == "auto":
        return None
    key = language.lower().split("-")[0].split("_")[0]
    if language.lower() in _SCRIPTS:
        return language.lower()
    if key not in _LANG_TO_SCRIPT:
        raise ValueError(f"unknown language/script {language!r}; use one of "
                         f"{', '.join(sorted(set(_SCRIPTS) | set(_LANG_TO_SCRIPT)))}")
    return _LANG_TO_SCRIPT[key]


def _dominant(units: dict[str, int]) -> Optional[str]:
    best = max(units, key=lambda k: units[k])
    return best if units[best] > 0 else None


def language_share(response: str, prompt: str = "", language: Optional[str] = None) -> Optional[float]:
    """Share of the response's units in the expected script (None if it has no letters at all)."""
    units = script_units(response)
    total = sum(units.values())
    if total == 0:
        return None
    script = resolve_script(language) or _dominant(script_units(prompt)) or _dominant(units)
    return units[script] / total


@register_checker("language")
def check_language(sample, ctx, *, language: Optional[str] = None, floor: float = 0.5) -> Optional[float]:
    """Script consistency; expected script from ``sample.language``, the ``language`` param, else the prompt."""
    share = language_share(sample.response, sample.prompt, sample.language or language)
    if share is None:
        return None
    return min(1.0, max(0.0, (share - floor) / (1.0 - floor)))
