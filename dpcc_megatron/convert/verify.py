"""Run the HF model and the converted Megatron model on one token batch and compare logits.

The Megatron side runs on ``tp * pp`` ranks started with ``torch.distributed.run`` (one
process per rank, gloo plus the CPU execution layer when there is no GPU), through the
same forward-only pipeline schedule training uses. The HF side runs in this process in
fp32, after the ranks have exited so the two models are never in memory together.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from .errors import ConversionError
from .hf_config import check_layout, model_config_from_hf
from .compat import architecture_of
from .mcore_format import read_model_config, resolve_checkpoint_dir

DEFAULT_ATOL = {"fp32": 1e-3, "bf16": 0.5, "fp16": 0.25}


def mcore_logits(ckpt_dir: str | Path, tokens: torch.Tensor, tp: int, pp: int, params_dtype: str = "fp32",
                 transformer_engine: bool = False, ep: int = 1, etp: Optional[int] = None) -> Optional[torch.Tensor]:
    """Collective, on an initialised torch.distributed job with no model parallel state yet.

    Builds the model at TP/PP (and expert parallel EP, expert TP ``etp``), loads ``ckpt_dir``, runs one forward-only pipeline pass over
    ``tokens`` [batch, seq] and returns fp32 logits [batch, seq, vocab] (padding columns
    dropped) on the rank that holds the last stage at TP rank 0 and DP rank 0; None elsewhere.
    Tears the parallel state down again, so it can be called repeatedly."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from ..config import ParallelConfig, PrecisionConfig
    from ..megatron.model import build_gpt_model
    from ..megatron.parallel import destroy_model_parallel, init_model_parallel
    from .mcore_load import load_mcore_checkpoint

    cfg = read_model_config(ckpt_dir)
    check_layout(cfg, tp, pp, ep)
    # Megatron's MoE layers at TP > 1 run with sequence parallelism (as training must).
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              use_distributed_optimizer=False, expert_model_parallel_size=ep,
                              expert_tensor_parallel_size=etp,
                              sequence_parallel=tp > 1 and cfg.num_moe_experts is not None)
    init_model_parallel(parallel, seed=0)
    try:
        model = build_gpt_model(cfg, parallel, PrecisionConfig(params_dtype=params_dtype,
                                                               transformer_engine=transformer_engine))
        load_mcore_checkpoint([model], ckpt_dir, cfg)
        model.eval()
        device = next(model.parameters()).device
        tokens = tokens.to(device)
        captured = []

        def forward_step(data_iterator, m):
            x = next(data_iterator)
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand_as(x)
            out = m(x, pos, attention_mask=None)

            def loss_func(output):
                captured.append(output.detach())
                return output.sum() * 0.0, {}

            return out, loss_func

        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model], num_microbatches=1,
                seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True)
            logits = None
            if ps.is_pipeline_last_stage():
                full = gather_from_tensor_model_parallel_region(captured[0])
                if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                    logits = full[..., : cfg.vocab_size].float().cpu()
        return logits
    finally:
        destroy_model_parallel()


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    import transformers
    from transformers import AutoModelForCausalLM

    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager",
                                                 **{dtype_kw: dtype}).to(device).eval()
    with torch.no_grad():
        return model(tokens.to(device)).logits.float().cpu()


def compare(ref: torch.Tensor, got: torch.Tensor, tokens: torch.Tensor) -> dict:
    """Logit and log-prob differences over the whole vocabulary, and at the next tokens."""
    if ref.shape != got.shape:
        raise ConversionError(f"logit shapes differ: HF {tuple(ref.shape)}, Megatron {tuple(got.shape)}")
    ref, got = ref.double(), got.double()
    d = (ref - got).abs()
    lp_ref, lp_got = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    dlp = (lp_ref - lp_got).abs()
    nxt = tokens[:, 1:].unsqueeze(-1)
    dtok = (lp_ref[:, :-1].gather(-1, nxt) - lp_got[:, :-1].gather(-1, nxt)).abs()
    return {"max_abs_logit_diff": float(d.max()), "mean_abs_logit_diff": float(d.mean()),
            "max_abs_logprob_diff": float(dlp.max()), "mean_abs_logprob_diff": float(dlp.mean()),
            "max_abs_token_logprob_diff": float(dtok.max()) if dtok.numel() else 0.0,
            "argmax_agreement": float((ref.argmax(-1) == got.argmax(-1)).double().mean())}


