"""A component on the device for one job: the one place that decides where the DiT, the text encoder and the VAE
go, moves them there, and reports it. It builds the planner's `Budget` from the plain figures the bridge reports
(ComfyUI's free memory and VRAM mode, or torch's), plans (model/memory/planner.py), sizes and owns the store of
kept prefix caches, loads (through ComfyUI's model management when it is there), streams (model/memory/streaming.py)
and measures.

    plan_sampling(...)       a sampler's `Sampling`: the plan, or a PlanError before any weight moves
    Sampling.placed()        the DiT loaded under the plan for the run; `new_cache` and `store` go to `sample`
    text_encoder_on_device   the text encoder, whole or with its decoder layers streamed
    on_device(vae)           the VAE (or any module) for one encode or decode, on its loader's device
    decode_tiled(vae, ...)   `tiled=auto`: one pass when it fits, tiles otherwise
"""

from contextlib import contextmanager

import torch

from ..model.layers.lora import release_branches
from ..model.loaders.deferred import FileBackedPart, file_weights
from ..model.memory.estimate import EncoderDims, VAEShape, encode_transient
from ..model.memory.host import keeps_in_ram
from ..model.memory.planner import PLAN_CHOICES, Budget, RunShape, plan_decode, plan_layers, plan_run
from ..model.memory.streaming import LayerStreamer, StreamedRun, place_layers, resident_part
from ..model.memory.weights import dit_weights, layered_weights, module_tensors, run_layers, tensor_bytes
from ..model.options import options_of
from ..model.prefix_cache.kept_entries import PrefixCacheStore, cache_owner
from ..model.transformer.controlnet import STREAM_ROW_BUFFERS
from ..model.vae.latents import latent_shape
from . import bridge

PLAN_TOOLTIP = ("Where the DiT's weights live while it samples. auto picks the fastest plan that fits the free VRAM: "
                "all 32 blocks resident when they fit (fastest), else as many as fit with the rest streamed from "
                "pinned RAM one block ahead of use (each streamed block is copied over PCIe every step: slower, "
                "but 8-12 GB GPUs run the bf16 file), and the prefix cache in RAM if it does not fit beside them. "
                "resident forces the whole DiT onto the GPU (a run that does not fit is refused). stream streams "
                "every block (least VRAM: about 1.2 GB of weights on the GPU; slowest). The plan is in the "
                "sampler's report.")

#: The prefix caches kept between runs (`keep_cache`), bounded by what the plan leaves free beside each run and by
#: the user's ceiling (ComfyUI setting `bridge.KEPT_CACHE_BUDGET_SETTING`; none by default), re-read before each run.
KEPT_CACHES = PrefixCacheStore(budget_bytes=None)


def memory_budget(device, modules=(), tensors=()) -> Budget:
    """The planner's view of `device` (see `bridge.memory_figures` for what is counted)."""
    return Budget(**bridge.memory_figures(device, modules=modules, tensors=tensors))


def place(module: torch.nn.Module, layers=(), streamed=(), on_unload=None, memory_required: int = 0,
          what: str = "DiT", device: torch.device | None = None) -> torch.device:
    """`module` on `device` (default: the compute device) with `layers[i]`, i in `streamed`, left in (pinned) host
    memory for the streamer: through ComfyUI's model management when it takes it, by hand otherwise."""
    streamed = tuple(streamed)
    wanted = device
    weights = file_weights(module)
    if weights is not None and weights.waiting:
        read_from_file(module, weights, layers, streamed, memory_required, wanted)
        kept = getattr(getattr(module, "manager", None), "model", None)
        if isinstance(kept, FileBackedPart):  # ComfyUI's patcher: already there, so it counts nothing more to load
            kept.device = kept.placed_device()

    def resident():
        part = resident_part(module, layers, streamed)
        if weights is None:
            return part
        part = FileBackedPart(part, weights, keep=host_has_room)  # evicted: to RAM if it has room, else its file
        part.device = part.placed_device()  # read there already: ComfyUI frees room only for what still moves
        return part

    device = bridge.load_managed(module, resident, streamed, on_unload, memory_required=memory_required, what=what,
                                 device=wanted)
    if device is None:
        device = torch.device(wanted) if wanted is not None else bridge.compute_device()
        if device.type != "cpu":
            bridge.free_memory(tensor_bytes(module_tensors(module)) + memory_required, device)
    place_layers(module, layers, streamed, device)
    return device


def host_has_room(nbytes: int) -> bool:
    """An evicted or offloaded file-backed model stays in RAM (fast to bring back) only with room to spare."""
    return keeps_in_ram(nbytes, bridge.memory_limit(torch.device("cpu")))


