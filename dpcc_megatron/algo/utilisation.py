"""Sample utilisation measured by autograd: which tokens actually push the policy.

Conventional clipped losses silently drop tokens whose ratio left the trust region
in the direction favoured by their advantage (their gradient is exactly 0). DPCC
keeps all of them (utilisation 1.0). The ``utilisation`` metric that every loss
reports is derived analytically; this module measures it from the real gradient
(the tests check that both agree).
"""
from __future__ import annotations

from typing import Optional

import torch

from dpcc_megatron.config.algo import LossConfig

from .registry import PolicyLoss, get_policy_loss


def token_gradients(loss: str | PolicyLoss, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                    advantages: torch.Tensor, response_mask: torch.Tensor,
                    config: Optional[LossConfig] = None) -> torch.Tensor:
    """d loss / d logprobs, [B, T], for a detached copy of ``logprobs``."""
    fn = get_policy_loss(loss) if isinstance(loss, str) else loss
    lp = logprobs.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        value, _ = fn(lp, old_logprobs, advantages, response_mask, config)
        (grad,) = torch.autograd.grad(value, lp, allow_unused=True)
    return torch.zeros_like(lp) if grad is None else grad


def sample_utilisation(loss: str | PolicyLoss, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       advantages: torch.Tensor, response_mask: torch.Tensor,
                       config: Optional[LossConfig] = None) -> float:
    """Fraction of valid tokens with nonzero advantage whose gradient is nonzero (1.0 if none).

    Shapes as for the losses: [B, T] log-probs and mask, [B] or [B, T] advantages.
    """
    grad = token_gradients(loss, logprobs, old_logprobs, advantages, response_mask, config)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(grad)
    counted = response_mask.bool() & (adv != 0)
    n = int(counted.sum())
    return 1.0 if n == 0 else float((grad[counted] != 0).sum()) / n
