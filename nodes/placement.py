"""The memory planner (model/memory/) wired to the nodes: what each node asks before it moves a model, and what
it does with the answer. The bridge supplies the figures (ComfyUI's free memory and VRAM mode, or torch's) and
the loading; model/memory/streaming.py does the streaming.

    plan_sampling(...)       the samplers' plan, or a PlanError before any weight moves (replaces the old estimate)
    placed(model, plan)      loads the DiT under the plan (resident part through ComfyUI, streamed blocks pinned on
                             the host), sizes the kept-cache store, streams during the run, reports plan and peak
    text_encoder_on_device   the text encoder, whole or with its decoder layers streamed
    decode_tiled(vae, ...)   `tiled=auto`: one pass when it fits, tiles otherwise
"""

from contextlib import contextmanager

import torch

from ..model.latents import latent_shape
from ..model.memory.estimate import EncoderDims, VAEShape, encode_transient
from ..model.memory.planner import PLACEMENTS, RunShape, plan_decode, plan_layers, plan_run
from ..model.memory.streaming import LayerStreamer, StreamedRun
from ..model.memory.weights import dit_weights, layered_weights
from ..model.sampling.cache_store import DEFAULT_STORE
from . import bridge

PLAN_TOOLTIP = ("Where the DiT's weights live while it samples. auto picks the fastest plan that fits the free VRAM: "
                "all 32 blocks resident when they fit (fastest), else as many as fit with the rest streamed from "
                "pinned RAM one block ahead of use (each streamed block is copied over PCIe every step: slower, "
                "but 8-12 GB GPUs run the bf16 file), and the prefix cache in RAM if it does not fit beside them. "
                "resident forces the whole DiT onto the GPU (a run that does not fit is refused). stream streams "
                "every block (least VRAM: about 1.2 GB of weights on the GPU; slowest). The plan is in the "
                "sampler's report.")


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def run_shape(model, positive, negative, width: int, height: int, batch: int, prefix_cache: bool) -> RunShape:
    grid = latent_shape(width, height)
    conditionings = [positive] + ([negative] if negative is not None else [])
    return RunShape(tuple(c.layout(grid).prefix_len for c in conditionings), grid, batch, negative is not None,
                    prefix_cache, tuple(h * w for h, w in positive.ref_shapes))


def plan_sampling(model, positive, negative, width: int, height: int, batch: int, prefix_cache: bool):
    """The sampling plan for this run (`planner.Plan`); `planner.PlanError` (a MemoryError) with the numbers and
    what to change when nothing fits. Reads memory only: nothing is allocated or moved."""
    device = bridge.compute_device()
    budget = bridge.memory_budget(device, modules=[model], tensors=DEFAULT_STORE.payloads())
    placement = getattr(model, "placement", "auto")
    if placement not in PLACEMENTS:
        placement = "auto"
    run = run_shape(model, positive, negative, width, height, batch, prefix_cache)
    return plan_run(dit_weights(model), model.config, run, budget, _itemsize(model.compute_dtype), placement,
                    VAEShape.released(_itemsize(model.compute_dtype)))


class Placed:
    """A DiT placed under a plan for one run: `new_cache` for `sample`, and the report entries afterwards."""

    def __init__(self, plan, device: torch.device):
        self.plan, self.device = plan, device
        self.new_cache = None
        self.peak_bytes = None

    def report(self) -> dict:
        out = {"plan": self.plan.report()}
        if self.peak_bytes is not None:
            out["peak_bytes"] = int(self.peak_bytes)
        return out


@contextmanager
def placed(model, plan, on_unload=None):
    """Load `model` as `plan` says and run the body with its blocks streamed (if any) and its caches made as planned;
    on a GPU the device peak of the run is measured (`peak_bytes`) next to the plan's prediction."""
    if plan.cache == "host":  # the plan counted kept device caches as free room: release them
        DEFAULT_STORE.drop_where(lambda cache: cache.device is not None and cache.device.type != "cpu")
    DEFAULT_STORE.set_free(plan.store_budget)  # kept caches beside this run: from what is free, not a constant
    weights = dit_weights(model)
    beside = plan.sampling_peak - (weights.total - weights.streamed_bytes(plan.streamed))  # run + streaming slots
    device = bridge.load_managed(model, on_unload=on_unload, streamed=plan.streamed, memory_required=max(0, beside))
    result = Placed(plan, device)
    measure = device.type == "cuda"
    if measure:
        torch.cuda.reset_peak_memory_stats(device)
    with StreamedRun(model, plan.streamed, plan.cache, device) as streamed_run:
        result.new_cache = streamed_run.new_cache
        yield result
    if measure:
        result.peak_bytes = torch.cuda.max_memory_allocated(device)


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
    device = torch.device(text_encoder.preferred_device or bridge.compute_device())
    model = text_encoder.model
    layers = model.language_model.layers
    tokens, patches = encoder_shape(text_encoder, prompt, references)
    transient = encode_transient(EncoderDims.of(model), tokens, patches, _itemsize(text_encoder.dtype))
    budget = bridge.memory_budget(device, modules=[model])
    weights = layered_weights(model, layers, "text encoder")
    plan = plan_layers(weights, transient, budget)
    streamed = plan.streamed
    beside = plan.peak - (weights.total - weights.streamed_bytes(streamed))  # activations + streaming slots
    with bridge.on_device(model, device=device, offload_after=True, layers=layers, streamed=streamed,
                          memory_required=max(0, beside)) as where:
        with LayerStreamer(layers, streamed, where):
            yield where


# -- the VAE ---------------------------------------------------------------------------------------------------------
def decode_tiled(vae, latents: torch.Tensor) -> tuple[bool, int]:
    """(tiled?, activation bytes) of decoding `latents` `(B, 64, h, w)` at `tiled=auto`: one pass when it fits
    (equal to the reference exactly), tiled otherwise; `planner.PlanError` when even tiles do not fit."""
    device = bridge.compute_device()
    shape = VAEShape.of(vae)
    plan = plan_decode(shape, latents.shape[0], tuple(latents.shape[-2:]), bridge.memory_budget(device, modules=[vae]))
    return plan.tiled, max(0, plan.peak - shape.weight_bytes)
