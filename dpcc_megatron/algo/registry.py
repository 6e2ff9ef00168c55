"""Registry of policy losses and the shared wrapper that makes every loss safe and exact.

A loss is registered as a *token kernel*: it maps prepared per-token inputs to
per-token loss terms plus three masks (ratio below / above its bounds, gradient
active). The wrapper does everything else the same way for every loss: input
masking, the log-ratio clamp, [B] -> [B, T] advantages, aggregation with an optional
global :class:`~dpcc_megatron.algo.aggregation.LossNormalizer`, the optional
reference-KL penalty and the metrics.

    @register_policy_loss("my_loss", aggregation="token_mean")
    def my_loss(x: TokenInputs, cfg: LossConfig) -> TokenTerms: ...

    loss, metrics = get_policy_loss("my_loss")(logprobs, old_logprobs, advantages, mask)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch

from dpcc_megatron.config.algo import LossConfig

from .aggregation import AGGREGATIONS, LossNormalizer, aggregate
from .kl import ref_kl_penalty
from .metrics import token_metrics


class TokenInputs(NamedTuple):
    """Prepared inputs of a token kernel; all [B, T], masked positions hold 0."""

    logprobs: torch.Tensor
    """log pi_theta (carries the gradient)."""
    log_ratio: torch.Tensor
    """log pi_theta - log pi_old clamped to +-log_ratio_clamp (gradient 0 where clamped)."""
    ratio: torch.Tensor
    """exp(log_ratio)."""
    ratio_has_grad: torch.Tensor
    """bool: the clamp did not cut the gradient of log_ratio/ratio."""
    advantages: torch.Tensor
    """Advantages broadcast to [B, T], detached."""
    mask: torch.Tensor
    """bool valid tokens."""


class TokenTerms(NamedTuple):
    """Output of a token kernel; all [B, T]."""

    loss: torch.Tensor
    """Per-token loss terms, aggregated by the loss's declared aggregation."""
    below: torch.Tensor
    """bool: ratio below the loss's lower bound (clip_frac_low)."""
    above: torch.Tensor
    """bool: ratio above the loss's upper bound (clip_frac_high)."""
    active: torch.Tensor
    """bool: the token's gradient is nonzero (given a nonzero advantage); feeds `utilisation`."""
    extras: dict = {}
    """Extra 0-dim metrics (reductions must be in METRIC_REDUCTIONS)."""


Kernel = Callable[[TokenInputs, LossConfig], TokenTerms]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss; call it like a function.

    ``aggregation`` says which global counts a distributed caller must provide
    (``counts_needed``, see :mod:`dpcc_megatron.algo.aggregation`).
    """

    name: str
    kernel: Kernel = field(repr=False)
    aggregation: str

    @property
    def counts_needed(self) -> tuple[str, ...]:
        return AGGREGATIONS[self.aggregation]

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, config: Optional[LossConfig] = None, *,
                 normalizer: Optional[LossNormalizer] = None,
                 ref_logprobs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Policy loss of one (micro-)batch.

        Args:
            logprobs: [B, T] log pi_theta of the response tokens (with grad).
            old_logprobs: [B, T] log pi_old (the rollout policy); no grad.
            advantages: [B] per sequence or [B, T] per token; no grad.
            response_mask: [B, T] bool or 0/1, valid response tokens.
            config: LossConfig; None means the defaults.
            normalizer: global counts; with it the result is this batch's contribution
                to the full mini-batch loss (sum the contributions).
            ref_logprobs: [B, T] reference log-probs, required when config.ref_kl_coef > 0.
        Returns:
            (loss, metrics): 0-dim loss; metrics of detached 0-dim tensors (see metrics.py).
        """
        cfg = config if config is not None else LossConfig()
        x = prepare_inputs(logprobs, old_logprobs, advantages, response_mask, cfg.log_ratio_clamp)
        terms = self.kernel(x, cfg)
        pg_loss = aggregate(terms.loss, x.mask, self.aggregation, normalizer)
        metrics = token_metrics(x.log_ratio, x.advantages, x.mask, terms.below, terms.above, terms.active)
        metrics["pg_loss"] = pg_loss.detach()
        metrics.update({k: torch.as_tensor(v).detach() for k, v in terms.extras.items()})
        loss = pg_loss
        if cfg.ref_kl_coef > 0:
            if ref_logprobs is None:
                raise ValueError("config.ref_kl_coef > 0 needs ref_logprobs")
            penalty, ref_kl = ref_kl_penalty(x.logprobs, ref_logprobs, x.mask, cfg.ref_kl_coef, cfg.kl_estimator,
                                             self.aggregation, normalizer, cfg.log_ratio_clamp)
            loss = loss + penalty
            metrics["ref_kl"] = ref_kl
            metrics["ref_kl_loss"] = penalty.detach()
        return loss, metrics


def prepare_inputs(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   response_mask: torch.Tensor, clamp: float = 20.0) -> TokenInputs:
    """Check shapes, mask, clamp and broadcast (see TokenInputs)."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("response_mask", response_mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(t.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 inputs: compute in fp32
    mask = response_mask.bool()
    # torch.where (not multiplication) so inf/NaN padding never reaches values or gradients.
    lp = torch.where(mask, logprobs.to(dtype), 0.0)
    old = torch.where(mask, old_logprobs.detach().to(dtype), 0.0)
    adv = advantages.detach().to(dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(lp)
    adv = torch.where(mask, adv, 0.0)
    raw = lp - old
    log_ratio = raw.clamp(-clamp, clamp)
    return TokenInputs(logprobs=lp, log_ratio=log_ratio, ratio=torch.exp(log_ratio),
                       ratio_has_grad=raw.detach().abs() <= clamp, advantages=adv, mask=mask)


_REGISTRY: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, aggregation: str) -> Callable[[Kernel], Kernel]:
    """Decorator: register a token kernel under ``name``; a duplicate name is refused."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")

    def decorate(kernel: Kernel) -> Kernel:
        if name in _REGISTRY:
            raise ValueError(f"policy loss {name!r} is already registered")
        _REGISTRY[name] = PolicyLoss(name=name, kernel=kernel, aggregation=aggregation)
        return kernel

    return decorate


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss ``name``; ``loss, metrics = get_policy_loss(name)(lp, old_lp, adv, mask)``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown policy loss {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def list_policy_losses() -> list[str]:
    """Registered loss names, in registration order."""
    return list(_REGISTRY)


def global_counts_needed(name: str) -> tuple[str, ...]:
    """LossNormalizer fields a distributed caller must fill for loss ``name``."""
    return get_policy_loss(name).counts_needed
