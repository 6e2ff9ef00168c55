"""Held-out evaluation: greedy reward and pass@k, generated at the policy's TP/PP layout.

``eval`` in the config: the held-out prompts (``eval.data``, read like ``data.prompts``; without
it the synthetic task's held-out prompts, or nothing for a file dataset), ``eval.interval``,
``eval.greedy`` and ``eval.samples``. One evaluation:

* **greedy**: one greedy answer per prompt; ``reward_greedy`` is the mean rule (base-track)
  reward, ``accuracy_greedy`` the share at or above ``eval.pass_threshold``;
* **sampled** (``eval.samples = n > 0``): n answers per prompt at the rollout's temperature,
  top-p and top-k, from a generator seeded the same way at every evaluation, so the numbers
  move only with the weights; ``pass_at_k`` for k = 1, 2, 4, ... < n and k = n uses the
  unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021) averaged over prompts, with c
  the prompt's passing answers.

Each data-parallel rank takes its share of the prompts; rank 0 of each model-parallel group
scores, and the sums are all-reduced, so every rank returns the same metrics. Evaluation draws
from its own generators and never updates reward state, so it does not change the training run.
Rank 0 prints one console line and hands the metrics to the experiment loggers, the monitor
sidecar (kind ``eval``) and ``eval.jsonl``; ``summary.json``'s ``eval`` holds the last one. The
record of the iteration that samples with the evaluated weights carries its main metrics as
``eval_reward_greedy``, ``eval_accuracy_greedy``, ``eval_reward_sampled`` and ``eval_pass_at_1``,
for the collapse detector.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch

from ..data.formats import load_prompts
from ..data.prompts import Prompt, synthetic_prompts
from ..distributed import reduce_values
from .rollout import encode_prompts, generate, reward_samples, unpack

EVAL_SEED = 8_675_309
#: Evaluation metrics the next iteration record carries, prefixed ``eval_`` (:meth:`Evaluator.record_fields`).
RECORD_FIELDS = ("reward_greedy", "accuracy_greedy", "reward_sampled", "pass_at_1")


def load_eval_prompts(cfg) -> list[Prompt]:
    """The held-out prompts (the first ``eval.max_prompts``), or [] when there are none."""
    ev, data = cfg.eval, cfg.data
    if ev.data:
        prompts = load_prompts(ev.data, data.format, data.default_task, key="eval.data")
    elif data.prompts is None:
        prompts = synthetic_prompts(data.synthetic_task, data.synthetic_digits, ev.max_prompts or 64,
                                    seed=cfg.train.seed + 99991)
    else:
        prompts = []
    return prompts[: ev.max_prompts] if ev.max_prompts else prompts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_for(n: int) -> list[int]:
    """k = 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


