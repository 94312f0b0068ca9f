"""One rank's process: joins the process group, then runs the coordinator's jobs until told to stop.

Every rank runs the same job on the same inputs (ranks act alike): the coordinator (pool.py) puts one job on each
rank's queue and waits for all answers. A job is a function of this module's `Rank` state, picklable by reference:
`load_model` builds the model chain once and keeps it across prompts, `run_sample` runs the whole sampling loop
(model/sampling/loop.py) with the model split by `Ulysses` (the rank's heads of the prefix cache in the rank's own
store: kept caches behave as in one process, on each rank's shard) or by `CfgParallel` (the rank's prompt).

Messages to the coordinator on the shared results queue: `("ready", rank, info)`, `("progress", job_id, rank,
step, total)` after every step, `(job_id, rank, status, value)` with status "ok", "interrupted" or "error".
"""

import gc
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ..prefix_cache.kept_entries import PrefixCacheStore
from ..sampling.loop import sample
from .cfg import CfgParallel
from .ulysses import Ulysses

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a rank waiting longer on its peers gives up (the pool notices sooner)


class Interrupted(Exception):
    """Every rank saw the coordinator's interrupt at the same step boundary (agreed by an all-reduce)."""


def by_value(tensor: torch.Tensor) -> tuple:
    """`(dtype name, shape, bytes)` of a CPU tensor: a tensor sent over a torch queue is shared memory that its sender
    must outlive, and a result must survive its worker (a rank may be ended right after it answered)."""
    tensor = tensor.detach().cpu().contiguous()
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.view(torch.uint8).numpy().tobytes()


def from_value(value: tuple) -> torch.Tensor:
    dtype, shape, data = value
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


class Rank:
    """What a worker keeps between jobs: its place in the group, its device, the model chain and its kept caches."""

    def __init__(self, rank: int, world: int, device: torch.device, interrupt, results):
        self.rank, self.world, self.device = rank, world, device
        self.interrupt, self.results = interrupt, results
        self.model, self.model_key = None, None
        self.job = None  # the job being run (progress messages carry it: an interrupted job's late ones are dropped)
        self.store = PrefixCacheStore()

    def step_done(self, step: int, total: int) -> None:
        """After every step: report progress, then agree with the other ranks whether to stop (an interrupt seen
        by one rank must stop all of them at the same step, or the others would wait forever in the next
        all-to-all)."""
        self.results.put(("progress", self.job, self.rank, step + 1, total))
        stop = self.interrupt.is_set()
        if self.world > 1:
            flag = torch.tensor([1 if stop else 0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            raise Interrupted(f"interrupted after step {step + 1} of {total}")


def load_model(state: Rank, key, build, args: tuple, mode: str = "ulysses") -> dict:
    """Make `build(device, *args)` (a `QwenImage21DiT` on this rank's device) this rank's model, split by `mode`
    ("ulysses" or "cfg"), unless the chain `key` is already loaded. The old chain and its kept caches go first: two 7B
    models on one device do not fit."""
    if state.model_key == key and state.model is not None:
        return {"loaded": False}
    state.store.clear()
    state.model = state.model_key = None
    gc.collect()
    model = build(state.device, *args).to(state.device).eval()
    if state.world > 1:  # one rank: the whole model on its device, nothing to split
        model.parallel = CfgParallel() if mode == "cfg" else Ulysses(model.config.num_heads)
    state.model, state.model_key = model, key
    return {"loaded": True}


def run_sample(state: Rank, options: dict) -> dict:
    """`sample(model, **options)` on this rank; rank 0 answers the latents (by value), every rank its report."""
    if state.model is None:
        raise RuntimeError("no model is loaded in this worker; the coordinator sends load_model first.")
    store = state.store if options.get("keep_cache") else None
    if isinstance(state.model.parallel, CfgParallel):
        options = _own_prompt(state.model.parallel, state.rank, dict(options))
    with torch.no_grad():
        split = state.model.parallel
        result = sample(state.model, **options, store=store, new_cache=None if split is None else split.new_cache,
                        callback=lambda info: state.step_done(info.step, info.total))
    return {"latents": by_value(result.latents.cpu()) if state.rank == 0 else None, "report": result.report}


def _own_prompt(split: CfgParallel, rank: int, options: dict) -> dict:
    """CFG-parallel: rank 0 samples the positive prompt, rank 1 the negative, each as a run without guidance; the
    model's `gather` applies the run's cfg to their two velocities (without true CFG both run the positive)."""
    negative, cfg = options.pop("negative", None), float(options.pop("cfg", 1.0))
    if not cfg >= 1.0:
        raise ValueError(f"cfg must be >= 1 (1 disables guidance); got {cfg}.")
    guided = negative is not None and cfg > 1.0
    split.scale = cfg if guided else None
    split.edit = bool(options["positive"].ref_shapes)  # before rank 1 takes the negative: one threshold for both
    if guided and rank == 1:
        options["positive"] = negative
    return options


def clear_caches(state: Rank) -> dict:
    state.store.clear()
    return {}


def _check_allocator(device: torch.device) -> None:
    """Refuse a CUDA worker whose caching allocator is cudaMallocAsync: NCCL's all-to-all fails with it (raylight
    #99). The backend is fixed when torch loads, from the environment the process inherited, so a worker cannot
    switch it through torch's API; the message says how to start ComfyUI so that workers get the native one."""
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        raise RuntimeError(
            f"the worker on {device} runs CUDA's {backend} allocator, which NCCL collectives do not support; start "
            "ComfyUI with --disable-cuda-malloc (or PYTORCH_CUDA_ALLOC_CONF without backend:cudaMallocAsync) to "
            "split a model over several GPUs.")


def serve(rank: int, world: int, device: str, store_path: str, jobs, results, interrupt, threads: int) -> None:
    """The worker's life: join the group (gloo on CPUs and for a lone rank, NCCL on several GPUs; rendezvous through
    a file), answer jobs until a None arrives, leave the group."""
    try:
        torch.set_num_threads(max(1, int(threads)))
        where = torch.device(device)
        split = world > 1  # one rank (the DiT alone on its device) runs no collective: no NCCL, any allocator
        if where.type == "cuda":
            torch.cuda.set_device(where)
            if split:
                _check_allocator(where)
        backend = "nccl" if where.type == "cuda" and split else "gloo"
        dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
    except BaseException as error:  # the coordinator's start-up wait names the device with this message
        results.put(("failed", rank, f"{type(error).__name__}: {error}"))
        return
    state = Rank(rank, world, where, interrupt, results)
    results.put(("ready", rank, backend))
    try:
        while True:
            message = jobs.get()
            if message is None:
                break
            job_id, function, args = message
            state.job = job_id
            try:
                results.put((job_id, rank, "ok", function(state, *args)))
            except Interrupted as stop:
                results.put((job_id, rank, "interrupted", str(stop)))
            except BaseException as error:  # reported, not fatal: the coordinator decides whether the pool lives
                detail = "".join(traceback.format_exception_only(type(error), error)).strip()
                results.put((job_id, rank, "error", detail))
    finally:
        state.store.clear()
        dist.destroy_process_group()
