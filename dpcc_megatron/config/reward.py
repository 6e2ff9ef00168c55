"""reward section of the config tree: the dual-track reward (rule checkers + contrastive judge).

    reward:
      base_weight: 0.4            # total = base_weight * base + advanced_weight * advanced
      advanced_weight: 0.6
      tasks:                      # per-task checkers; merged over DEFAULT_TASK_CHECKERS
        addition:
          - {name: math}
          - {name: format, weight: 0.1, params: {pattern: '\\s*-?\\d+\\s*', fullmatch: true}}
      judge: {kind: deterministic}
      dynamic: {enabled: true, min_base_weight: 0.2, max_base_weight: 0.8}

Checker names are checked against the registry when the reward model is built
(``dpcc_megatron.rewards``), so loading a config never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from .base import check


@dataclass
class CheckerSpec:
    """One rule checker applied to a task.

    Read by: dpcc_megatron/rewards/base_layer.py.
    """

    name: str
    """Registered checker name (`math`, `code`, `json`, `format`, `language`, `exact`, `sequence`, ...)."""
    weight: float = 1.0
    """Weight in the base score: score checkers are averaged with it; penalty checkers subtract weight * penalty."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword parameters passed to the checker (e.g. `pattern` for `format`)."""
    key: Optional[str] = None
    """Name the score is reported under (defaults to `name`; set it to use one checker twice in a task)."""

    def validate(self) -> None:
        check(bool(self.name), "name", "must be a non-empty checker name")
        check(self.weight >= 0, "weight", f"must be >= 0, got {self.weight}")


def _spec(name: str, weight: float = 1.0, **params: Any) -> CheckerSpec:
    return CheckerSpec(name=name, weight=weight, params=params)


def default_task_checkers() -> dict[str, list[CheckerSpec]]:
    """Built-in checkers per task; `reward.tasks` entries replace these task by task."""
    return {
        "math": [_spec("math")],
        # The synthetic tasks: exact correctness plus a small format-shaping term.
        "addition": [_spec("math"), _spec("format", 0.1, pattern=r"\s*-?\d+\s*", fullmatch=True)],
        "sorting": [_spec("sequence"), _spec("format", 0.1, pattern=r"\s*-?\d+(?:[\s,]+-?\d+)*\s*", fullmatch=True)],
        "code": [_spec("code")],
        "json": [_spec("json")],
        # `format` only applies to samples that carry their own `pattern`.
        "text": [_spec("language"), _spec("format")],
    }


@dataclass
class PenaltyConfig:
    """Penalties subtracted from the base score of every task (DAPO-style overlong, repeated n-grams).

    Read by: dpcc_megatron/rewards/base_layer.py.
    """

    max_length: int = 0
    """Hard length cap in tokens; 0 disables the overlong penalty (set it to rollout.max_new_tokens)."""
    overlong_buffer: int = 0
    """N: the penalty rises linearly from 0 to 1 over the last N tokens before `max_length`."""
    overlong_coef: float = 1.0
    """Weight of the overlong penalty."""
    repetition_ngram: int = 4
    """n of the repeated-n-gram penalty; 0 disables it."""
    repetition_threshold: float = 0.2
    """Share of repeated n-grams tolerated before the repetition penalty starts."""
    repetition_coef: float = 0.5
    """Weight of the repetition penalty."""

    def validate(self) -> None:
        check(self.max_length >= 0, "max_length", f"must be >= 0, got {self.max_length}")
        check(0 <= self.overlong_buffer <= self.max_length, "overlong_buffer",
              f"must be in [0, max_length={self.max_length}], got {self.overlong_buffer}"
              + (" (max_length 0 disables the overlong penalty)" if self.max_length == 0 else ""))
        check(self.overlong_coef >= 0, "overlong_coef", f"must be >= 0, got {self.overlong_coef}")
        check(self.repetition_ngram >= 0, "repetition_ngram", f"must be >= 0, got {self.repetition_ngram}")
        check(0 <= self.repetition_threshold < 1, "repetition_threshold",
              f"must be in [0, 1), got {self.repetition_threshold}")
        check(self.repetition_coef >= 0, "repetition_coef", f"must be >= 0, got {self.repetition_coef}")


