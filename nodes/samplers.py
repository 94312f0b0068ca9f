"""The Base and Turbo samplers: they own the DiT call and the prefix cache's whole lifetime (model/sampling/loop.py)."""

import json

import torch

from ..model.encoders.canvas import CROP_KEY, check_box, mask_on_canvas, padded_target
from ..model.loaders.trained_for import trained_for_notes
from ..model.options import options_of
from ..model.sampling.img2img import (
    check_denoise,
    check_latent,
    denoise_problem,
    denoise_tail,
    fixed_tail,
    latent_mask,
)
from ..model.sampling.loop import RunSpec
from ..model.sampling.schedule import base_sigmas, literal_sigmas, schedule_mu, turbo_sigmas
from ..model.vae.latents import (
    LATENT_CHANNELS,
    LATENT_TOKEN_PIXELS,
    latent_shape,
    latent_tokens,
    sampling_size,
    target_size,
)
from . import bridge, observability
from .bridge import io
from .comfy_sampling import sampler_runner
from .executor import execute
from .socket_types import CATEGORY, Conditioning, Model
from .validation import is_number, quoted, refuse_unknown_inputs, require, widget_problem

MIN_SIZE, MAX_SIZE = 32, 4096  # the reference pipeline runs any multiple of 32
TRAINED_MIN_SIZE = 256  # below this the report notes that the model was trained at larger sizes
MAX_SEED = 0xFFFFFFFFFFFFFFFF

SIZE_TOOLTIP = ("0 follows the last reference's size (the reference pipeline's default), or 1024 without references; "
                "with a reference whose fit is pad, the first such reference's padded size, and the output keeps "
                "its box so VAE Decode crops back to the image's own size. Other values are floored to a multiple "
                "of 32, as the reference pipeline does.")
PREFIX_CACHE_TOOLTIP = ("on: the first step computes the prompt and references once and caches their keys/values "
                        "(0.5 MiB per prefix token in bf16); later steps run only the image. Exact, and faster the "
                        "more references you use. off recomputes the prefix every step: slower, the way to rule the "
                        "cache out.")
KEEP_CACHE_TOOLTIP = ("Keep the prefix cache after the run (bounded store, least-recently-used eviction) so the next "
                      "run with the same model, prompt and references (another seed, size or batch) skips the first "
                      "step's prefill, and a run with the same references but other words computes only the words. "
                      "Costs the cache's memory between runs; off frees it at the end.")


def _size_inputs():
    return [
        io.Int.Input("width", default=0, min=0, max=MAX_SIZE, step=32, tooltip=SIZE_TOOLTIP),
        io.Int.Input("height", default=0, min=0, max=MAX_SIZE, step=32, tooltip=SIZE_TOOLTIP),
        io.Int.Input("batch_size", default=1, min=1, max=64,
                     tooltip="Images per run. One CPU generator seeded with seed draws the noise of the whole batch "
                             "at once: image 1 starts from the noise of a batch-1 run with this seed, image b from "
                             "that generator's next draws (not from seed + b - 1). They share one prefix cache, so a "
                             "batch costs no extra cache memory."),
    ]


def _cache_inputs():
    return [
        io.Combo.Input("prefix_cache", options=["on", "off"], default="on", optional=True,
                       tooltip=PREFIX_CACHE_TOOLTIP),
        io.Boolean.Input("keep_cache", default=False, optional=True, tooltip=KEEP_CACHE_TOOLTIP),
    ]


def _check_size(node, width, height, **widgets) -> str | bool:
    for name, value in (("width", width), ("height", height)):
        if is_number(value) and value and not MIN_SIZE <= value <= MAX_SIZE:
            return (f"{name} = {quoted(value)}: use 0 (follow the reference / 1024) or a size from {MIN_SIZE} to "
                    f"{MAX_SIZE}.")
    denoise = widgets.get("denoise")
    if is_number(denoise) and not 0.0 < denoise <= 1.0:  # None: linked, checked in execute
        return (f"denoise = {quoted(denoise)}: use a value in (0, 1]. 1 starts from pure noise; lower values keep "
                "more of the latent_image (0 would run no step at all).")
    return widget_problem(node, width=width, height=height, **widgets)  # a string or a list: "expected a number"