class Evaluator:
    """Runs the configured evaluation for one run context."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.eval
        self.prompts = ctx.eval_prompts
        self.last: Optional[dict] = None
        self.records: list[dict] = []
        self._pending: Optional[dict] = None  # the latest evaluation, until the next iteration record takes it
        if ctx.rank == 0 and not self.prompts:
            print("[dpcc] evaluation off: data.prompts is a file and eval.data is not set", flush=True)

    @property
    def enabled(self) -> bool:
        return bool(self.prompts)

    def due(self, iteration: int) -> bool:
        """After ``iteration`` completed iterations: on eval.interval (start and end are run by the trainer)."""
        return self.enabled and self.cfg.interval > 0 and iteration % self.cfg.interval == 0

    def run(self, iteration: int) -> Optional[dict]:
        """Evaluate the current weights; ``iteration``: completed iterations. Same dict on every rank.

        Collective. The engine is refit first when the weights changed since its last refit; a refit
        that does not take or a dead engine raises :class:`~dpcc_megatron.rollout.engine.EngineFailure`
        on every rank."""
        if not self.enabled:
            return None
        ctx = self.ctx
        t0 = time.time()
        ctx.weights.refit()  # the engine serves the weights being evaluated (only when they changed)
        mine = self.prompts[ctx.dp_rank::ctx.dp]
        ids = encode_prompts(ctx, mine)
        sums: dict[str, float] = {}
        if self.cfg.greedy:
            out = generate(ctx, ids, greedy=True, seed=0)
            base, lens, done = self._score(out, mine, 1)
            sums["reward_greedy"] = float(base.sum())
            sums["accuracy_greedy"] = float((base >= self.cfg.pass_threshold).sum())
            sums["response_len_greedy"] = float(lens.sum())
            sums["finished_greedy"] = float(done.sum())
        n = self.cfg.samples
        if n > 0:
            expanded = [p for p in mine for _ in range(n)]
            seed = ctx.cfg.train.seed * 1_000_003 + EVAL_SEED + ctx.dp_rank
            out = generate(ctx, [i for i in ids for _ in range(n)], greedy=False, seed=seed)
            base, lens, done = self._score(out, expanded, n)
            sums["reward_sampled"] = float(base.sum()) / n
            sums["response_len_sampled"] = float(lens.sum()) / n
            passed = (base >= self.cfg.pass_threshold).view(-1, n).sum(1).tolist() if len(base) else []
            for k in ks_for(n):
                sums[f"pass_at_{k}"] = sum(pass_at_k(n, int(c), k) for c in passed)
        sums["prompts"] = float(len(mine)) if ctx.mp_rank == 0 else 0.0
        metrics = self._reduce(sums)
        count = max(metrics.pop("prompts"), 1.0)
        metrics = {k: round(v / count, 6) for k, v in metrics.items()}
        metrics["prompts"] = int(count)
        self._publish(iteration, metrics, time.time() - t0)
        return metrics

    def _score(self, out, prompts, group: int):
        """Per-answer base reward, length and finished flag on the model-parallel rank 0 (zeros elsewhere)."""
        ctx = self.ctx
        responses, _, finished = unpack(out, len(prompts))
        base = torch.zeros(len(prompts), dtype=torch.float64)
        lens = torch.tensor([float(len(r)) for r in responses], dtype=torch.float64)
        done = torch.tensor([float(f) for f in finished], dtype=torch.float64)
        if ctx.mp_rank != 0 or not prompts:
            return base, lens * 0, done * 0
        texts = [ctx.tokenizer.decode(r) for r in responses]
        res = ctx.reward.score(reward_samples(prompts, texts, responses, [i // group for i in range(len(prompts))]),
                               update=False)
        return res.base.double(), lens, done

    def _reduce(self, sums: dict) -> dict:
        keys = sorted(sums)
        return dict(zip(keys, reduce_values([sums[k] for k in keys], "sum")))

    def record_fields(self, iteration: int) -> dict:
        """``eval_<metric>`` of the evaluation taken on the weights iteration ``iteration`` samples with (after
        ``iteration`` completed iterations), for that iteration's record, once; {} when there was none. The
        detector reads them (monitor.reward_drop_confirm "eval")."""
        pending, self._pending = self._pending, None
        if pending is None or pending["iteration"] != iteration:
            return {}
        return {f"eval_{k}": pending[k] for k in RECORD_FIELDS if k in pending}

    def _publish(self, iteration: int, metrics: dict, seconds: float) -> None:
        self.last = {"iteration": iteration, **metrics}
        self._pending = self.last
        ctx = self.ctx
        if ctx.rank != 0:
            return
        self.records.append({"iteration": iteration, "kind": "eval", **metrics})
        parts = " | ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in metrics.items())
        print(f" eval after {iteration} iterations | {parts} | s: {seconds:.2f}", flush=True)
        if ctx.loggers is not None:
            ctx.loggers.log({f"eval/{k}": v for k, v in metrics.items()}, iteration)
        if ctx.exchange is not None:
            ctx.exchange.send_eval(iteration, metrics)


def evaluate_greedy(ctx, iteration: int = 0):
    """Run the held-out evaluation after ``iteration`` completed iterations; returns its greedy reward
    (None when evaluation is off or eval.greedy is false)."""
    metrics = ctx.evaluator.run(iteration) if ctx.evaluator is not None else None
    return None if metrics is None else metrics.get("reward_greedy")