@dataclass
class RemoteSandboxConfig:
    """A SandboxFusion service (``POST {url}/run_code``) that runs the code instead of this node.

    Read by: dpcc_megatron/rewards/sandbox/.
    """

    url: str = ""
    """Base URL of the service, e.g. http://sandbox:8080 (required when backend is remote)."""
    request_timeout_s: float = 30.0
    """HTTP timeout of one request, on top of the run's own timeout_s."""
    retries: int = 2
    """Retries of a request that failed for the service's reason (connection, HTTP 5xx, SandboxError)."""
    max_in_flight: int = 8
    """Requests sent at once; more wait in the queue."""
    max_queue: int = 64
    """Runs allowed to wait for a free slot; beyond it a run is skipped and counted (bounded queue)."""
    max_failures: int = 20
    """Service failures in a row after which the job stops; each failure before is a counted skip."""

    def validate(self) -> None:
        check(self.url == "" or self.url.startswith(("http://", "https://")), "url",
              f"must be an http(s) URL, got {self.url!r}")
        check(self.request_timeout_s > 0, "request_timeout_s", f"must be > 0, got {self.request_timeout_s}")
        check(self.retries >= 0, "retries", f"must be >= 0, got {self.retries}")
        check(self.max_in_flight >= 1, "max_in_flight", f"must be >= 1, got {self.max_in_flight}")
        check(self.max_queue >= 0, "max_queue", f"must be >= 0, got {self.max_queue}")
        check(self.max_failures >= 1, "max_failures", f"must be >= 1, got {self.max_failures}")


@dataclass
class SandboxConfig:
    """Where and how model-written code runs (code checker unit tests); docs/sandbox.md.

    Read by: dpcc_megatron/rewards/.
    """

    backend: Literal["local", "remote"] = "local"
    """`local`: an isolated process per run on this node; `remote`: a SandboxFusion service (see `remote`)."""
    isolation: Literal["auto", "bwrap", "namespaces", "none"] = "auto"
    """Local backend: `bwrap` (bubblewrap), `namespaces` (util-linux unshare), `auto` (the first that works
    here; the job stops if none does), or `none` (no isolation: warned at every start)."""
    timeout_s: float = 5.0
    """Wall-clock limit per run; the sandbox is killed after it and the sample counts as a timeout (score 0)."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS)."""
    cpu_s: int = 0
    """CPU-time limit (RLIMIT_CPU); 0 means ceil(timeout_s) + 1."""
    file_size_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE), also caps its captured error output."""
    scratch_mb: int = 64
    """Size of the private scratch (a tmpfs, the only writable place) of an isolated run."""
    workers: int = 4
    """Sandbox runs executed in parallel."""
    remote: RemoteSandboxConfig = field(default_factory=RemoteSandboxConfig)
    """The service used when backend is remote."""

    def validate(self) -> None:
        check(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")
        check(self.memory_mb >= 64, "memory_mb", f"must be >= 64, got {self.memory_mb}")
        check(self.cpu_s >= 0, "cpu_s", f"must be >= 0, got {self.cpu_s}")
        check(self.file_size_mb >= 1, "file_size_mb", f"must be >= 1, got {self.file_size_mb}")
        check(self.scratch_mb >= 1, "scratch_mb", f"must be >= 1, got {self.scratch_mb}")
        check(self.workers >= 1, "workers", f"must be >= 1, got {self.workers}")
        check(self.backend != "remote" or bool(self.remote.url), "remote.url", "must be set when backend is remote")


@dataclass
class JudgeConfig:
    """The advanced-track judge: a utility per sample, turned into Bradley-Terry win rates.

    Read by: dpcc_megatron/rewards/judges.py, dpcc_megatron/rewards/dual_track.py.
    """

    kind: Literal["deterministic", "hf_rm"] = "deterministic"
    """`deterministic` (base score + quality features) or `hf_rm` (local HF sequence-classification model)."""
    path: str = ""
    """Local directory of the HF reward model and its tokenizer (kind `hf_rm`); nothing is downloaded."""
    batch_size: int = 8
    """Sequences per reward-model forward."""
    max_tokens: int = 1024
    """Reward-model input cap; longer inputs keep their end."""
    device: str = "cpu"
    """Torch device of the reward model."""
    temperature: float = 1.0
    """Bradley-Terry temperature: P(i beats j) = sigmoid((u_i - u_j) / temperature)."""
    base_coef: float = 4.0
    """Deterministic judge: weight of the base score in the utility."""
    repetition_coef: float = 1.0
    """Deterministic judge: weight of (1 - repeated n-gram share)."""
    language_coef: float = 1.0
    """Deterministic judge: weight of language consistency."""
    length_coef: float = 0.5
    """Deterministic judge: weight of brevity, 1 - min(1, length / length_scale)."""
    length_scale: int = 512
    """Deterministic judge: length (tokens) at which the brevity feature reaches 0."""

    def validate(self) -> None:
        check(self.kind != "hf_rm" or bool(self.path), "path", "must name a local model directory when kind is hf_rm")
        check(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        check(self.max_tokens >= 8, "max_tokens", f"must be >= 8, got {self.max_tokens}")
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(self.length_scale >= 1, "length_scale", f"must be >= 1, got {self.length_scale}")
        for name in ("base_coef", "repetition_coef", "language_coef", "length_coef"):
            check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")


@dataclass
class DynamicWeightConfig:
    """Shift weight toward the more reliable track, within bounds.

    Read by: dpcc_megatron/rewards/.
    """

    enabled: bool = False
    """Off: the static base_weight/advanced_weight are used."""
    min_base_weight: float = 0.2
    """Lower bound of the base weight (the advanced weight is 1 - base)."""
    max_base_weight: float = 0.8
    """Upper bound of the base weight."""
    rate: float = 0.1
    """Step toward the target weight per scored batch (0..1)."""
    ema: float = 0.9
    """Smoothing of the per-batch reliability estimates."""
    probe_size: int = 4
    """Samples re-scored each batch to measure each track's noise (test-retest); 0 uses duplicates only."""
    eval_interval: int = 50
    """Batches between re-scoring the labelled eval set (when `reward.eval_set` is set)."""

    def validate(self) -> None:
        check(0 <= self.min_base_weight <= 1, "min_base_weight", f"must be in [0, 1], got {self.min_base_weight}")
        check(self.min_base_weight <= self.max_base_weight <= 1, "max_base_weight",
              f"must be in [min_base_weight={self.min_base_weight}, 1], got {self.max_base_weight}")
        check(0 < self.rate <= 1, "rate", f"must be in (0, 1], got {self.rate}")
        check(0 <= self.ema < 1, "ema", f"must be in [0, 1), got {self.ema}")
        check(self.probe_size >= 0, "probe_size", f"must be >= 0, got {self.probe_size}")
        check(self.eval_interval >= 1, "eval_interval", f"must be >= 1, got {self.eval_interval}")


