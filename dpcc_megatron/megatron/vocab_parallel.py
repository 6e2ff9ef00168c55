"""Per-token log-prob, exact entropy and KL from vocab-sharded logits, without gathering the vocabulary.

    stats = vocab_parallel_token_stats(logits, targets, group=tp_group, vocab_size=V,
                                       ref_logits=ref_logits)
    stats.logprobs, stats.entropy, stats.ref_kl   # [s, b] fp32, differentiable w.r.t. logits
    stats.nonfinite                               # 0-dim int64: tokens with NaN/Inf logits

``logits`` is this tensor-parallel rank's shard ``[s, b, V_pad / tp]`` (Megatron layout,
rank ``r`` holds global columns ``[r * V_pad/tp, (r+1) * V_pad/tp)``). Columns with global id
``>= vocab_size`` are Megatron's vocabulary padding and never count, forward or backward.

How it works:

* **Forward, one sweep over the shard.** Tokens are processed in chunks of ``chunk_size`` rows of
  the flattened ``s*b`` axis; only a chunk is ever cast to fp32. Each rank reduces its chunk to a
  few per-token numbers relative to its *local* max ``m_r``: ``S_r = Σ e^(z-m_r)``,
  ``A_r = Σ e^(z-m_r)(z-m_r)`` (entropy), ``B_r = Σ e^(z-m_r)(z-r)`` (KL), the ref's own
  max and sum-exp, and the target logit if the target lies in this shard. Then two all-reduces
  for the whole call (not per chunk): MAX of the local maxima, and SUM of the stats after
  rescaling them to the global max (``e^(m_r - M)``). With ``lse = M + log S``:
  ``logprob = z_t - lse``, ``entropy = log S - T/S`` with ``T = Σ e^(z-M)(z-M)``, and
  ``KL(p‖q) = B/S - (M - M_ref) - (log S - log S_ref)`` (exactly 0 when ``ref == logits``).
* **Backward, no communication.** Saved: the original-dtype logits (and ref logits) by
  reference, plus per-token fp32 ``lse``, ``entropy``, ``KL``, ``lse_ref``. Each chunk's
  softmax is recomputed as ``p = exp(z - lse)``; with ``lp = log p``, ``lq = log q``:
  ``d logprob/dz = onehot(t) - p``, ``d entropy/dz = -p (lp + H)``,
  ``d KL/dz = p (lp - lq - KL)`` (q fixed). Gradients of the padding columns are 0.
  Since no collective runs in backward, it works wherever autograd calls it, including
  Megatron's pipeline schedules; the caller's loss sees identical values on every TP rank,
  and the output layer's own backward all-reduces its input gradient as usual.
* **NaN/Inf policy.** A token is *non-finite* when any of its real (non-padding) logits, or
  ref logits, is NaN or ±Inf on any rank (detected from the per-token stats; only without
  entropy does it cost a row sum). Such tokens get ``logprobs = entropy = ref_kl = 0`` and zero gradient,
  ``nonfinite_mask`` marks them, and ``nonfinite`` counts them over the TP group. The values
  look normal on purpose, so a NaN never reaches the weights through this op; the caller must
  check ``nonfinite`` and skip the optimizer step (or at least mask those tokens).
  ``-inf`` in the padding columns (a common way to mask padding) is not counted.

Memory: besides the outputs and the logits gradient (in the logits' dtype), the op holds two
fp32 ``[chunk_size, V_pad/tp]`` work buffers (three with ``ref_logits``), reused by every
chunk. Lower ``chunk_size`` for very large vocabularies. Host syncs: one for the target range
check, and one in backward only to test for non-finite tokens. Double backward is not supported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TokenStats:
    logprobs: torch.Tensor
    """[s, b] fp32: log p(target) under the full-vocabulary softmax (0 for non-finite tokens)."""
    entropy: torch.Tensor | None
    """[s, b] fp32: exact full-vocabulary entropy; None when ``with_entropy=False``."""
    ref_kl: torch.Tensor | None
    """[s, b] fp32: full-vocabulary KL(pi ‖ ref); None when no ``ref_logits`` were given."""
    nonfinite: torch.Tensor
    """0-dim int64: tokens whose logits held NaN/Inf, counted over the TP group."""
    nonfinite_mask: torch.Tensor | None = None
    """[s, b] bool: which tokens those are (identical on every TP rank)."""


def vocab_parallel_token_stats(logits: torch.Tensor, targets: torch.Tensor, *, group=None,
                               vocab_size: int | None = None, with_entropy: bool = True,
                               ref_logits: torch.Tensor | None = None,
                               chunk_size: int = 1024) -> TokenStats:
    """Per-token log-prob of ``targets``, entropy and KL to ``ref_logits`` from vocab-sharded logits.

    ``group`` is the tensor-parallel process group (None: no tensor parallelism; needs no
    ``torch.distributed``). ``vocab_size`` is the unpadded vocabulary size (default: no padding).
    Gradients flow to ``logits`` only; ``ref_logits`` are treated as constants.
    """
    tp_size, tp_rank = _group_size_rank(group)
    _check_inputs(logits, targets, ref_logits, chunk_size)
    v_local = logits.shape[-1]
    vocab_size = v_local * tp_size if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= v_local * tp_size:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {v_local * tp_size}] "
                         f"(shard width {v_local} x tensor-parallel size {tp_size})")
    targets = targets.long()
    if targets.numel() and bool(((targets < 0) | (targets >= vocab_size)).any()):
        raise ValueError(f"targets must be token ids in [0, {vocab_size}); got min "
                         f"{int(targets.min())}, max {int(targets.max())}")
    if ref_logits is not None:
        ref_logits = ref_logits.detach()
    lp, ent, kl, bad, count = _TokenStatsFn.apply(
        logits, targets, ref_logits, group if tp_size > 1 else None, tp_rank * v_local,
        vocab_size, with_entropy, int(chunk_size))
    shape = targets.shape
    return TokenStats(logprobs=lp.view(shape), entropy=ent.view(shape) if with_entropy else None,
                      ref_kl=kl.view(shape) if ref_logits is not None else None,
                      nonfinite=count, nonfinite_mask=bad.view(shape))


def _group_size_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    if not dist.is_initialized():
        raise ValueError("a tensor-parallel group was given but torch.distributed is not initialised")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_inputs(logits, targets, ref_logits, chunk_size):
    if logits.dim() != 3:
        raise ValueError(f"logits must be [s, b, V/tp]; got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point; got {logits.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits shape "
                         f"{tuple(logits.shape)} (expected {tuple(logits.shape[:2])})")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids; got {targets.dtype}")
    if ref_logits is not None:
        if tuple(ref_logits.shape) != tuple(logits.shape):
            raise ValueError(f"ref_logits shape {tuple(ref_logits.shape)} does not match logits "
                             f"shape {tuple(logits.shape)}")
        if not ref_logits.is_floating_point():
            raise ValueError(f"ref_logits must be floating point; got {ref_logits.dtype}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # a view for Megatron's contiguous [s, b, V/tp]


def _workspace(n: int, rows: int, cols: int, device) -> list[torch.Tensor]:
    """``n`` fp32 [rows, cols] buffers reused by every chunk (fresh buffers per chunk cost page
    faults / allocator churn that dominate on CPU)."""
    return list(torch.empty(n, rows, cols, dtype=torch.float32, device=device).unbind(0))


class _TokenStatsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ref_logits, group, vocab_start, vocab_size, with_entropy,
                chunk_size):
        z_all = _rows(logits)
        r_all = _rows(ref_logits) if ref_logits is not None else None
        n_tok, v_local = z_all.shape
        n_real = max(0, min(v_local, vocab_size - vocab_start))  # real columns form a prefix
        with_ref = r_all is not None
        f32 = dict(dtype=torch.float32, device=logits.device)
        t_flat = targets.reshape(-1)

        # Per-token local stats, relative to the local maxima m_z (and m_r for the ref).
        m_z = torch.full((n_tok,), float("-inf"), **f32)
        s_z, a_z, check = (torch.zeros(n_tok, **f32) for _ in range(3))
        m_r, s_r, b_z = (torch.full((n_tok,), float("-inf"), **f32), torch.zeros(n_tok, **f32),
                         torch.zeros(n_tok, **f32)) if with_ref else (None, None, None)
        z_t = torch.zeros(n_tok, **f32)
        if n_real > 0:
            t_local = t_flat - vocab_start
            here = (t_local >= 0) & (t_local < n_real)
            picked = z_all.gather(1, t_local.clamp(0, n_real - 1).unsqueeze(1)).squeeze(1).float()
            z_t = torch.where(here, picked, z_t)
            work = _workspace(3 if with_ref else 2, min(chunk_size, n_tok), n_real, logits.device)
            for lo in range(0, n_tok, chunk_size):
                hi = min(lo + chunk_size, n_tok)
                zc = z_all[lo:hi, :n_real]
                z, e = work[0][:hi - lo], work[1][:hi - lo]
                if with_ref:
                    rc, d = r_all[lo:hi, :n_real], work[2][:hi - lo]
                    m_r[lo:hi] = rc.amax(-1)
                    d.copy_(rc).sub_(m_r[lo:hi, None])
                    s_r[lo:hi] = torch.exp(d, out=e).sum(-1)
                    d.copy_(zc).sub_(e.copy_(rc))  # z - r in fp32, exact before any shift
                m_z[lo:hi] = zc.amax(-1)  # the max is exact in the input dtype
                z.copy_(zc).sub_(m_z[lo:hi, None])
                s_z[lo:hi] = torch.exp(z, out=e).sum(-1)
                if with_ref:
                    b_z[lo:hi] = d.mul_(e).sum(-1)
                # A_r feeds the entropy and, being 0*(-inf) = NaN or NaN for any non-finite
                # logit, doubles as the non-finite check; without entropy a row sum does that.
                if with_entropy:
                    a_z[lo:hi] = z.mul_(e).sum(-1)
                else:
                    check[lo:hi] = z.sum(-1)
            del work
        local_stats = [m_z, s_z, a_z, check, z_t] + ([m_r, s_r, b_z] if with_ref else [])
        local_bad = torch.zeros(n_tok, dtype=torch.bool, device=logits.device)
        if n_real > 0:
            for x in local_stats:
                local_bad |= ~torch.isfinite(x)
            # Keep this rank's contribution for such tokens finite; their outputs are zeroed below.
            s_z, a_z, z_t = (torch.where(local_bad, 0.0, x) for x in (s_z, a_z, z_t))
            if with_ref:
                s_r, b_z = (torch.where(local_bad, 0.0, x) for x in (s_r, b_z))
        neg_inf = torch.tensor(float("-inf"), **f32)

        # All-reduce 1: global maxima (non-finite tokens contribute nothing from this rank).
        maxima = torch.stack([torch.where(local_bad, neg_inf, m_z)]
                             + ([torch.where(local_bad, neg_inf, m_r)] if with_ref else []), 1)
        if group is not None:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        big_m = maxima[:, 0]
        alpha = _rescale(m_z, big_m, local_bad)
        shift = torch.where(alpha > 0, m_z - big_m, 0.0)
        cols = [alpha * s_z, alpha * (a_z + shift * s_z), z_t, local_bad.float()]
        if with_ref:
            big_mr = maxima[:, 1]
            cols += [_rescale(m_r, big_mr, local_bad) * s_r, alpha * b_z]
        # All-reduce 2: rescaled sums, the target logit and the non-finite flags.
        sums = torch.stack(cols, 1)
        if group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        bad = sums[:, 3] > 0
        s_tot = torch.where(bad, 1.0, sums[:, 0])
        log_s = s_tot.log()
        lse = torch.where(bad, 0.0, big_m + log_s)
        zero = torch.zeros((), **f32)
        logprobs = torch.where(bad, zero, sums[:, 2] - lse)
        entropy = torch.where(bad, zero, log_s - sums[:, 1] / s_tot) if with_entropy else zero.new_empty(0)
        if with_ref:
            s_ref = torch.where(bad, 1.0, sums[:, 4])
            lse_ref = torch.where(bad, 0.0, big_mr + s_ref.log())
            kl = torch.where(bad, zero, sums[:, 5] / s_tot - (big_m - big_mr) - (log_s - s_ref.log()))
        else:
            lse_ref, kl = zero.new_empty(0), zero.new_empty(0)
        count = bad.sum()

        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, ref_logits, lse, entropy, kl, lse_ref, bad)
        ctx.meta = (vocab_start, n_real, chunk_size)
        ctx.mark_non_differentiable(bad, count)
        return logprobs, entropy, kl, bad, count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent, g_kl, _g_bad, _g_count):
        logits, targets, ref_logits, lse, entropy, kl, lse_ref, bad = ctx.saved_tensors
        vocab_start, n_real, chunk_size = ctx.meta
        if n_real == 0 or (g_lp is None and g_ent is None and g_kl is None):
            return torch.zeros_like(logits), None, None, None, None, None, None, None
        # Contiguous, so that the row view below writes into it whatever the logits' strides;
        # every real column is written by the chunk loop, only the padding needs zeroing.
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        g_rows = _rows(grad)
        g_rows[:, n_real:] = 0
        z_all = _rows(logits)
        r_all = _rows(ref_logits) if (ref_logits is not None and g_kl is not None) else None
        n_tok = z_all.shape[0]
        zeros = torch.zeros(n_tok, dtype=torch.float32, device=logits.device)
        g_lp = zeros if g_lp is None else g_lp.reshape(-1).float()
        g_ent = zeros if g_ent is None else g_ent.reshape(-1).float()
        g_kl = zeros if (g_kl is None or r_all is None) else g_kl.reshape(-1).float()
        ent = entropy if entropy.numel() else zeros
        kl_v = kl if kl.numel() else zeros
        # dL/dz_j = p_j * (a + b * lp_j - g_kl * lq_j) + g_lp * [j == t], per token:
        a = -g_lp - g_ent * ent - g_kl * kl_v
        b = zeros if (g_ent is zeros and g_kl is zeros) else g_kl - g_ent
        t_local = targets.reshape(-1) - vocab_start
        t_index = t_local.clamp(0, n_real - 1).unsqueeze(1)
        t_grad = torch.where((t_local >= 0) & (t_local < n_real), g_lp, 0.0).unsqueeze(1)
        only_lp = b is zeros and r_all is None  # coef = a: skip the per-element log p terms
        work = _workspace(3 if r_all is not None else 2, min(chunk_size, n_tok), n_real, logits.device)
        for lo in range(0, n_tok, chunk_size):
            hi = min(lo + chunk_size, n_tok)
            lp, p = work[0][:hi - lo], work[1][:hi - lo]
            lp.copy_(z_all[lo:hi, :n_real]).sub_(lse[lo:hi, None])
            torch.exp(lp, out=p)
            if only_lp:
                p.mul_(a[lo:hi, None])
            else:
                coef = lp.mul_(b[lo:hi, None]).add_(a[lo:hi, None])
                if r_all is not None:
                    lq = work[2][:hi - lo].copy_(r_all[lo:hi, :n_real]).sub_(lse_ref[lo:hi, None])
                    coef.sub_(lq.mul_(g_kl[lo:hi, None]))
                p.mul_(coef)
            p.scatter_add_(1, t_index[lo:hi], t_grad[lo:hi])
            g_rows[lo:hi, :n_real].copy_(p)  # one rounding to the logits' dtype
        del work
        if bool(bad.any()):  # their saved logits are NaN/Inf: the recomputed rows are garbage
            g_rows[bad] = 0
        return grad, None, None, None, None, None, None, None


def _rescale(m_local, m_global, local_bad):
    """exp(m_local - m_global), 0 where this rank has nothing for the token."""
    ok = torch.isfinite(m_local) & ~local_bad & torch.isfinite(m_global)
    return torch.where(ok, torch.exp(torch.where(ok, m_local - m_global, 0.0)), 0.0)