def _start_image(latent_image, width, height, batch_size):
    """(raw latents (B, 64, h, w), noise mask or None, width, height, batch) from a LATENT; sizes must agree."""
    raw = check_latent(latent_image.get("samples") if isinstance(latent_image, dict) else None)
    own_w, own_h = raw.shape[-1] * LATENT_TOKEN_PIXELS, raw.shape[-2] * LATENT_TOKEN_PIXELS
    if (width and width != own_w) or (height and height != own_h):
        raise ValueError(f"width x height = {width or own_w}x{height or own_h} but latent_image is {own_w}x{own_h}; "
                         "set width and height to 0 to follow the latent, or resize the latent first.")
    if sampling_size(own_w, own_h) != (own_w, own_h):
        raise ValueError(f"latent_image is {own_w}x{own_h} px; Qwen-Image 2.1 generates sizes in multiples of 32. "
                         "Encode an image whose sides are multiples of 32 (Qwen-Image 2.1 VAE Encode crops to them).")
    batch = raw.shape[0]
    if batch > 1 and batch_size not in (1, batch):
        raise ValueError(f"batch_size = {batch_size} but latent_image holds {batch} latents; use 1 or {batch}.")
    return raw, latent_image.get("noise_mask"), own_w, own_h, max(batch, batch_size)


def _reference_difference(positive, negative) -> str | None:
    """How the negative prompt's references differ from the positive's (the reference pipeline uses the same)."""
    if negative is None:
        return None
    if positive.ref_shapes == negative.ref_shapes and (
            positive.references is None or torch.equal(positive.references, negative.references)):
        return None
    if len(positive.ref_shapes) != len(negative.ref_shapes):
        return (f"{len(negative.ref_shapes)} references in the negative prompt, {len(positive.ref_shapes)} in the "
                "positive")
    if positive.ref_shapes != negative.ref_shapes:
        return "the negative prompt's references have other sizes than the positive's"
    return "the negative prompt's references are other images than the positive's"


def _canvas(model, positive, sampler: str, width, height, batch_size, latent_image, notes: list) -> tuple:
    """(raw start latent, mask, pad box, width, height, batch size) of the run: from `latent_image` when one is
    connected, else the size asked (0: the last reference's; a reference with fit = pad pads the canvas)."""
    raw = mask = box = None
    if latent_image is not None:
        raw, mask, width, height, batch_size = _start_image(latent_image, width, height, batch_size)
        if latent_image.get(CROP_KEY) is not None:  # from VAE Encode with fit = pad
            box = check_box(latent_image[CROP_KEY], (width, height), f"latent_image's {CROP_KEY}")
    else:
        wanted = target_size(width, height, positive.ref_shapes[-1] if positive.ref_shapes else None)
        padded = padded_target(positive.ref_shapes, positive.ref_crops, width, height)  # a reference with fit = pad
        if padded is not None:
            wanted, box = padded
        width, height = sampling_size(*wanted)
        if (width, height) != tuple(wanted):
            notes.append(f"size {wanted[0]}x{wanted[1]} floored to {width}x{height} (multiples of 32)")
    if min(width, height) < TRAINED_MIN_SIZE:
        notes.append(f"{width}x{height} is below {TRAINED_MIN_SIZE} px: runs as the reference pipeline does, but the "
                     "model was trained at larger sizes (expect weak images)")
    variant = getattr(getattr(model, "source", None), "variant", "unknown")
    expected = "turbo" if sampler == "turbo" else "base"
    if variant not in (expected, "unknown"):
        notes.append(f"a {variant} model in the {sampler} sampler: use the Qwen-Image 2.1 "
                     f"{'Turbo ' if variant == 'turbo' else ''}Sampler for it (its schedule is what it was trained "
                     "for)")
    return raw, mask, box, width, height, batch_size


def _schedule(model, sampler: str, sigmas, sigmas_for, width, height, denoise, notes: list):
    """The sigmas the run follows: the connected ones as they are, else the sampler's own for this size."""
    if sigmas is not None:
        sigmas = literal_sigmas(sigmas, "sigmas")
        if denoise < 1.0:
            notes.append("denoise ignored: the connected sigmas are used as they are")
    else:
        sigmas = sigmas_for(width, height, denoise)
    if sampler == "turbo" and not torch.equal(sigmas, model_turbo_sigmas(model)):
        notes.append("Turbo was distilled for its stored 8-sigma schedule; other schedules or denoise < 1 may "
                     "lose quality")
    return sigmas


