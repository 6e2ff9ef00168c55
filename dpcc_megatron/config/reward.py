"""reward section of the config tree (extended by the reward layer)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardConfig:
    """Settings of the reward layer."""
