"""Plain-Python reference of every policy loss: value and d loss / d logprobs, by loops.

Written from the formulas in docs/algorithm.md, independently of dpcc_megatron.algo:
no torch, explicit per-token derivatives (the losses with stop-gradients have no
scalar potential, so finite differences cannot stand in for them).
"""
from __future__ import annotations

import math

CLAMP = 20.0


def _ratio(lp: float, old: float) -> tuple[float, float]:
    """(r, d r / d lp) with the +-CLAMP log-ratio clamp."""
    raw = lp - old
    r = math.exp(max(-CLAMP, min(CLAMP, raw)))
    return r, (r if abs(raw) <= CLAMP else 0.0)


def _ppo_token(a: float, lp: float, old: float, lo: float, hi: float, c: float | None) -> tuple[float, float]:
    r, dr = _ratio(lp, old)
    unclipped, clipped = -a * r, -a * min(max(r, lo), hi)
    value = max(unclipped, clipped)
    # Where the clipped branch is strictly larger r is outside [lo, hi]: it is a constant.
    grad = 0.0 if clipped > unclipped else -a * dr
    if c is not None and a < 0 and -a * c < value:
        value, grad = -a * c, 0.0
    return value, grad


def _per_token_adv(adv, b: int, t: int) -> float:
    row = adv[b]
    return row[t] if isinstance(row, list) else row


def _zeros(mask):
    return [[0.0] * len(row) for row in mask]


def ppo_reference(lp, old, adv, mask, lo, hi, c, aggregation):
    """grpo (seq_mean_token_mean), dapo (token_mean), dr_grpo (token_sum_norm)."""
    B, T = len(mask), len(mask[0])
    vals, grads = _zeros(mask), _zeros(mask)
    for b in range(B):
        for t in range(T):
            if mask[b][t]:
                vals[b][t], grads[b][t] = _ppo_token(_per_token_adv(adv, b, t), lp[b][t], old[b][t], lo, hi, c)
    return _aggregate(vals, grads, mask, aggregation)


def _aggregate(vals, grads, mask, aggregation):
    B, T = len(mask), len(mask[0])
    lengths = [sum(1 for t in range(T) if mask[b][t]) for b in range(B)]
    out_grad = _zeros(mask)
    if aggregation == "token_mean":
        n = max(sum(lengths), 1)
        value = sum(vals[b][t] for b in range(B) for t in range(T) if mask[b][t]) / n
        scale = [[1.0 / n] * T for _ in range(B)]
    elif aggregation in ("seq_mean_token_mean", "seq_mean"):
        seqs = max(sum(1 for n in lengths if n > 0), 1)
        value = sum(sum(vals[b][t] for t in range(T) if mask[b][t]) / lengths[b]
                    for b in range(B) if lengths[b] > 0) / seqs
        scale = [[1.0 / (max(lengths[b], 1) * seqs)] * T for b in range(B)]
    elif aggregation == "token_sum_norm":
        value = sum(vals[b][t] for b in range(B) for t in range(T) if mask[b][t]) / (B * T)
        scale = [[1.0 / (B * T)] * T for _ in range(B)]
    else:
        raise ValueError(aggregation)
    for b in range(B):
        for t in range(T):
            if mask[b][t]:
                out_grad[b][t] = grads[b][t] * scale[b][t]
    return value, out_grad


def gspo_reference(lp, old, adv, mask, lo, hi):
    """Sequence ratio s_i = exp(mean_t clamp(lp - old)); gradient s_i * A / (n_i * S) per unclipped token."""
    B, T = len(mask), len(mask[0])
    vals, grads = _zeros(mask), _zeros(mask)
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t]]
        if not idx:
            continue
        s = math.exp(sum(max(-CLAMP, min(CLAMP, lp[b][t] - old[b][t])) for t in idx) / len(idx))
        for t in idx:
            a = _per_token_adv(adv, b, t)
            unclipped, clipped = -a * s, -a * min(max(s, lo), hi)
            vals[b][t] = max(unclipped, clipped)
            grads[b][t] = 0.0 if clipped > unclipped else -a * s
    return _aggregate(vals, grads, mask, "seq_mean")


