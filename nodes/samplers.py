"""The Base and Turbo samplers: they own the DiT call and the prefix cache's whole lifetime (model/sampling.py)."""

import json

from ..model.cache_store import DEFAULT_STORE
from ..model.latent_format import preview_image, to_raw
from ..model.pipeline import target_size
from ..model.sampling import initial_noise, sample
from ..model.schedule import base_sigmas, sampling_size, turbo_sigmas
from . import bridge
from .bridge import io
from .types import CATEGORY, Conditioning, Model
from .validation import widget_problem

MIN_SIZE, MAX_SIZE = 256, 4096
MAX_SEED = 0xFFFFFFFFFFFFFFFF

SIZE_TOOLTIP = ("0 follows the last reference's size (the reference pipeline's default), or 1024 without references. "
                "Other values are floored to a multiple of 32, as the reference pipeline does.")
PREFIX_CACHE_TOOLTIP = ("on: the first step computes the prompt and references once and caches their keys/values "
                        "(0.5 MiB per prefix token in bf16); later steps run only the image. Exact, and faster the more "
                        "references you use. off recomputes the prefix every step: slower, the way to rule the cache out.")
KEEP_CACHE_TOOLTIP = ("Keep the prefix cache after the run (bounded store, least-recently-used eviction) so the next "
                      "run with the same model, prompt and references (another seed, size or batch) skips the first "
                      "step's prefill. Costs the cache's memory between runs; off frees it at the end.")


def _size_inputs():
    return [
        io.Int.Input("width", default=0, min=0, max=MAX_SIZE, step=32, tooltip=SIZE_TOOLTIP),
        io.Int.Input("height", default=0, min=0, max=MAX_SIZE, step=32, tooltip=SIZE_TOOLTIP),
        io.Int.Input("batch_size", default=1, min=1, max=64,
                     tooltip="Images per run, one seed each (seed, seed's next noise rows). They share one prefix "
                             "cache, so a batch costs no extra cache memory."),
    ]


def _cache_inputs():
    return [
        io.Combo.Input("prefix_cache", options=["on", "off"], default="on", optional=True, tooltip=PREFIX_CACHE_TOOLTIP),
        io.Boolean.Input("keep_cache", default=False, optional=True, tooltip=KEEP_CACHE_TOOLTIP),
    ]


def _check_size(node, width, height, **widgets) -> str | bool:
    for name, value in (("width", width), ("height", height)):
        if value and not MIN_SIZE <= value <= MAX_SIZE:
            return f"{name} = {value}: use 0 (follow the reference / 1024) or a size from {MIN_SIZE} to {MAX_SIZE}."
    return widget_problem(node, **widgets)


def _require(verdict: str | bool) -> None:
    """Raise `validate_inputs`' message. ComfyUI validates only the values it knows before the run: a size or a
    step count that arrives through a link (or from a script calling `execute`) reaches `execute` unchecked, so
    it checks again there, before the model moves or any noise is drawn."""
    if verdict is not True:
        raise ValueError(verdict)


def run(model, positive, *, sampler: str, seed, width, height, batch_size, sigmas_for, negative=None, cfg=1.0,
        prefix_cache="on", keep_cache=False) -> io.NodeOutput:
    """What both samplers do: size, schedule, sampling with progress/interrupt/previews, report, LATENT."""
    notes = []
    wanted = target_size(width, height, positive)
    width, height = sampling_size(*wanted)
    if (width, height) != tuple(wanted):
        notes.append(f"size {wanted[0]}x{wanted[1]} floored to {width}x{height} (multiples of 32)")
    variant = getattr(getattr(model, "source", None), "variant", "unknown")
    expected = "turbo" if sampler == "turbo" else "base"
    if variant not in (expected, "unknown"):
        notes.append(f"a {variant} model in the {sampler} sampler: use the Qwen-Image 2.1 "
                     f"{'Turbo ' if variant == 'turbo' else ''}Sampler for it (its schedule is what it was trained for)")
    for note in notes:
        bridge.log.warning("qi21 %s sampler: %s", sampler, note)

    sigmas = sigmas_for(width, height)
    progress = bridge.Progress(len(sigmas) - 1)
    show_previews = bridge.previews_enabled()

    def on_step(info):
        bridge.throw_if_interrupted()
        progress.update(info.step + 1, preview_image(info.denoised) if show_previews else None)

    noise = initial_noise(seed, batch_size, height, width)
    bridge.load_managed(model, on_unload=lambda m: DEFAULT_STORE.evict_model(id(m)))
    result = sample(model, positive, sigmas=sigmas, width=width, height=height, noise=noise, negative=negative,
                    cfg=cfg, prefix_cache=prefix_cache == "on", keep_cache=keep_cache, callback=on_step)
    report = dict(result.report)
    if notes:
        report["notes"] = notes + report.get("notes", [])
    bridge.log.info("qi21_report %s", json.dumps(report))
    latents = to_raw(result.latents.float()).cpu()
    return io.NodeOutput({"samples": latents}, ui={"qi21_report": [report]})


