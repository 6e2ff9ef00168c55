"""Where per-sample tensors live during an iteration.

The trainer keeps every per-sample tensor of an iteration on the host: tokens, masks,
advantages, rewards, the sampler's and the old policy's log-probs. Schedule outputs come back
on the model's device (CUDA on a GPU) and are moved to the host once, here, before they meet
masks or rewards in metric math; the loss functions (``megatron/policy_step.py``) do the
opposite per micro-batch, moving the batch slice to the device of the logits. Metric math
therefore never mixes devices, whatever the accelerator.
"""
from __future__ import annotations

from typing import Optional

import torch


def to_host(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` detached on the CPU as fp32 (None stays None); a CPU fp32 tensor is returned as is."""
    if t is None:
        return None
    return t.detach().to(device="cpu", dtype=torch.float32)
