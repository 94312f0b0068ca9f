"""The denoising loop, which owns the prefix cache from its first step to its last.

    step 1        prefill: the whole sequence runs, every layer's prefix K/V is copied into the cache
    steps 2..N    cached: only the target rows run, attending over [cached prefix | target]
    finally       the cache is freed (success, error or interrupt), or handed to the store (`keep_cache`)

A batch of B seeds shares one prefix copy. True CFG (cfg > 1 with a negative prompt) puts the negative
prompt's prefix next to the positive's in the same cache and runs both halves as one forward; the rows are
ragged, so the two prompts need no padding and the result equals two separate passes. A Fun ControlNet copy
runs its control stream on the steps of its window, which read a controlled cache (the control's layers added);
the steps outside read a plain one (`run_caches.py` owns both).

Numerics follow diffusers' QwenImage21Pipeline: sigmas from `schedule.py`, the timestep rounded through the
latent dtype, the Euler update in fp32, the latents kept in the model's dtype between steps (euler.py, the
built-in sampler; ComfyUI's SAMPLERs run over the same model call, denoiser.py).
"""

import time
from dataclasses import dataclass

import torch

from ..encoders.conditioning import Conditioning
from ..transformer.cache_storage import cache_storage
from ..transformer.dit import PrefixInputs, QwenImage21DiT
from ..transformer.hooks import EveryBlock
from ..transformer.prefix_runs import prefix_runs
from ..vae.latents import LATENT_CHANNELS, latent_shape
from .cache_store import PrefixCacheStore
from .denoiser import FlowDenoiser, run_sampler
from .euler import BuiltinEuler, StepInfo  # noqa: F401 (StepInfo: what `callback` gets)
from .run_caches import RunCaches
from .schedule import literal_sigmas
from .step_cache import StepCache, StepCacheOptions


class NonFiniteLatentsError(FloatingPointError):
    """The latents became NaN or infinite; raised at the step where it happened instead of decoding black."""


@dataclass(frozen=True)
class SampleResult:
    latents: torch.Tensor  # (B, 64, h, w) normalised, in the model's dtype
    report: dict  # the `qi21_report` entry of this run