@dataclass
class RewardConfig:
    """Dual-track reward: rule-based base layer + contrastive advanced layer.

    Read by: dpcc_megatron/rewards/, dpcc_megatron/train/rollout.py.
    """

    base_weight: float = 0.4
    """Static weight of the base (rule) track; also the starting point of dynamic weights."""
    advanced_weight: float = 0.6
    """Static weight of the advanced (contrastive) track; base_weight + advanced_weight must be 1."""
    normalize: Literal["none", "group", "batch"] = "none"
    """Z-score each track separately (within its group, or over the batch) before combining; `none` keeps totals in [0, 1]."""
    tasks: dict[str, list[CheckerSpec]] = field(default_factory=dict)
    """Task name -> checkers; entries replace the built-in defaults of that task (math, addition, sorting, code, json, text)."""
    fallback_task: Optional[str] = None
    """Checkers used for samples whose task has none (counted in reward/unknown_task); None makes an
    unknown task an error (the trainer checks every prompt's task when it loads the data)."""
    penalties: PenaltyConfig = field(default_factory=PenaltyConfig)
    """Overlong and repetition penalties."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits for running untrusted code."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """Judge of the advanced track."""
    dynamic: DynamicWeightConfig = field(default_factory=DynamicWeightConfig)
    """Dynamic track weights."""
    eval_set: Optional[str] = None
    """JSONL of samples with a human `label` in [0, 1]; measures each track's agreement with humans."""
    buffer_size: int = 256
    """Older-policy samples kept for the advanced track's comparisons (0 disables the buffer)."""
    buffer_per_prompt: int = 4
    """At most this many older samples per prompt."""
    buffer_weight: float = 0.5
    """Weight of one comparison against an older sample relative to one against a group member."""
    contrastive_gate: Literal["none", "base_spread"] = "base_spread"
    """`base_spread` (default): in groups whose rule scores are all equal, replace the advanced track by its
    group mean, so the judge's non-correctness differences there do not become group-normalised advantages
    (measured: ungated, they gave pre-clip gradient norms of 20-270 against GRPO's 1-4). `none`: as in the
    literal DPCC specification (set it with loss.dpcc.preset: paper to reproduce that method)."""

    def validate(self) -> None:
        check(0 <= self.base_weight <= 1, "base_weight", f"must be in [0, 1], got {self.base_weight}")
        check(0 <= self.advanced_weight <= 1, "advanced_weight", f"must be in [0, 1], got {self.advanced_weight}")
        check(abs(self.base_weight + self.advanced_weight - 1) < 1e-6, "advanced_weight",
              f"must equal 1 - base_weight = {1 - self.base_weight:g}, got {self.advanced_weight}")
        for task, specs in self.tasks.items():
            keys = [s.key or s.name for s in specs]
            dup = sorted({k for k in keys if keys.count(k) > 1})
            check(not dup, f"tasks.{task}", f"reports checker {dup[0] if dup else ''!r} twice; give one a distinct `key`")
            check(any(s.weight > 0 for s in specs), f"tasks.{task}", "needs at least one checker with weight > 0")
        check(self.fallback_task is None or bool(self.fallback_task), "fallback_task", "must be null or name a task")
        check(self.buffer_size >= 0, "buffer_size", f"must be >= 0, got {self.buffer_size}")
        check(self.buffer_per_prompt >= 1, "buffer_per_prompt", f"must be >= 1, got {self.buffer_per_prompt}")
        check(self.buffer_weight >= 0, "buffer_weight", f"must be >= 0, got {self.buffer_weight}")