class QI21Sampler(io.ComfyNode):
    """Base sampler: the official resolution-dependent flow-matching schedule, optional true CFG."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21Sampler",
            display_name="Qwen-Image 2.1 Sampler",
            category=CATEGORY,
            description="Samples Qwen-Image 2.1 Base with the official schedule (dynamic shift from the image size, "
                        "last sigma 0.02), the prompt/reference prefix cached after the first step. Returns raw VAE "
                        "latents and shows a report (tokens, cache size, hit/miss, timings) on the node.",
            inputs=[
                Model.Input("model"),
                Conditioning.Input("positive"),
                io.Int.Input("seed", default=0, min=0, max=MAX_SEED, control_after_generate=True,
                             tooltip="Noise seed (CPU generator, the same noise as diffusers for this seed)."),
                io.Int.Input("steps", default=40, min=1, max=200,
                             tooltip="40 is the official setting; fewer steps trade detail for time."),
                io.Float.Input("cfg", default=1.0, min=1.0, max=20.0, step=0.1,
                               tooltip="True CFG scale. 1 (official default) runs one pass per step. Above 1 with a "
                                       "negative prompt, both prompts run in one batched pass (about 2x the work)."),
                *_size_inputs(),
                Conditioning.Input("negative", optional=True,
                                   tooltip="Negative prompt for true CFG; used only when cfg > 1."),
                *_cache_inputs(),
            ],
            outputs=[io.Latent.Output(display_name="LATENT")],
        )

    @classmethod
    def validate_inputs(cls, width=0, height=0, steps=40, cfg=1.0, **kwargs):
        if steps < 1:
            return f"steps = {steps}: at least 1 step is needed (40 is the official setting)."
        if not cfg >= 1.0:  # also refuses NaN
            return f"cfg = {cfg}: true CFG scales below 1 are not meaningful; use 1 (off) or more."
        return _check_size(cls, width, height, steps=steps, cfg=cfg, **kwargs)

    @classmethod
    def execute(cls, model, positive, seed, steps, cfg, width, height, batch_size, negative=None, prefix_cache="on",
                keep_cache=False) -> io.NodeOutput:
        _require(cls.validate_inputs(width=width, height=height, steps=steps, cfg=cfg, batch_size=batch_size, seed=seed,
                                     prefix_cache=prefix_cache))
        return run(model, positive, sampler="base", seed=seed, width=width, height=height, batch_size=batch_size,
                   sigmas_for=lambda w, h: base_sigmas(steps, w, h), negative=negative, cfg=cfg,
                   prefix_cache=prefix_cache, keep_cache=keep_cache)


class QI21TurboSampler(io.ComfyNode):
    """Turbo sampler: exactly the stored 8-sigma schedule, no guidance."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21TurboSampler",
            display_name="Qwen-Image 2.1 Turbo Sampler",
            category=CATEGORY,
            description="Samples Qwen-Image 2.1 Turbo with its stored 8 sigmas (1.0 ... 0.414568, then 0) at any size, "
                        "no CFG, the prefix cached after the first step.",
            inputs=[
                Model.Input("model"),
                Conditioning.Input("positive"),
                io.Int.Input("seed", default=0, min=0, max=MAX_SEED, control_after_generate=True,
                             tooltip="Noise seed (CPU generator, the same noise as diffusers for this seed)."),
                *_size_inputs(),
                *_cache_inputs(),
            ],
            outputs=[io.Latent.Output(display_name="LATENT")],
        )

    @classmethod
    def validate_inputs(cls, width=0, height=0, **kwargs):
        return _check_size(cls, width, height, **kwargs)

    @classmethod
    def execute(cls, model, positive, seed, width, height, batch_size, prefix_cache="on", keep_cache=False) -> io.NodeOutput:
        _require(cls.validate_inputs(width=width, height=height, batch_size=batch_size, seed=seed,
                                     prefix_cache=prefix_cache))
        return run(model, positive, sampler="turbo", seed=seed, width=width, height=height, batch_size=batch_size,
                   sigmas_for=lambda w, h: turbo_sigmas(), prefix_cache=prefix_cache, keep_cache=keep_cache)