def read_from_file(module, weights, layers, streamed, memory_required: int, device=None) -> None:
    """A deferred model's waiting weights read from its file straight to where the plan places them: the streamed
    layers' into (pinned) host memory, the rest onto the device, after ComfyUI made room there for them and the run
    (loaders/deferred.py). Nothing passes through a whole copy in host memory."""
    device = torch.device(device) if device is not None else bridge.compute_device()
    on_host = {id(p) for i in streamed for p in layers[i].parameters()}
    if device.type != "cpu":
        bridge.free_memory(weights.waiting - sum(p.numel() * p.element_size() for p in module.parameters()
                                                 if id(p) in on_host) + memory_required, device)
    weights.materialize(lambda param: "cpu" if id(param) in on_host else device, pin=device.type == "cuda")


def component_device(module) -> torch.device:
    """Where a component runs: its loader's `device` (`preferred_device`: cpu or a GPU), else the compute device."""
    preferred = getattr(module, "preferred_device", None)
    return torch.device(preferred) if preferred is not None else bridge.compute_device()


@contextmanager
def on_device(module: torch.nn.Module, device: torch.device | None = None, offload_after: bool = False, *,
              layers=(), streamed=(), memory_required: int = 0):
    """Run `module` on `device` (default: `component_device(module)`: the VAE loader's `device`, else the compute
    device) for one job, `memory_required` bytes of activations beside it. On a GPU ComfyUI manages it (on another
    GPU than its own too, as ComfyUI-MultiGPU does): it stays there until ComfyUI needs the room on that GPU or
    unloads models. With `offload_after` it goes back to the offload device when done unless ComfyUI manages it
    (the text encoder: 16 GiB nobody needs during sampling; ComfyUI evicts it as soon as the DiT needs the room, as
    it does with its own text encoders)."""
    device = torch.device(device) if device is not None else component_device(module)
    managed = bridge.HAVE_COMFY and device.type != "cpu"
    if managed:
        device = place(module, layers, streamed, memory_required=memory_required, what=type(module).__name__,
                       device=device)
    else:
        weights = file_weights(module)
        if weights is not None and weights.waiting:  # read from its file straight to where it runs
            read_from_file(module, weights, layers, streamed, memory_required, device)
        elif device.type != "cpu":
            bridge.free_memory(tensor_bytes(module_tensors(module)) + memory_required, device)
        place_layers(module, layers, streamed, device)
    try:
        yield device
    finally:
        if offload_after and not managed and device != bridge.offload_device():
            weights = file_weights(module)
            if weights is not None and not host_has_room(tensor_bytes(module_tensors(module))):
                weights.release()  # back to its file, not into host memory: the next encoding reads it again
            module.to(bridge.offload_device())
            bridge.empty_cache()


# -- the DiT ---------------------------------------------------------------------------------------------------------
def run_shape(model, positive, negative, width: int, height: int, batch: int, prefix_cache: bool) -> RunShape:
    grid = latent_shape(width, height)
    conditionings = [positive] + ([negative] if negative is not None else [])
    record, layers = options_of(model), model.config.num_layers
    control = record.control  # a ControlPatch, or None
    cache_layers = None
    if control is not None:  # its blocks' K/V, and a partial window's plain cache beside (prefix_cache/lifecycle.py)
        cache_layers = layers + control.extra_layers + (0 if control.whole_schedule else layers)
    steps = record.step_cache  # None: no step cache
    return RunShape(tuple(c.layout(grid).prefix_len for c in conditionings), grid, batch, negative is not None,
                    prefix_cache, tuple(h * w for h, w in positive.ref_shapes), cache_layers=cache_layers,
                    extra_row_buffers=0 if control is None else STREAM_ROW_BUFFERS,
                    cache_dtype=record.cache.dtype, step_cache=steps.mode if steps else "off")


def dit_unloaded(model) -> None:
    """ComfyUI unloaded the DiT: its kept prefix caches and its LoRA branches' device copies go with it."""
    KEPT_CACHES.evict_model(id(model))
    KEPT_CACHES.evict_model(id(cache_owner(model)))  # a Fun ControlNet copy's caches are keyed by its base model
    release_branches(model)


def plan_sampling(model, positive, negative, width: int, height: int, batch: int, prefix_cache: bool) -> "Sampling":
    """The sampling plan for this run; `planner.PlanError` (a MemoryError) with the numbers and what to change when
    nothing fits. Reads memory only: nothing is allocated or moved."""
    device = bridge.compute_device()
    budget = memory_budget(device, modules=[model], tensors=KEPT_CACHES.payloads())
    choice = options_of(model).plan
    if choice not in PLAN_CHOICES:
        choice = "auto"
    weights = dit_weights(model)
    itemsize = model.compute_dtype.itemsize
    run = run_shape(model, positive, negative, width, height, batch, prefix_cache)
    plan = plan_run(weights, model.config, run, budget, itemsize, choice, VAEShape.released(itemsize),
                    cache_choice=options_of(model).cache.device)
    return Sampling(model, plan, weights)