def run(model, positive, *, sampler: str, seed, width, height, batch_size, sigmas_for, negative=None, cfg=1.0,
        prefix_cache="on", keep_cache=False, sigmas=None, latent_image=None, denoise=1.0,
        add_noise=True, sampler_object=None) -> io.NodeOutput:
    """What both samplers do: size, schedule, start image, sampling with progress/interrupt/previews, report,
    LATENT. `sigmas_for(width, height, denoise)` is the sampler's own schedule. `sampler_object`: a ComfyUI SAMPLER
    to run instead of the built-in Euler loop (nodes/comfy_sampling.py)."""
    notes = []
    denoise = 1.0 if denoise is None else float(denoise)
    check_denoise(denoise)
    raw, mask, box, width, height, batch_size = _canvas(model, positive, sampler, width, height, batch_size,
                                                        latent_image, notes)
    notes += trained_for_notes(model, width, height, cfg if negative is not None else 1.0)  # e.g. the toy's 256 px
    sigmas = _schedule(model, sampler, sigmas, sigmas_for, width, height, denoise, notes)
    difference = _reference_difference(positive, negative if cfg > 1 else None)
    if difference:
        notes.append(f"{difference} (the reference pipeline encodes both prompts with the same images)")
    if raw is None and not add_noise:
        raise ValueError("add_noise is off but no latent_image is connected: add_noise off continues an already "
                         "noised latent (the second half of a split schedule). Connect one, or turn add_noise on.")
    if raw is None and sigmas[0].item() < 1.0:
        # as ComfyUI does with an empty latent: the start mixes noise with an all-zero (raw) image
        raw = torch.zeros(1, LATENT_CHANNELS, *latent_shape(width, height))
    options = options_of(model).cache  # a Qwen-Image 2.1 Prefix Cache node upstream (nodes/cache.py)
    cached = prefix_cache == "on" and options.device != "off"
    if prefix_cache == "on" and not cached:
        notes.append("prefix cache off: the Prefix Cache node's device is off (every step recomputes the prefix)")
    for note in notes:
        bridge.log.warning("qi21 %s sampler: %s", sampler, note)
    runner = sampler_name = None  # a SAMPLER is checked before anything is loaded; its model_sampling is shifted
    if sampler_object is not None:  # as the official schedule is
        mu = 0.0 if sampler == "turbo" else schedule_mu(latent_tokens(width, height))
        sampler_name, runner = sampler_runner(sampler_object, seed=seed, mu=mu)
    grid = latent_shape(width, height)
    start = None if raw is None else positive.latent_format.normalize(raw)
    if mask is not None and box is not None:  # a mask drawn on the picture is padded like the picture
        mask = mask_on_canvas(mask, box, (width, height))
    spec = RunSpec(positive, sigmas, width, height, seed=seed, batch_size=batch_size, negative=negative, cfg=cfg,
                   prefix_cache=cached, keep_cache=keep_cache, latent_image=start,
                   noise_mask=None if mask is None else latent_mask(mask, grid, batch_size), add_noise=add_noise,
                   sampler=runner)
    result, added, store_notes = execute(model, spec, len(sigmas) - 1)  # here or in the workers (nodes/executor.py)
    report = dict(result.report)
    if sampler_name is not None:
        report["sampler"] = sampler_name
    if box is not None:  # VAE Decode cuts the picture's own pixels out of the padded canvas
        report["crop"] = {"box": [0, 0, *box], "canvas": [width, height]}
    report.update(added)
    for note in store_notes:
        bridge.log.info("qi21 %s sampler: %s", sampler, note)
    notes += store_notes
    if notes:
        report["notes"] = notes + report.get("notes", [])
    bridge.log.info("qi21_report %s", json.dumps(report))
    observability.record_run(report)
    out = {key: latent_image[key] for key in ("noise_mask", "batch_index") if key in (latent_image or {})}
    out["samples"] = positive.latent_format.denormalize(result.latents.float()).cpu()
    if box is not None:
        out[CROP_KEY] = box
    return io.NodeOutput(out, ui={"qi21_report": [report]})


def model_turbo_sigmas(model) -> torch.Tensor:
    """The Turbo schedule with its terminal 0: the loaded diffusers folder's own `sample_sigmas` when it has them
    (`DiTSource.sigmas`), else the released 8-sigma grid."""
    grid = getattr(getattr(model, "source", None), "sigmas", None)
    return torch.tensor((*grid, 0.0), dtype=torch.float32) if grid else turbo_sigmas()


