"""monitor section of the config tree (extended by the monitor layer)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MonitorConfig:
    """Settings of the monitor layer."""