def initial_noise(seed: int, batch: int, height: int, width: int) -> torch.Tensor:
    """`(B, 64, H/16, W/16)` fp32 noise from a CPU generator seeded with `seed` (ComfyUI's convention, and
    what diffusers draws for a CPU generator with the same seed). Sizes are floored to x32 first."""
    generator = torch.Generator("cpu").manual_seed(int(seed))
    shape = (batch, LATENT_CHANNELS, *latent_shape(width, height))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _match(tensor: torch.Tensor, batch: int, grid: tuple[int, int], name: str, channels: int = LATENT_CHANNELS):
    """`tensor` `(1 or batch, channels, h, w)` as fp32 `(batch, channels, h, w)` on the CPU, or a clear error."""
    tensor = torch.as_tensor(tensor).detach().to("cpu", torch.float32)
    if tensor.ndim != 4 or tuple(tensor.shape[1:]) != (channels, *grid) or tensor.shape[0] not in (1, batch):
        raise ValueError(f"{name} must be (1 or {batch}, {channels}, {grid[0]}, {grid[1]}); got {tuple(tensor.shape)}.")
    return tensor.expand(batch, -1, -1, -1)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class _StepClock:
    """Per-step times without stalling the GPU's queue: CUDA events, read once when the run ends; the host clock
    elsewhere (CPU work is synchronous, so it measures the step itself)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self):
        return self._now()

    def stop(self, started) -> None:
        self.marks.append((started, self._now()))

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) / 1000 for start, end in self.marks]
        return [end - start for start, end in self.marks]


def compute_dtype_name(model) -> str:
    """What the DiT computes in ("float32", "bfloat16", ...): the report's `compute_dtype`, a loader's `default`
    choice for the device (model/loaders/checkpoint.py `default_weight_dtype`) made visible."""
    return str(getattr(model, "compute_dtype", "unknown")).removeprefix("torch.")


def loaded_weights(model) -> tuple[str, str]:
    """(what the DiT runs with, what to try) for the NaN/inf message: the file, its weight format, the compute dtype
    and the LoRAs, and the advice that fits them instead of a guess."""
    compute = compute_dtype_name(model)
    source = getattr(model, "source", None)
    stored = []
    if source is not None and source.layout == "gguf":
        types = {seg.qtype for module in model.modules() for seg in getattr(module, "segments", ())
                 if hasattr(seg, "qtype")}
        stored.append(f"GGUF {', '.join(sorted(types))}")
    elif source is not None and source.quantized:
        stored.append(f"quantized {', '.join(source.quantized)}")
    elif any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):
        stored.append("fp8_e4m3fn block weights")
    loras = [f"{lora.name} at strength {lora.strength:g}" for lora in getattr(model, "loras", ())]
    what = (f"{source.path.name if source is not None else 'the DiT'} ({', '.join(stored + [f'{compute} compute'])})"
            + (f" with LoRA {', '.join(loras)}" if loras else ""))
    advice = []
    if compute == "float16":
        advice.append("load the model with weight_dtype bf16 or fp32 (fp16 overflows)")
    if loras:
        advice.append("run without the LoRA or at a lower strength")
    if stored:
        advice.append("try the bf16 file")
    if not advice:
        advice.append("the weights may be damaged: download the model file again")
    return what, "; ".join(advice)


class _FiniteWatch:
    """The NaN/inf check of the latents after every step. On the CPU it runs at once; on a GPU each step's verdict
    stays on the device and is read when the run ends (one host sync per run, not one per step), and the error
    still names the first bad step and what was loaded."""

    def __init__(self, device: torch.device, sigmas: torch.Tensor, model=None):
        self.sigmas, self.model = sigmas, model
        self.deferred = device.type == "cuda"
        self.flags = torch.ones(sigmas.numel() - 1, dtype=torch.bool, device=device) if self.deferred else None

    def check(self, x: torch.Tensor, step: int) -> None:
        if self.deferred:
            self.flags[step] = torch.isfinite(x).all()
        elif not bool(torch.isfinite(x).all()):
            self._fail(step)

    def finish(self) -> None:
        if self.deferred and not bool(self.flags.all()):
            self._fail(int((~self.flags).nonzero()[0]))

    def _fail(self, step: int) -> None:
        what, advice = loaded_weights(self.model)
        raise NonFiniteLatentsError(
            f"the latents became NaN/inf at step {step + 1} of {self.sigmas.numel() - 1} (sigma "
            f"{self.sigmas[step].item():.4f}) running {what}; {advice}."
        )


def sample(
    model: QwenImage21DiT,
    positive: Conditioning,
    *,
    sigmas: torch.Tensor,
    width: int,
    height: int,
    seed: int = 0,
    batch_size: int = 1,
    noise: torch.Tensor | None = None,
    negative: Conditioning | None = None,
    cfg: float = 1.0,
    prefix_cache: bool = True,
    keep_cache: bool = False,
    store: PrefixCacheStore | None = None,
    callback=None,
    attention: str | None = None,
    check_interrupt=None,
    latent_image: torch.Tensor | None = None,
    noise_mask: torch.Tensor | None = None,
    add_noise: bool = True,
    new_cache=None,
    sampler=None,
    cache_dtype: str = "default",
    step_cache: StepCacheOptions | None = None,
) -> SampleResult:
    """Denoise along `sigmas` (used as given; see `literal_sigmas`); returns normalised latents and the report.

    `noise` `(B, 64, H/16, W/16)` overrides `seed`/`batch_size`. `callback(StepInfo)` runs after every step;
    an exception it raises (ComfyUI's interrupt) ends the run with the cache freed. `check_interrupt()` runs
    after every block of every step, so a cancel lands within one block even when a step takes seconds.
    `keep_cache` keeps the prefix cache in `store` (a `PrefixCacheStore`; the nodes own theirs) for the next run
    with this conditioning.

    img2img and inpainting (`img2img.py` has the semantics): `latent_image` `(1 or B, 64, h, w)` normalised is
    the start, noised to the first sigma (`add_noise`) or taken as already noised; `noise_mask` `(1 or B, 1, h, w)`
    (1 = repaint) keeps the rest of `latent_image`. A schedule ending above 0 returns the partly denoised latent.
    `new_cache()` makes the prefix cache of a miss (default `PrefixKVCache`; the memory plan may ask for a host-side
    one, `streaming.HostPrefixKVCache`).

    `cache_dtype` ("default", "int8", "int4"; transformer/cache_storage.py) stores the prefix cache in the model's
    dtype or quantized per token through comfy-kitchen; a kept cache is reused only by a run with the same one.

    `step_cache` (step_cache.py; the Step Cache node's options on a model copy) skips blocks 1..N-1 of the model
    calls where block 0 barely changed, replaying their last residual (lossy, opt-in); None, mode off or threshold 0
    runs every block as before. One decision per model call (every sample and both CFG prompts together); the
    report's `step_cache` lists them.

    Every run is a sampler over the model as a flow denoiser (denoiser.py), which makes the one model call: None is
    the built-in Euler (euler.py: diffusers' loop, `callback(StepInfo)` after each step); `sampler(denoiser, sigmas,
    noise, latent, mask) -> latents` is another (ComfyUI's SAMPLERs through the bridge, run as ComfyUI's KSAMPLER
    runs them: `run_sampler`), `callback` then runs after every model call (a `denoiser.CallInfo`) and the report
    counts `model_calls`. The cache, the control phases and the step cache are the same for both.
    """
    notes = []
    grid = latent_shape(width, height)
    if noise is None:
        noise = initial_noise(seed, batch_size, height, width)
    if tuple(noise.shape[1:]) != (LATENT_CHANNELS, *grid):
        raise ValueError(f"noise must be (B, 64, {grid[0]}, {grid[1]}), got {tuple(noise.shape)}.")
    sigmas = literal_sigmas(sigmas)
    steps = sigmas.numel() - 1
    if not cfg >= 1.0:
        raise ValueError(f"cfg must be >= 1 (1 disables guidance); got {cfg}.")
    use_cfg = negative is not None and cfg > 1.0
    if negative is not None and not use_cfg:
        notes.append("negative prompt ignored: true CFG needs cfg > 1")
    elif cfg > 1.0 and negative is None:
        notes.append(f"cfg {cfg} ignored: true CFG needs a negative prompt")

    device, dtype = _device_of(model), model.compute_dtype
    batch = noise.shape[0]
    conditionings = [positive] + ([negative] if use_cfg else [])
    prefixes = [PrefixInputs(layout=c.layout(grid), text=c.text, references=c.references) for c in conditionings]
    sample_prefix = [0] * batch + ([1] * batch if use_cfg else [])
    cached = bool(prefix_cache) and model.config.causal_condition
    if prefix_cache and not cached:
        notes.append("prefix cache off: this model has causal_condition=false")

    storage = cache_storage(cache_dtype, "cache_dtype") if cached else None
    if keep_cache and store is None:
        raise ValueError("keep_cache needs a store to keep the cache in (store=PrefixCacheStore(...)).")
    runs = [prefix_runs(p.layout, p.text, p.references) for p in prefixes]
    # what the user gave (token ids, pixels) when the text-encode step said it, else the DiT's inputs
    prefix_key = positive.lead_key or runs[0].leading_key()
    init = None if latent_image is None else _match(latent_image, batch, grid, "latent_image")
    mask = None if noise_mask is None else _match(noise_mask, batch, grid, "noise_mask", channels=1)
    if mask is not None and init is None:
        raise ValueError("a noise_mask needs the latent_image it keeps outside the mask.")
    if init is None and not add_noise:
        raise ValueError("add_noise off needs a latent_image: the already-noised latent to continue from.")

    # A Fun ControlNet copy (transformer/controlnet.py) runs its control on the calls inside its window, for both CFG
    # prompts and every sample as core does; those calls read a controlled cache, the others a plain one.
    control = getattr(model, "control", None)
    phases = [control is not None and control.active(sigmas[i].item()) for i in range(steps)]
    if control is not None and (any(phases) or sampler is not None):
        control.hint(grid, device, dtype)  # the control latent (VAE encodes) before the first step's clock

    def controlled_at(sigma: float) -> bool:
        return control is not None and control.active(sigma)

    def mode_of(sigma: float) -> str:
        return "uncached" if not cached else caches.mode(controlled_at(sigma))

    # the caches are planned on first use: a kept entry they take out of the store is handled by `close` below
    caches = RunCaches(model, prefixes, runs, store=store, keep_cache=keep_cache, new_cache=new_cache, device=device,
                       dtype=dtype, storage=storage, prefix_key=prefix_key) if cached else None
    interrupt = None if check_interrupt is None else EveryBlock(lambda index: check_interrupt())
    clock, watch, modes, succeeded = _StepClock(device), _FiniteWatch(device, sigmas, model), [], False
    # an edit (references present) changes less per step, so T8's rule asks a smaller change of it; a CFG-parallel
    # rank's `positive` may be the negative prompt, so the split says whether the run is an edit (every rank must
    # build a step cache, or none: a lone one would wait in the indicator's all-reduce)
    edit = getattr(getattr(model, "parallel", None), "edit", None)
    edit = bool(positive.ref_shapes) if edit is None else edit
    skipper = StepCache.for_run(step_cache, sigmas, edit=edit, num_layers=model.config.num_layers)
    if skipper is not None and getattr(model, "parallel", None) is not None:  # ranks decide together (parallel/)
        model.parallel.join_step_cache(skipper)

    def forward(packed, t, mode, sigma):  # the run's one model call, whichever sampler asks
        phase = controlled_at(sigma)
        stream = None if not phase else control.stream(grid, model.config.num_layers, device, dtype,
                                                       net=model.control_net)
        return model(torch.cat([packed, packed]) if use_cfg else packed, t, prefixes, sample_prefix,
                     cache=caches.get(phase).cache if cached else None, mode=mode, attention=attention,
                     hooks=(stream, interrupt, None if skipper is None else skipper.call(sigma, key=phase, mode=mode)))

    denoiser = FlowDenoiser(forward, dtype=dtype, device=device, use_cfg=use_cfg, cfg=cfg, grid=grid,
                            mode_of=mode_of, clock=clock, modes=modes, on_call=None if sampler is None else callback,
                            reads_sigma=control is not None or skipper is not None)
    if sampler is None:
        last_of = {phase: i for i, phase in enumerate(phases)}

        def after_call(i: int) -> None:  # the last step of a phase: its cache is no longer read
            if cached and i == last_of[phases[i]]:
                caches.done_with(phases[i])

        run = BuiltinEuler(add_noise=add_noise, clock=clock, watch=watch, callback=callback, after_call=after_call)
    else:
        def run(denoiser, sigmas, noise, latent, mask):  # the SAMPLER undoes the noise scaling itself
            final = run_sampler(sampler, denoiser, sigmas, noise, latent, mask, add_noise)
            watch.check(final, steps - 1)
            return final
    try:
        latents = run(denoiser, sigmas, noise, init, mask)
        watch.finish()
        succeeded = True
    finally:
        if skipper is not None:
            skipper.free()
        if caches is not None:
            caches.close(succeeded, notes)

    times = clock.seconds()  # the run's one host sync on a GPU
    prefill_seconds = next((t for t, mode in zip(times, modes) if mode == "prefill"), None)
    step_times = [t for t, mode in zip(times, modes) if mode != "prefill"]
    prefix_rows = sum(p.layout.prefix_len for p in prefixes)
    held_rows = caches.held_rows if cached else prefix_rows  # a partial window's two caches hold every row each
    computed_rows = caches.computed_rows if cached else prefix_rows
    report = {
        "prefix_tokens": prefix_rows,
        "target_tokens": grid[0] * grid[1],
        "batch": batch,
        "steps": steps,
        "compute_dtype": compute_dtype_name(model),
        "cache": "off" if not cached else caches.state(),
        "cache_bytes": caches.nbytes if cached else 0,
        "cache_dtype": caches.storage_name if cached else None,
        "cache_device": caches.device if cached else None,
        "prefill_seconds": None if prefill_seconds is None else round(prefill_seconds, 4),
        "step_seconds": round(sum(step_times) / len(step_times), 4) if step_times else None,
        "prefix_rows_reused": held_rows - computed_rows,
        "prefix_rows_computed": computed_rows,
        "prefix_key": prefix_key,
    }
    if control is not None:
        report["control"] = {**control.report(), "active_steps": sum(phases) if sampler is None else None,
                             "cache_bytes": caches.stream_bytes() if cached else {}}
    loras = getattr(model, "loras", ())  # a LoRA copy (model/loaders/lora.py) records what it applied
    if loras:
        report["loras"] = [{"name": lora.name, "strength": lora.strength} for lora in loras]
        notes.extend(note for lora in loras for note in lora.notes)
    if sampler is not None:
        report["model_calls"] = len(modes)
    if skipper is not None:
        report["step_cache"] = skipper.report("step" if sampler is None else "model call")
    if notes:
        report["notes"] = notes
    return SampleResult(latents, report)