def world_size(tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> int:
    """The fewest ranks that hold TP x PP and, carved from TP x DP, the expert grid ETP x EP."""
    import math

    expert = ep * (etp or tp)
    return tp * pp * (expert // math.gcd(tp, expert))


def _run_ranks(mcore: Path, tokens_file: Path, out_file: Path, tp: int, pp: int, params_dtype: str,
               transformer_engine: bool, timeout: float, ep: int = 1, etp: Optional[int] = None) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={world_size(tp, pp, ep, etp)}", "-m", "dpcc_megatron.convert.verify_worker",
           "--mcore", str(mcore), "--tokens", str(tokens_file), "--out", str(out_file),
           "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--params-dtype", params_dtype]
    if etp is not None:
        cmd += ["--etp", str(etp)]
    if transformer_engine:
        cmd.append("--transformer-engine")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise ConversionError(f"the Megatron ranks did not finish within {timeout:.0f} s") from None
    if rc != 0:
        raise ConversionError(f"the Megatron ranks failed (exit code {rc}); their output is above")
    if not out_file.is_file():
        raise ConversionError("the Megatron ranks exited without writing logits")


def verify(hf_dir: str | Path, mcore_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
           etp: Optional[int] = None, batch: int = 2,
           seq_len: int = 32, seed: int = 0, atol: Optional[float] = None, params_dtype: Optional[str] = None,
           transformer_engine: bool = False, hf_device: str = "cpu", timeout: float = 3600.0,
           log: Callable[[str], None] = print, memory_only: bool = False) -> dict:
    """Compare both models; returns the report (``report["ok"]`` says whether it is within ``atol``).

    Both models run in ``params_dtype``, by default the dtype the Megatron checkpoint stores (the
    model's own), and the memory that needs is logged before anything loads. ``memory_only``:
    return the memory estimate (:func:`.verify_memory.memory_need`) without running anything."""
    from .hf_files import HFCheckpoint
    from .mcore_format import DTYPES, output_dtype
    from .nemo_format import PREFIX, is_nemo2_dir, read_nemo_checkpoint
    from .verify_memory import describe_need, memory_need

    if is_nemo2_dir(mcore_dir):  # a NeMo 2 checkpoint: its weights/ behind NeMo's module. prefix
        mcore = Path(mcore_dir)
        cfg, weights = read_nemo_checkpoint(mcore)
        prefix = PREFIX
    else:
        mcore = weights = resolve_checkpoint_dir(mcore_dir)
        cfg, prefix = read_model_config(mcore), ""
    if params_dtype is None:
        params_dtype = output_dtype(weights, None, prefix)[0]
    elif params_dtype not in DTYPES:
        raise ConversionError(f"--params-dtype must be one of {', '.join(DTYPES)}, got {params_dtype!r}")
    hf_cfg, _ = model_config_from_hf(HFCheckpoint(hf_dir).config)
    want, have = architecture_of(cfg), architecture_of(hf_cfg)
    diffs = [f"{k}: Megatron {want[k]!r}, HF {have[k]!r}" for k in want if want[k] != have[k]]
    if diffs:
        raise ConversionError("the two checkpoints are different architectures:\n  " + "\n  ".join(diffs))
    check_layout(cfg, tp, pp, ep)
    if etp is not None and (etp < 1 or (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size or 0) % etp):
        raise ConversionError(f"--etp {etp} must be >= 1 and divide moe_ffn_hidden_size={cfg.moe_ffn_hidden_size}")
    if batch < 1 or seq_len < 2:
        raise ConversionError(f"--batch must be >= 1 and --seq-len >= 2, got {batch} and {seq_len}")
    atol = DEFAULT_ATOL[params_dtype] if atol is None else atol
    need = memory_need(cfg, params_dtype, tp, pp, batch, seq_len, ranks=world_size(tp, pp, ep, etp))
    log(describe_need(need))
    if memory_only:
        return need
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    with tempfile.TemporaryDirectory(prefix="dpcc-verify-") as tmp:
        tokens_file, out_file = Path(tmp) / "tokens.pt", Path(tmp) / "logits.pt"
        torch.save(tokens, tokens_file)
        log(f"running the Megatron model on {world_size(tp, pp, ep, etp)} rank(s) (TP={tp}, PP={pp}, EP={ep}) ...")
        _run_ranks(mcore, tokens_file, out_file, tp, pp, params_dtype, transformer_engine, timeout, ep, etp)
        got = torch.load(out_file, weights_only=True)
    log("running the HF model ...")
    ref = hf_logits(hf_dir, tokens, hf_device, DTYPES[params_dtype])
    report = compare(ref, got, tokens)
    report.update(tp=tp, pp=pp, ep=ep, batch=batch, seq_len=seq_len, params_dtype=params_dtype, atol=atol,
                  memory_estimate_gib=round(need["bytes"] / float(1 << 30), 2))
    report["ok"] = report["max_abs_logit_diff"] <= atol and report["max_abs_logprob_diff"] <= atol
    return report


def format_report(report: dict) -> str:
    lines = [f"max |logit diff|        {report['max_abs_logit_diff']:.3e}",
             f"mean |logit diff|       {report['mean_abs_logit_diff']:.3e}",
             f"max |log-prob diff|     {report['max_abs_logprob_diff']:.3e}",
             f"mean |log-prob diff|    {report['mean_abs_logprob_diff']:.3e}",
             f"max |next-token lp diff| {report['max_abs_token_logprob_diff']:.3e}",
             f"argmax agreement        {report['argmax_agreement']:.4f}",
             f"{'PASS' if report['ok'] else 'FAIL'} (tolerance {report['atol']:g})",
             json.dumps(report, sort_keys=True)]
    return "\n".join(lines)