def _start_inputs():
    """Inputs both samplers append (optional; saved workflows keep working without them)."""
    return [
        io.Sigmas.Input("sigmas", optional=True,
                        tooltip="A schedule to use as it is (e.g. from ManualSigmas, SplitSigmas or Qwen-Image 2.1 "
                                "Schedule); it replaces the built-in one and steps is ignored. One ending above 0 "
                                "returns a partly denoised latent for a second sampler."),
        io.Latent.Input("latent_image", optional=True,
                        tooltip="Start from this image (img2img) instead of pure noise; its noise_mask (from "
                                "SetLatentNoiseMask) repaints only where the mask is 1. Width and height follow it."),
        io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01, optional=True,
                       tooltip="How much of latent_image to redo: 1 starts from pure noise (text-to-image); lower "
                               "keeps more of the image and runs only the last steps of a longer schedule."),
        io.Boolean.Input("add_noise", default=True, optional=True,
                         tooltip="Off: latent_image is already noised to the first sigma (the second sampler of a "
                                 "schedule split with SplitSigmas). On: noise it first (img2img)."),
        io.Sampler.Input("sampler", optional=True,
                         tooltip="Any ComfyUI sampler (KSamplerSelect: euler, dpmpp_2m, res_multistep, heun, uni_pc, "
                                 "er_sde, ...) instead of the built-in Euler, over the same schedule, seed and "
                                 "prefix cache (filled by the first model call, reused by every later one)."),
    ]


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
                *_start_inputs(),
            ],
            outputs=[io.Latent.Output(display_name="LATENT")],
        )

    @classmethod
    def validate_inputs(cls, width=0, height=0, steps=40, cfg=1.0, **kwargs):
        # None: linked (ComfyUI passes no value before the run); execute calls this again with the real one
        if is_number(steps) and steps < 1:
            return f"steps = {quoted(steps)}: at least 1 step is needed (40 is the official setting)."
        if is_number(cfg) and not cfg >= 1.0:  # also refuses NaN
            return f"cfg = {quoted(cfg)}: true CFG scales below 1 are not meaningful; use 1 (off) or more."
        denoise = kwargs.get("denoise")
        ranged = widget_problem(cls, steps=steps, cfg=cfg, denoise=denoise)  # no arithmetic on 10**400 or a string
        if ranged is not True:
            return ranged
        if steps is not None and denoise is not None and "sigmas" not in kwargs:
            problem = denoise_problem(denoise, steps)  # without connected sigmas: the tail of a longer schedule
            if problem is not None:
                return problem
        return _check_size(cls, width, height, steps=steps, cfg=cfg, **kwargs)

    @classmethod
    def execute(cls, model, positive, seed, steps, cfg, width, height, batch_size, negative=None, prefix_cache="on",
                keep_cache=False, sigmas=None, latent_image=None, denoise=1.0, add_noise=True,
                sampler=None, **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        require(cls.validate_inputs(width=width, height=height, steps=steps, cfg=cfg, batch_size=batch_size, seed=seed,
                                     prefix_cache=prefix_cache, denoise=denoise,
                                     **({} if sigmas is None else {"sigmas": sigmas})))
        return run(model, positive, sampler="base", seed=seed, width=width, height=height, batch_size=batch_size,
                   sigmas_for=lambda w, h, d: denoise_tail(lambda n: base_sigmas(n, w, h), steps, d),
                   negative=negative, cfg=cfg, prefix_cache=prefix_cache, keep_cache=keep_cache, sigmas=sigmas,
                   latent_image=latent_image, denoise=denoise, add_noise=add_noise, sampler_object=sampler)


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
                *_start_inputs(),
            ],
            outputs=[io.Latent.Output(display_name="LATENT")],
        )

    @classmethod
    def validate_inputs(cls, width=0, height=0, **kwargs):
        return _check_size(cls, width, height, **kwargs)

    @classmethod
    def execute(cls, model, positive, seed, width, height, batch_size, prefix_cache="on", keep_cache=False,
                sigmas=None, latent_image=None, denoise=1.0, add_noise=True, sampler=None,
                **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        require(cls.validate_inputs(width=width, height=height, batch_size=batch_size, seed=seed,
                                     prefix_cache=prefix_cache, denoise=denoise))
        return run(model, positive, sampler="turbo", seed=seed, width=width, height=height, batch_size=batch_size,
                   sigmas_for=lambda w, h, d: fixed_tail(model_turbo_sigmas(model), d), prefix_cache=prefix_cache,
                   keep_cache=keep_cache, sigmas=sigmas, latent_image=latent_image, denoise=denoise,
                   add_noise=add_noise, sampler_object=sampler)
