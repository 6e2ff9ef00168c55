"""One GPU check: a DPCC update step vs the plain Megatron LM training step of the same ~1B GPT.

    python benchmarks/gpu_check.py [--steps 8] [--warmup 3] [--seq-len 2048] [--micro-batch 4]
                                   [--num-micro 2] [--fp8 auto|off|on] [--tiny]

Run it through ``benchmarks/gpu_check.sh`` (installs megatron-core / this package from a
local wheel directory on an offline node). Per precision mode (BF16; FP8 when Transformer
Engine is installed and the GPU has compute capability >= 8.9) it builds the model once and
times, on the same weights and optimizer:

* ``plain``: Megatron's LM step: the 1F1B schedule with ``GPTModel(..., labels=)`` (vocab-
  parallel cross-entropy), mean over tokens, ``optimizer.step()``;
* ``dpcc``: :func:`dpcc_megatron.train.update.policy_update`: the same schedule with our fp32
  token stats (log-prob and entropy), the DPCC loss, the controller, the non-finite check and
  the drift-aware LR around ``optimizer.step()``. Old log-probs come from one untimed
  forward-only pass, perturbed so that the ratios are not all 1.

Figures per step (median of ``--steps`` timed steps after ``--warmup``): seconds, tokens/s,
MFU and the peak allocated memory of the phase; and ``dpcc_vs_plain`` = plain step time / DPCC
step time (the DPCC throughput as a fraction of plain; goal >= 0.9).

MFU = model FLOPs / (step time * peak). Model FLOPs per token = 6 N + 12 L h s (PaLM, appendix
B): N counts every weight used in a matmul (the output layer included, the input embedding
lookup excluded), 6 = forward 2 + backward 4 FLOPs per weight and token; 12 L h s is the
attention score and value matmuls (Q K^T and A V, forward + backward) with h = heads x
head dim and s the sequence length, counted for the full s x s square (not halved for the
causal mask, the usual convention). Peak = 989 TFLOP/s, the dense bf16 tensor-core peak of
one H100/H200 SXM; FP8 runs are reported against the same bf16 peak (FP8's is 1979), so the
two modes compare directly. ``--peak-tflops`` overrides it for other GPUs.

``--tiny`` runs the same code on CPU through the CPU execution layer with a tiny model (a dry
check of the script, not a measurement). The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
import traceback

import torch

H100_BF16_PEAK_TFLOPS = 989.0


def model_flops_per_token(n_matmul_params: int, num_layers: int, attn_width: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 N + 12 L h s (see the module docstring)."""
    return 6.0 * n_matmul_params + 12.0 * num_layers * attn_width * seq_len


def matmul_params(model) -> int:
    """Parameters used in matmuls: all but the input embedding (a lookup), unless tied."""
    total = sum(p.numel() for p in model.parameters())
    emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    if emb is not None and not tied:
        total -= emb.weight.numel()
    return total


