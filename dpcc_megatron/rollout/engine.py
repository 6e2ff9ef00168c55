"""The rollout-engine interface: what the trainer sees of whichever engine generates its samples.

    engine.refit_if_stale(chunks, version)     # the trainer's weight version; refits only when it moved
    gen = engine.generate(prompt_ids, Sampling(max_new_tokens=16, temperature=1.0, seed=s,
                                               stop_token_ids=(eos,)))
    gen.responses[i], gen.logprobs[i], gen.finished[i]

Engines (``rollout.engine``):

* ``megatron`` (:mod:`dpcc_megatron.megatron.megatron_engine`): the policy's own Megatron-Core
  chunks at the training TP/PP layout with a KV-cached decode loop; ``update_weights`` is free
  (it reads the training weights themselves).
* ``vllm`` (:mod:`dpcc_megatron.rollout.vllm_engine`): a tensor-parallel vLLM engine colocated with
  the trainer ranks of each model-parallel group, refit in memory bucket by bucket when the weights changed.

Every rank of a model-parallel group calls ``generate`` with the same prompts and gets the same
:class:`Generation`. No Megatron import here.
"""
from __future__ import annotations

import abc

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch


class EngineFailure(RuntimeError):
    """The rollout engine failed (a refit, a generate, a dead engine process): the run must stop with a
    checkpoint, on every rank alike."""


class RefitError(EngineFailure):
    """Loading the trainer's weights into the rollout engine failed; rollouts must not continue
    from the engine's stale weights (raised on every rank alike)."""


class EngineStartError(RuntimeError):
    """The rollout engine could not start, or its model does not match the model config."""


@dataclass(frozen=True)
class Sampling:
    """How to sample. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable the filters."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    """Seeds the draws: the same prompts, weights and seed give the same samples (per engine)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a sequence stops after any of these (kept in the response). Empty: only max_new_tokens."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generation:
    """One response per prompt, in the order of the prompts."""

    responses: list[list[int]]
    """Generated token ids (a stop token, when one ended the response, included)."""
    logprobs: list[torch.Tensor] = field(default_factory=list)
    """Per response token: its log-prob under the raw temperature-1 policy as the engine computed it
    (fp32, unfiltered), so the trainer's recomputation differs only by sampler/trainer mismatch."""
    finished: list[bool] = field(default_factory=list)
    """True when the response ended with a stop token, False when it hit max_new_tokens."""
    routing: Optional[list[torch.Tensor]] = None
    """Mixture of experts, where the engine records it (routing replay): per response, [prompt + response
    length - 1, this rank's MoE layers, top-k] int16, the experts the token at each input position was
    routed to when it was sampled (the last token is never an input). None: not recorded."""

    def __post_init__(self) -> None:
        n = len(self.responses)
        if len(self.logprobs) != n or len(self.finished) != n:
            raise ValueError(f"Generation: {n} responses but {len(self.logprobs)} log-prob rows and "
                             f"{len(self.finished)} finish flags")
        for i, (r, lp) in enumerate(zip(self.responses, self.logprobs)):
            if len(r) != len(lp):
                raise ValueError(f"Generation: response {i} has {len(r)} tokens but {len(lp)} log-probs")
        if self.routing is not None and len(self.routing) != n:
            raise ValueError(f"Generation: {n} responses but {len(self.routing)} routing rows")


class RefitByVersion(abc.ABC):
    """The weight version an engine serves: :meth:`refit_if_stale` refits only when the trainer's version
    moved since the last refit (dynamic-sampling rounds and evaluations between two optimizer steps reuse
    the engine's weights)."""

    weight_version: Optional[int] = None
    """The trainer weight version the engine serves (None: none yet, or the last refit failed)."""

    @abc.abstractmethod
    def update_weights(self, chunks) -> None:
        """Load ``chunks``' weights into the engine (collective); each engine defines it."""

    def refit(self, chunks, version: int) -> None:
        """Serve ``chunks`` as weight version ``version`` from now on (collective)."""
        self.weight_version = None
        self.update_weights(chunks)
        self.weight_version = version

    def refit_if_stale(self, chunks, version: int) -> bool:
        """:meth:`refit` unless the engine already serves ``version``; True when it refit (collective:
        every rank passes the same version)."""
        if self.weight_version == version:
            return False
        self.refit(chunks, version)
        return True


class RolloutEngine(Protocol):
    name: str
    last_refit_s: float
    """Seconds the last update_weights took (0 where the engine reads the training weights directly)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: Sampling) -> Generation:
        """One response per prompt (repeat a prompt G times for a group); collective over the model-parallel group."""

    weight_version: Optional[int]

    def update_weights(self, chunks) -> None:
        """Serve the current weights of the training ``chunks`` from now on (collective over all ranks);
        raises :class:`RefitError` on every rank when it fails."""

    def refit_if_stale(self, chunks, version: int) -> bool:
        """``update_weights`` unless the engine already serves weight ``version`` (see :class:`RefitByVersion`)."""

    def sleep(self) -> None:
        """Release what memory the engine can while training runs (no-op where unsupported)."""

    def wake(self) -> None:
        """Undo :meth:`sleep` before the next generate."""

    def close(self) -> None:
        """Stop the engine and its processes."""