class Sampling:
    """One sampler run's placement: the plan (made before anything is allocated) and, inside `placed()`, what
    `sample` takes from it (`new_cache`: the planned kind of prefix cache; `store`: where kept caches live)."""

    def __init__(self, model, plan, weights):
        self.model, self.plan, self.weights = model, plan, weights
        self.store = KEPT_CACHES
        self.new_cache = None
        self.peak_bytes = None
        self.evictions_before = self.store.evictions  # evictions from here on were made for this run

    @contextmanager
    def placed(self):
        """Load the DiT as planned and run the body with its blocks streamed (if any) and its caches made as
        planned; on a GPU the device peak of the run is measured (`peak_bytes`) next to the plan's prediction."""
        plan = self.plan
        if plan.cache == "host":  # the plan counted kept device caches as free room: release them
            self.store.drop_where(lambda cache: cache.device is not None and cache.device.type != "cpu")
        if bridge.settings_path() is not None:  # the user's ceiling (settings panel); without settings, as set
            self.store.set_budget(bridge.kept_cache_budget_bytes())
        self.store.set_free(plan.store_budget)  # kept caches beside this run: from what is free, not a constant
        resident = self.weights.total - self.weights.streamed_bytes(plan.streamed)
        beside = plan.sampling_peak - resident  # the run's activations, cache and streaming slots
        device = place(self.model, run_layers(self.model), plan.streamed, on_unload=dit_unloaded,
                       memory_required=max(0, beside))
        measure = device.type == "cuda"
        if measure:
            torch.cuda.reset_peak_memory_stats(device)
        with StreamedRun(self.model, plan.streamed, plan.cache, device) as streamed_run:
            self.new_cache = streamed_run.new_cache
            yield self
        if measure:
            self.peak_bytes = torch.cuda.max_memory_allocated(device)

    def report(self) -> dict:
        out = {"plan": self.plan.report()}
        if self.peak_bytes is not None:
            out["peak_bytes"] = int(self.peak_bytes)
        return out

    def store_report(self, keep_cache: bool) -> tuple[dict, list[str]]:
        """(report keys, notes) about the kept store after the run: with `keep_cache`, `kept_bytes` /
        `kept_limit_bytes`; whenever kept caches were evicted to make room during this run, `kept_evictions` and a
        note saying so."""
        store, out, notes = self.store, {}, []
        evicted = store.evictions - self.evictions_before
        if keep_cache:
            out.update(kept_bytes=store.kept_bytes(), kept_limit_bytes=store.limit_bytes)
        if evicted:
            out["kept_evictions"] = evicted
            ceiling = "your ceiling" if store.budget_bytes is not None and store.limit_bytes == store.budget_bytes \
                else "what the memory plan leaves free"
            notes.append(f"{evicted} kept prefix cache{'s' if evicted > 1 else ''} evicted (least recently used) "
                         f"to make room: the kept store is bounded by {ceiling}, {store.limit_bytes / 2**20:,.0f} MiB "
                         f"(setting {bridge.KEPT_CACHE_BUDGET_SETTING})")
        return out, notes


# -- the text encoder ------------------------------------------------------------------------------------------------
def encoder_shape(text_encoder, prompt: str, references) -> tuple[int, int]:
    """(tokens, vision patches) of one encoding: the prompt with its template and one slot per 32x32 px of each
    reference; 16x16-px patches for the vision tower."""
    prepared = [r.prepared for r in references or ()]
    tokens = len(text_encoder.tokenizer(prompt or " ")["input_ids"]) + 64
    tokens += sum(p.vlm_tokens for p in prepared)
    patches = sum(p.width * p.height // 256 for p in prepared)
    return tokens, patches


@contextmanager
def text_encoder_on_device(text_encoder, prompt: str, references=()):
    """The text encoder on its device for one encoding: whole when it fits beside the encoding's activations, else
    its decoder layers streamed (planner.plan_layers); offloaded afterwards (under ComfyUI: evicted as soon as the
    DiT needs the room)."""
    device = component_device(text_encoder)
    model = text_encoder.model
    layers = model.language_model.layers
    tokens, patches = encoder_shape(text_encoder, prompt, references)
    transient = encode_transient(EncoderDims.of(model), tokens, patches, text_encoder.dtype.itemsize)
    budget = memory_budget(device, modules=[model])
    weights = layered_weights(model, layers, "text encoder")
    plan = plan_layers(weights, transient, budget)
    streamed = plan.streamed
    beside = plan.peak - (weights.total - weights.streamed_bytes(streamed))  # activations + streaming slots
    with on_device(model, device=device, offload_after=True, layers=layers, streamed=streamed,
                   memory_required=max(0, beside)) as where:
        with LayerStreamer(layers, streamed, where):
            yield where


# -- the VAE ---------------------------------------------------------------------------------------------------------
def decode_tiled(vae, latents: torch.Tensor) -> tuple[bool, int]:
    """(tiled?, activation bytes) of decoding `latents` `(B, 64, h, w)` at `tiled=auto`: one pass when it fits
    (equal to the reference exactly), tiled otherwise; `planner.PlanError` when even tiles do not fit."""
    device = component_device(vae)
    shape = VAEShape.of(vae)
    plan = plan_decode(shape, latents.shape[0], tuple(latents.shape[-2:]), memory_budget(device, modules=[vae]))
    return plan.tiled, max(0, plan.peak - shape.weight_bytes)
