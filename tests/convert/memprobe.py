"""Measure what hf-to-mcore and mcore-to-hf hold in memory (run as a script by test_memory.py).

    python -m tests.convert.memprobe WORKDIR

Builds a Llama whose layers are large next to the interpreter's own allocations, warms the
converters up on a tiny model (imports, one-time allocations), then converts both ways
while sampling this process's anonymous RSS. Prints one JSON line.
"""
from __future__ import annotations

import gc
import json
import sys
import threading
import time
from pathlib import Path


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


class _AnonSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = 0, True

    def run(self):
        while self.running:
            self.peak = max(self.peak, _status()["RssAnon"])
            time.sleep(0.001)


def measure(fn) -> dict:
    """Peak growth of anonymous RSS (sampled) and, where the kernel allows resetting it, of
    VmHWM (exact, but also counts file-backed pages) while ``fn`` runs."""
    gc.collect()
    exact = _reset_peak()
    base = _status()
    sampler = _AnonSampler()
    sampler.start()
    fn()
    sampler.running = False
    sampler.join()
    out = {"anon_growth": sampler.peak - base["RssAnon"]}
    if exact:
        out["hwm_growth"] = _status()["VmHWM"] - base["VmHWM"]
    return out


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpcc_megatron.convert.hf_to_mcore import hf_to_mcore
    from dpcc_megatron.convert.mcore_to_hf import mcore_to_hf
    from dpcc_megatron.convert.runtime import hide_cuda

    from .hf_models import build_hf

    hide_cuda()
    work = Path(sys.argv[1])
    quiet = dict(progress=False, log=lambda m: None)
    build_hf("qwen2", work / "tiny")
    hf_to_mcore(work / "tiny", work / "tiny_mc", **quiet)
    mcore_to_hf(work / "tiny_mc", work / "tiny_hf", **quiet)

    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(str(work / "big"))
    del model

    result = {"layer_bytes": layer_bytes, "model_bytes": model_bytes}
    result["hf_to_mcore"] = measure(lambda: hf_to_mcore(work / "big", work / "big_mc", **quiet))
    result["mcore_to_hf"] = measure(lambda: mcore_to_hf(work / "big_mc", work / "big_hf", **quiet))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
