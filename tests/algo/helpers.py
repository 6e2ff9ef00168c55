"""Random batches for the loss tests (float64, so references agree to ~1e-12)."""
from __future__ import annotations

import torch

LOSSES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "dpcc")


def make_batch(seed: int, B: int = 6, T: int = 9, per_token_adv: bool = False, spread: float = 0.4,
               p_valid: float = 0.7, dtype=torch.float64):
    """(logprobs, old_logprobs, advantages, mask); log-ratios ~ N(0, spread^2), every row non-empty."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.05
    lp = old + torch.randn(B, T, generator=g, dtype=dtype) * spread
    mask = torch.rand(B, T, generator=g) < p_valid
    mask[:, 0] = True
    shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(*shape, generator=g, dtype=dtype)
    return lp, old, adv, mask


def grad_of(loss_fn, lp, *args, **kwargs):
    """(loss, metrics, d loss / d lp) for a fresh leaf copy of lp."""
    leaf = lp.detach().clone().requires_grad_(True)
    loss, metrics = loss_fn(leaf, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), metrics, grad