def gspo_sequence_value(lp, old, adv_seq, mask, lo, hi):
    """GSPO as published (sequence-level, per-sequence A), for finite differences."""
    total, seqs = 0.0, 0
    for b in range(len(mask)):
        idx = [t for t in range(len(mask[b])) if mask[b][t]]
        if not idx:
            continue
        s = math.exp(sum(lp[b][t] - old[b][t] for t in idx) / len(idx))
        a = adv_seq[b]
        total += max(-a * s, -a * min(max(s, lo), hi))
        seqs += 1
    return total / max(seqs, 1)


def weighted_pg_reference(lp, old, adv, mask, weight_fn, with_logprob: bool):
    """Token-mean of -sg(w(r)) * A * (log pi if with_logprob else pi/sg(pi)); gradient -w * A."""
    B, T = len(mask), len(mask[0])
    vals, grads = _zeros(mask), _zeros(mask)
    for b in range(B):
        for t in range(T):
            if mask[b][t]:
                a = _per_token_adv(adv, b, t)
                r, _ = _ratio(lp[b][t], old[b][t])
                w = weight_fn(r, a)
                vals[b][t] = -w * a * (lp[b][t] if with_logprob else 1.0)
                grads[b][t] = -w * a
    return _aggregate(vals, grads, mask, "token_mean")


def reference(name, lp, old, adv, mask, *, clip_eps=0.2, eps_low=0.2, eps_high=0.28, dual_c=None,
              gspo_low=3e-4, gspo_high=4e-4, cispo_high=0.28, tau=1.28, truncation="decay", decay_power=2.0):
    """(value, grad) of loss ``name`` on nested lists."""
    if name == "grpo":
        return ppo_reference(lp, old, adv, mask, 1 - clip_eps, 1 + clip_eps, dual_c, "seq_mean_token_mean")
    if name == "dapo":
        return ppo_reference(lp, old, adv, mask, 1 - eps_low, 1 + eps_high, dual_c, "token_mean")
    if name == "dr_grpo":
        return ppo_reference(lp, old, adv, mask, 1 - clip_eps, 1 + clip_eps, dual_c, "token_sum_norm")
    if name == "gspo":
        return gspo_reference(lp, old, adv, mask, 1 - gspo_low, 1 + gspo_high)
    if name == "cispo":
        return weighted_pg_reference(lp, old, adv, mask, lambda r, a: min(r, 1 + cispo_high), True)
    if name == "dpcc":
        return weighted_pg_reference(lp, old, adv, mask, lambda r, a: dpcc_weight(r, a, tau, truncation, decay_power),
                                     False)
    raise ValueError(name)


def dpcc_weight(r: float, a: float, tau: float, truncation: str, decay_power: float) -> float:
    """DPCC's token weight: r truncated to [1/tau, tau]; with ``decay``, a token beyond the boundary on
    the side its advantage pushes it to (a >= 0 and r > tau, a < 0 and r < 1/tau) gets the boundary
    value times exp(-decay_power * (|log r| - log tau))."""
    w = min(max(r, 1 / tau), tau)
    drifting = (a >= 0 and r > tau) or (a < 0 and r < 1 / tau)
    if truncation == "decay" and drifting:
        w *= math.exp(-decay_power * (abs(math.log(r)) - math.log(tau)))
    return w


def max_weight(name, *, tau=1.28, cispo_high=0.28):
    """Largest |d l_t / d log pi_t| / |A_t| of one token before aggregation."""
    return {"dpcc": tau, "cispo": 1 + cispo_high}.get(name, math.exp(CLAMP))


def _covariances(lp, adv, mask):
    B, T = len(mask), len(mask[0])
    valid = [(b, t) for b in range(B) for t in range(T) if mask[b][t]]
    mean_a = sum(_per_token_adv(adv, b, t) for b, t in valid) / len(valid)
    mean_lp = sum(lp[b][t] for b, t in valid) / len(valid)
    return valid, {(b, t): (_per_token_adv(adv, b, t) - mean_a) * (lp[b][t] - mean_lp) for b, t in valid}


