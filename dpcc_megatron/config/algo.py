"""algo section of the config tree (extended by the algo layer)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossConfig:
    """Settings of the algo layer."""