def model_config(tiny: bool, seq_len: int):
    from dpcc_megatron.config import ModelConfig
    from dpcc_megatron.testing.tiny import tiny_model_config

    if tiny:
        return tiny_model_config(num_layers=2, max_seq_len=seq_len)
    # ~0.98B parameters: Llama-style, GQA 16 query heads / 8 KV groups, SwiGLU.
    return ModelConfig(num_layers=18, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
                       num_query_groups=8, vocab_size=32000, make_vocab_size_divisible_by=128,
                       max_seq_len=seq_len, normalization="RMSNorm", swiglu=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None


def _timed(step, steps: int, warmup: int) -> tuple[list[float], float | None]:
    for _ in range(warmup):
        step()
    _sync()
    _peak_reset()
    times = []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
    return times, _peak_gib()


def plain_lm_step(chunks, optimizer, micro_batches: list[torch.Tensor], seq_len: int) -> float:
    """Megatron's pretraining step: per-token cross-entropy from ``GPTModel(labels=)``, token mean."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dpcc_megatron.megatron.optimizer import zero_grads

    zero_grads(chunks, optimizer)
    device = micro_batches[0].device
    it = iter(micro_batches)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(inputs.shape[1], device=device).unsqueeze(0).expand_as(inputs)
        per_token = model(inputs, pos, attention_mask=None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return per_token, loss_func

    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=it, model=list(chunks),
                                      num_microbatches=len(micro_batches), seq_length=seq_len,
                                      micro_batch_size=micro_batches[0].shape[0], forward_only=False)
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("plain LM step: optimizer reported an unsuccessful step")
    return float(sum(o["lm loss"] for o in out) / len(out))


def run_mode(name: str, precision_kw: dict, args, device) -> dict:
    from megatron.core import parallel_state as ps

    from dpcc_megatron.algo import DPCCController
    from dpcc_megatron.config import JobConfig, OptimizerConfig, TrainConfig, from_dict
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_training_model
    from dpcc_megatron.megatron.policy_step import RLBatch, compute_logprobs
    from dpcc_megatron.train.update import policy_update
    from dpcc_megatron.testing.tiny import parallel_config

    model_cfg = model_config(args.tiny, args.seq_len)
    precision = from_dict(JobConfig, {"precision": precision_kw}).precision
    n_seqs = args.micro_batch * args.num_micro
    cfg = JobConfig(model=model_cfg, parallel=parallel_config(), precision=precision,
                    optim=OptimizerConfig(name="adam", lr=1e-6, clip_grad=1.0),
                    train=TrainConfig(mini_batch_size=n_seqs, micro_batch_size=args.micro_batch))
    cfg.loss.name = "dpcc"
    torch.manual_seed(0)
    chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision)
    optimizer = build_optimizer(chunks, cfg.optim, cfg.parallel, cfg.precision)
    inner = chunks[0].module
    n_params = sum(p.numel() for p in inner.parameters())
    attn_width = inner.config.num_attention_heads * inner.config.kv_channels
    flops_per_token = model_flops_per_token(matmul_params(inner), model_cfg.num_layers, attn_width, args.seq_len)

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model_cfg.vocab_size, (n_seqs, args.seq_len + 1), generator=g)
    mask = torch.zeros(n_seqs, args.seq_len, dtype=torch.bool)
    mask[:, args.seq_len // 4:] = True  # prompt quarter, response three quarters
    cfg.rollout.max_new_tokens = int(mask.sum(1).max())  # the generation budget covers these responses
    batch = RLBatch(tokens=tokens, mask=mask, advantages=torch.randn(n_seqs, generator=g))
    old, _ = compute_logprobs(chunks, batch, micro_batch_size=args.micro_batch, vocab_size=model_cfg.vocab_size,
                              dp_size=1)
    batch.old_logprobs = old + 0.05 * torch.randn(old.shape, generator=g).to(old.device)
    controller = DPCCController(cfg.loss.dpcc, total_steps=10 ** 6)
    groups = dict(dp_group=ps.get_data_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group())
    micro = [t.to(device) for t in tokens.split(args.micro_batch)]
    trained_tokens = n_seqs * args.seq_len  # both steps run forward/backward on every position

    result = {"params": n_params, "flops_per_token": flops_per_token, "tokens_per_step": trained_tokens}
    losses = {}

    def plain():
        losses["plain"] = plain_lm_step(chunks, optimizer, micro, args.seq_len)

    def dpcc():
        res = policy_update(chunks, optimizer, None, controller, batch, cfg, dp_size=1,
                            vocab_size=model_cfg.vocab_size, **groups)
        if res.skipped:
            raise RuntimeError(f"DPCC step skipped (non-finite): {res.metrics}")
        losses["dpcc"] = res.metrics["pg_loss"]

    for label, step in (("plain", plain), ("dpcc", dpcc)):
        times, peak = _timed(step, args.steps, args.warmup)
        sec = statistics.median(times)
        result[label] = {
            "step_s": sec, "tokens_per_s": trained_tokens / sec,
            "mfu": trained_tokens * flops_per_token / sec / (args.peak_tflops * 1e12),
            "peak_mem_gib": peak, "loss": losses[label],
        }
    result["dpcc_vs_plain"] = result["plain"]["step_s"] / result["dpcc"]["step_s"]
    del chunks, optimizer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"[{name}] params {n_params / 1e9:.3f}B | " + " | ".join(
        f"{k}: {result[k]['step_s'] * 1e3:.0f} ms/step, {result[k]['tokens_per_s']:.0f} tok/s, "
        f"MFU {result[k]['mfu']:.3f}, peak {result[k]['peak_mem_gib'] or 0:.1f} GiB" for k in ("plain", "dpcc"))
        + f" | dpcc/plain throughput {result['dpcc_vs_plain']:.3f}", flush=True)
    return result


def te_fp8_smoke(precision_kw: dict) -> dict:
    """One TE Linear forward/backward under FP8 through our recipe builder and autocast shim."""
    import transformer_engine.pytorch as te

    from dpcc_megatron.config import JobConfig, from_dict
    from dpcc_megatron.megatron.precision import build_fp8_recipe, te_autocast, te_autocast_api

    precision = from_dict(JobConfig, {"precision": precision_kw}).precision
    layer = te.Linear(1024, 1024, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te_autocast(True, build_fp8_recipe(precision)):
        y = layer(x)
    y.float().sum().backward()
    return {"ok": bool(torch.isfinite(x.grad).all()), "api": te_autocast_api(te)}


def _init(tiny: bool):
    import torch.distributed as dist

    from dpcc_megatron.megatron.parallel import init_distributed, init_model_parallel
    from dpcc_megatron.testing.tiny import parallel_config

    if tiny:
        from dpcc_megatron.testing import enable_cpu_megatron

        enable_cpu_megatron()
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --tiny for the CPU dry check)")
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        init_distributed("gloo" if tiny else "nccl")
    init_model_parallel(parallel_config(), seed=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--num-micro", type=int, default=2)
    p.add_argument("--fp8", choices=["auto", "off", "on"], default="auto",
                   help="auto: run FP8 when Transformer Engine and an FP8-capable GPU are present")
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_PEAK_TFLOPS)
    p.add_argument("--tiny", action="store_true", help="CPU dry check with a tiny model")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_len, args.micro_batch, args.num_micro = min(args.seq_len, 32), 2, 2
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)

    from dpcc_megatron.megatron.precision import device_capability, te_version

    _init(args.tiny)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    te = te_version()
    cap = device_capability()
    import megatron.core

    report: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry check)",
        "compute_capability": ".".join(map(str, cap)) if cap else None,
        "torch": torch.__version__, "megatron_core": getattr(megatron.core, "__version__", "?"),
        "transformer_engine": te, "python": sys.version.split()[0],
        "seq_len": args.seq_len, "micro_batch": args.micro_batch, "num_micro": args.num_micro,
        "peak_tflops": args.peak_tflops, "modes": {},
    }
    print(f"gpu_check: {report['gpu']} cc={report['compute_capability']} torch {report['torch']} "
          f"megatron-core {report['megatron_core']} TE {te}", flush=True)
    use_te = te is not None and cap is not None
    modes = {"bf16": dict(params_dtype="bf16", transformer_engine=use_te)}
    fp8_kw = dict(params_dtype="bf16", transformer_engine=True, fp8="delayed", fp8_amax_history_len=16)
    fp8_ok = use_te and cap >= (8, 9)
    if args.fp8 == "on" or (args.fp8 == "auto" and fp8_ok):
        modes["fp8"] = fp8_kw
    elif args.fp8 == "auto":
        report["modes"]["fp8"] = {"skipped": "no Transformer Engine" if te is None else
                                  "no GPU with compute capability >= 8.9"}
    failed = False
    for name, kw in modes.items():
        try:
            if name == "fp8":
                report["te_fp8_smoke"] = te_fp8_smoke(kw)
            report["modes"][name] = run_mode(name, kw, args, device)
        except Exception as e:  # report and go on: one JSON line whatever happens
            failed = True
            traceback.print_exc()
            report["modes"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    bf16 = report["modes"].get("bf16", {})
    report["dpcc_vs_plain"] = bf16.get("dpcc_vs_plain")
    report["goal_met"] = bool(report["dpcc_vs_plain"] is not None and report["dpcc_vs_plain"] >= 0.9)
    print(json.dumps(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