def clip_cov_reference(lp, old, adv, mask, clip_eps, lb, ub):
    """Clip-Cov with every candidate dropped (clip_cov_ratio large enough that no draw is needed)."""
    vals, grads = _zeros(mask), _zeros(mask)
    valid, cov = _covariances(lp, adv, mask)
    for b, t in valid:
        a = _per_token_adv(adv, b, t)
        r, _ = _ratio(lp[b][t], old[b][t])
        clipped = -a * min(max(r, 1 - clip_eps), 1 + clip_eps) > -a * r
        if not clipped and lb < cov[b, t] < ub:
            continue  # dropped: no value, no gradient
        vals[b][t], grads[b][t] = _ppo_token(a, lp[b][t], old[b][t], 1 - clip_eps, 1 + clip_eps, None)
    return _aggregate(vals, grads, mask, "token_mean")


def kl_cov_reference(lp, old, adv, mask, ratio, coef):
    """KL-Cov: -A r on every token, + coef |log r| on the top max(1, int(n * ratio)) tokens by covariance."""
    vals, grads = _zeros(mask), _zeros(mask)
    valid, cov = _covariances(lp, adv, mask)
    k = max(1, int(len(valid) * ratio))
    top = set(sorted(valid, key=lambda bt: -cov[bt])[:k])
    for b, t in valid:
        a = _per_token_adv(adv, b, t)
        r, dr = _ratio(lp[b][t], old[b][t])
        raw = lp[b][t] - old[b][t]
        vals[b][t], grads[b][t] = -a * r, -a * dr
        if (b, t) in top:
            lr = max(-CLAMP, min(CLAMP, raw))
            vals[b][t] += coef * abs(lr)
            grads[b][t] += coef * ((lr > 0) - (lr < 0)) * (1.0 if abs(raw) <= CLAMP else 0.0)
    return _aggregate(vals, grads, mask, "token_mean")


def decoupled_reference(name, lp, prox, behaviour, adv, mask, cap, **kwargs):
    """The decoupled objective by loops: each token's loss term (ratio against ``prox``) and its
    derivative times w = min(exp(prox - behaviour), cap); ``cap`` None: no weight. Only for losses
    whose per-token term is computed token by token here (the PPO family, cispo, dpcc)."""
    B, T = len(mask), len(mask[0])
    w = [[(min(math.exp(prox[b][t] - behaviour[b][t]), cap) if cap is not None else 1.0) if mask[b][t] else 0.0
          for t in range(T)] for b in range(B)]
    lo_hi = {"grpo": ("clip_eps", "clip_eps"), "dr_grpo": ("clip_eps", "clip_eps"), "dapo": ("eps_low", "eps_high")}
    agg = {"grpo": "seq_mean_token_mean", "dapo": "token_mean", "dr_grpo": "token_sum_norm",
           "cispo": "token_mean", "dpcc": "token_mean"}[name]
    vals, grads = _zeros(mask), _zeros(mask)
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            a = _per_token_adv(adv, b, t)
            if name in lo_hi:
                k_lo, k_hi = lo_hi[name]
                eps_lo = kwargs.get(k_lo, 0.2)
                eps_hi = kwargs.get(k_hi, 0.2 if k_hi == "clip_eps" else 0.28)
                v, g = _ppo_token(a, lp[b][t], prox[b][t], 1 - eps_lo, 1 + eps_hi, kwargs.get("dual_c"))
            else:
                r, _ = _ratio(lp[b][t], prox[b][t])
                if name == "cispo":
                    ww = min(r, 1 + kwargs.get("cispo_high", 0.28))
                    v, g = -ww * a * lp[b][t], -ww * a
                else:
                    ww = dpcc_weight(r, a, kwargs.get("tau", 1.28), kwargs.get("truncation", "decay"),
                                     kwargs.get("decay_power", 2.0))
                    v, g = -ww * a, -ww * a
            vals[b][t], grads[b][t] = w[b][t] * v, w[b][t] * g
    return _aggregate(vals, grads, mask, agg)
