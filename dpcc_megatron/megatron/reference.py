"""The frozen reference policy behind ``loss.ref_kl_coef > 0``.

    ref = ReferencePolicy.build(policy_chunks, cfg.model, cfg.parallel, cfg.precision,
                                path=cfg.loss.ref_model_path, offload=cfg.loss.ref_offload)
    batch.ref_logprobs = ref.logprobs(batch, micro_batch_size=..., vocab_size=..., dp_size=...)

It has the policy's layout (the same TP/PP/VPP chunks, built by the same builder), no DDP
wrapper, no optimizer and no gradients. Its weights are the policy's at the moment it is
built (the trainer builds it when RL starts: after ``checkpoint.load`` and the supervised
warm-start), or a separate Megatron checkpoint (``loss.ref_model_path``). With ``offload``
the weights live in host memory between uses and visit the GPU only for the forward.
Checkpoints save it beside the policy (key prefix ``ref.``), so a resumed run uses the same
reference, bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import ModelConfig, ParallelConfig, PrecisionConfig

PREFIX = "ref."


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class ReferencePolicy:
    """Frozen model chunks with a forward-only log-prob pass and optional host offload."""

    def __init__(self, chunks: list, offload: bool = False):
        self.chunks = chunks
        self.offload = offload
        self.path: Optional[str] = None
        for c in chunks:
            c.eval()
            for p in c.parameters():
                p.requires_grad_(False)
        if offload:
            self._to(torch.device("cpu"))

    @classmethod
    def build(cls, policy_chunks: list, model: ModelConfig, parallel: ParallelConfig,
              precision: Optional[PrecisionConfig] = None, *, path: Optional[str] = None,
              offload: bool = False) -> "ReferencePolicy":
        """Collective. Chunks like the policy's, filled from ``path`` or from the policy's current weights.

        The random initialisation of the new chunks is done under saved-and-restored RNG
        states, so building a reference does not change the run's random stream."""
        from .checkpoint import rng_state, set_rng_state
        from .model import build_gpt_model

        rng = rng_state()
        try:
            vpp = parallel.virtual_pipeline_model_parallel_size  # the same chunks as build_training_model
            chunks = [build_gpt_model(model, parallel, precision, vp_stage=i if vpp else None)
                      for i in range(len(policy_chunks))]
        finally:
            set_rng_state(rng)
        ref = cls(chunks, offload=False)
        if path:
            from ..convert import load_mcore_checkpoint

            load_mcore_checkpoint(chunks, path, model)
        else:
            ref.sync_from(policy_chunks)
        ref.path = path
        if offload:
            ref.offload = True
            ref._to(torch.device("cpu"))
        return ref

    def sync_from(self, policy_chunks: list) -> None:
        """Copy the policy's current weights (the trainer calls it when RL starts, after the warm-start)."""
        with torch.no_grad():
            for ref, pol in zip(self.chunks, policy_chunks):
                missing, unexpected = ref.load_state_dict(_unwrap(pol).state_dict(), strict=False)
                bad = [k for k in missing + unexpected if not k.endswith("_extra_state")]
                if bad:
                    raise RuntimeError(f"reference model does not match the policy's layout: {bad[:5]}")

    # -- forward -----------------------------------------------------------------------------------
    def logprobs(self, batch, *, micro_batch_size: int, vocab_size: int, dp_size: int,
                 max_tokens: int = 0) -> Optional[torch.Tensor]:
        """log pi_ref of ``batch``'s targets on the last pipeline stage (None elsewhere)."""
        from .policy_step import compute_logprobs

        if self.offload:
            self._to(_device())
        try:
            lp, _ = compute_logprobs(self.chunks, batch, micro_batch_size=micro_batch_size, vocab_size=vocab_size,
                                     dp_size=dp_size, train_mode_after=False, max_tokens=max_tokens)
        finally:
            if self.offload:
                self._to(torch.device("cpu"))
        return lp

    def _to(self, device: torch.device) -> None:
        for c in self.chunks:
            for t in list(c.parameters()) + list(c.buffers()):
                t.data = t.data.to(device, non_blocking=False)
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- state ---------------------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """dist_checkpointing entries of the reference: the policy's keys with the prefix ``ref.``
        (virtual-pipeline chunks share keys with global layer offsets, as the policy's do)."""
        return {f"ref{i}": c.sharded_state_dict(prefix=PREFIX) for i, c in enumerate(self.chunks)}

    def load_sharded(self, loaded: dict) -> None:
        """Fill the chunks from what ``dist_checkpointing.load`` returned for ``sharded_state_dict()``."""
        with torch.no_grad():
            for i, c in enumerate(self.chunks):
                state = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in loaded[f"ref{i}"].items()}
                missing, _ = c.load_state_dict(state, strict=False)
                bad = [k for k in missing if not k.endswith("_extra_state")]
                if bad:
                    raise RuntimeError(f"checkpoint's reference model lacks {bad[:5]}")

    def num_parameters(self) -> int:
        """Parameters on this rank (for the memory planner's check)."""
        return sum(p.numel() for c in self.chunks for p in c.parameters())

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for c in self.chunks for p in c.parameters())
