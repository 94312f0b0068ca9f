"""The denoising loop, which owns the prefix cache from its first step to its last.

    step 1        prefill: the whole sequence runs, every layer's prefix K/V is copied into the cache
    steps 2..N    cached: only the target rows run, attending over [cached prefix | target]
    finally       the cache is freed (success, error or interrupt), or handed to the store (`keep_cache`)

A batch of B seeds shares one prefix copy. True CFG (cfg > 1 with a negative prompt) puts the negative
prompt's prefix next to the positive's in the same cache and runs both halves as one forward; the rows are
ragged, so the two prompts need no padding and the result equals two separate passes. A Fun ControlNet copy
runs its control stream on the steps of its window, which read a controlled cache (the control's layers added);
the steps outside read a plain one (`prefix_cache/lifecycle.py` owns both).

Numerics follow diffusers' QwenImage21Pipeline: sigmas from `schedule.py`, the timestep rounded through the
latent dtype, the Euler update in fp32, the latents kept in the model's dtype between steps (euler.py, the
built-in sampler; ComfyUI's SAMPLERs run over the same model call, denoiser.py).
"""

import time
from dataclasses import dataclass, replace

import torch

from ..encoders.conditioning import Conditioning
from ..features import registry  # noqa: F401 (registers the pack's features)
from ..features.record import ModelOptions, record_on
from ..prefix_cache.kept_entries import PrefixCacheStore
from ..prefix_cache.leading_runs import prefix_runs
from ..prefix_cache.lifecycle import RunCaches
from ..prefix_cache.storage_choice import CacheOptions
from ..prefix_cache.storage_formats import cache_storage
from ..transformer.dit import PrefixInputs, QwenImage21DiT
from ..transformer.hooks import EveryBlock
from ..vae.latents import LATENT_CHANNELS, latent_shape
from .denoiser import FlowDenoiser, run_sampler
from .euler import BuiltinEuler, StepInfo  # noqa: F401 (StepInfo: what `callback` gets)
from .schedule import literal_sigmas
from .step_cache import StepCacheOptions


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


def loaded_weights(model, record: ModelOptions | None = None) -> tuple[str, str]:
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
    loras = [f"{lora.name} at strength {lora.strength:g}" for lora in (record or record_on(model)).loras]
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

    def __init__(self, device: torch.device, sigmas: torch.Tensor, model=None, record=None):
        self.sigmas, self.model, self.record = sigmas, model, record
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
        what, advice = loaded_weights(self.model, self.record)
        raise NonFiniteLatentsError(
            f"the latents became NaN/inf at step {step + 1} of {self.sigmas.numel() - 1} (sigma "
            f"{self.sigmas[step].item():.4f}) running {what}; {advice}."
        )


@dataclass(frozen=True)
class RunSpec:
    """One sampling run, as a sampler node (or a Python caller) describes it; `run` executes it.

    `noise` `(B, 64, H/16, W/16)` overrides `seed`/`batch_size`. True CFG needs `negative` and `cfg` > 1.
    img2img and inpainting (`img2img.py` has the semantics): `latent_image` `(1 or B, 64, h, w)` normalised is the
    start, noised to the first sigma (`add_noise`) or taken as already noised; `noise_mask` `(1 or B, 1, h, w)`
    (1 = repaint) keeps the rest of `latent_image`. A schedule ending above 0 returns the partly denoised latent.
    `sampler(denoiser, sigmas, noise, latent, mask) -> latents` runs instead of the built-in Euler (ComfyUI's
    SAMPLERs through the bridge, as ComfyUI's KSAMPLER runs them: `run_sampler`). `keep_cache` keeps the prefix
    cache in the services' store for the next run with this conditioning. `options`: the model's options record
    (model/features/record.py); None: the record the model carries."""

    positive: Conditioning
    sigmas: torch.Tensor
    width: int
    height: int
    seed: int = 0
    batch_size: int = 1
    noise: torch.Tensor | None = None
    negative: Conditioning | None = None
    cfg: float = 1.0
    prefix_cache: bool = True
    keep_cache: bool = False
    latent_image: torch.Tensor | None = None
    noise_mask: torch.Tensor | None = None
    add_noise: bool = True
    sampler: object = None
    options: object = None


@dataclass(frozen=True)
class RunServices:
    """What the caller lends a run: the kept-cache `store` (a `PrefixCacheStore`; the nodes own theirs), `new_cache()`
    for the prefix cache of a miss (default `PrefixKVCache`; the memory plan may ask for a host-side one),
    `callback` after every step (`StepInfo`; with a SAMPLER after every model call, a `denoiser.CallInfo`), whose
    exception (ComfyUI's interrupt) ends the run with the cache freed, `check_interrupt()` after every block, and
    the attention backend."""

    store: PrefixCacheStore | None = None
    new_cache: object = None
    callback: object = None
    check_interrupt: object = None
    attention: str | None = None


@dataclass
class RunFacts:
    """What the features' run parts read of the run (model/features/plugin.py): set before the first call, and the
    outcome (`caches`, `active_steps`) before they report."""

    sigmas: torch.Tensor
    grid: tuple[int, int]
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    edit: bool
    split: object  # a rank's `Ulysses` / `CfgParallel` (the ranks decide together), else None
    per: str  # what one call is for a report: "step" (the built-in loop) or "model call" (a SAMPLER)
    caches: object = None
    active_steps: int | None = None


@dataclass(frozen=True)
class ModelCall:
    """One model call as the run parts' `hooks` see it."""

    sigma: float | None
    mode: str
    phase: bool


_SPEC_FIELDS = set(RunSpec.__dataclass_fields__)
_SERVICE_FIELDS = set(RunServices.__dataclass_fields__)


def sample(model: QwenImage21DiT, positive: Conditioning, *, sigmas, width: int, height: int,
           step_cache: StepCacheOptions | None = None, cache_dtype: str = "default", **inputs) -> SampleResult:
    """The keyword form of `run` (the Python API, the workers and the tests): `inputs` are `RunSpec` and
    `RunServices` fields by name. `step_cache` and `cache_dtype` (a record's step cache and prefix-cache dtype) set
    those fields of the model's record for this run: the same as a model copy carrying them (`with_options`)."""
    unknown = sorted(set(inputs) - _SPEC_FIELDS - _SERVICE_FIELDS)
    if unknown:
        raise TypeError(f"sample() got unknown input(s) {', '.join(unknown)}.")
    spec = RunSpec(positive, sigmas, width, height, **{k: v for k, v in inputs.items() if k in _SPEC_FIELDS})
    changes = {}
    if step_cache is not None:  # mode "off" starts no step cache (StepCache.for_run)
        changes["step_cache"] = step_cache
    if cache_dtype != "default":
        changes["cache"] = CacheOptions(dtype=cache_dtype)
    if changes:
        spec = replace(spec, options=record_of(model, spec.options).replace(**changes))
    return run(model, spec, RunServices(**{k: v for k, v in inputs.items() if k in _SERVICE_FIELDS}))


def record_of(model, given=None) -> ModelOptions:
    """The record a run follows: `given`, else the one the model copy carries (`with_options`; the features'
    `apply_lora` and `apply_controlnet` extend it on their copies), else a plain one."""
    return given if given is not None else record_on(model)


def run(model: QwenImage21DiT, spec: RunSpec, services: RunServices = RunServices()) -> SampleResult:
    """Denoise along `spec.sigmas` (used as given; see `literal_sigmas`); returns normalised latents and the report.

    Every run is a sampler over the model as a flow denoiser (denoiser.py), which makes the one model call: the
    built-in Euler (euler.py: diffusers' loop) or `spec.sampler`. The record's active features join the run as
    run parts (model/features/): each adds block hooks to every call, and its entry to the report; the prefix
    cache (`RunCaches`) serves every call, one cache per phase (a Fun ControlNet's window reads its own)."""
    notes, grid = [], latent_shape(spec.width, spec.height)
    noise = spec.noise if spec.noise is not None else initial_noise(spec.seed, spec.batch_size, spec.height,
                                                                    spec.width)
    if tuple(noise.shape[1:]) != (LATENT_CHANNELS, *grid):
        raise ValueError(f"noise must be (B, 64, {grid[0]}, {grid[1]}), got {tuple(noise.shape)}.")
    sigmas = literal_sigmas(spec.sigmas)
    use_cfg = _guidance(spec, notes)
    device, dtype, batch = _device_of(model), model.compute_dtype, noise.shape[0]
    record = record_of(model, spec.options)
    prefixes = [PrefixInputs(layout=c.layout(grid), text=c.text, references=c.references)
                for c in [spec.positive] + ([spec.negative] if use_cfg else [])]
    sample_prefix = [0] * batch + ([1] * batch if use_cfg else [])
    cached = bool(spec.prefix_cache) and model.config.causal_condition
    if spec.prefix_cache and not cached:
        notes.append("prefix cache off: this model has causal_condition=false")
    if spec.keep_cache and services.store is None:
        raise ValueError("keep_cache needs a store to keep the cache in (store=PrefixCacheStore(...)).")
    runs = [prefix_runs(p.layout, p.text, p.references) for p in prefixes]
    # what the user gave (token ids, pixels) when the text-encode step said it, else the DiT's inputs
    prefix_key = spec.positive.lead_key or runs[0].leading_key()
    init, mask = _start(spec, batch, grid)
    # an edit (references present) changes less per step, so T8's rule asks a smaller change of it; a CFG-parallel
    # rank's `positive` may be the negative prompt, so the split says whether the run is an edit
    split = getattr(model, "parallel", None)
    edit = bool(spec.positive.ref_shapes) if getattr(split, "edit", None) is None else split.edit
    facts = RunFacts(sigmas, grid, device, dtype, model.config.num_layers, edit, split,
                     "step" if spec.sampler is None else "model call")
    parts = record.start_run(model, facts)  # the active features' share of this run, in registration order
    phases = [any(part.phase(sigmas[i].item()) for part in parts) for i in range(sigmas.numel() - 1)]
    for part in parts:
        part.prepare(any(phases) or spec.sampler is not None)
    storage = cache_storage(record.cache.dtype, "cache_dtype") if cached else None
    # the caches are planned on first use: a kept entry they take out of the store is handled by `close` below
    caches = RunCaches(model, prefixes, runs, store=services.store, keep_cache=spec.keep_cache,
                       new_cache=services.new_cache, device=device, dtype=dtype, storage=storage,
                       prefix_key=prefix_key, identity=record.kept_identity(model),
                       phased=next(filter(None, (part.phase_cache() for part in parts)), None)) if cached else None
    interrupt = None if services.check_interrupt is None else EveryBlock(lambda index: services.check_interrupt())

    def phase_at(sigma) -> bool:
        return any(part.phase(sigma) for part in parts)

    def mode_of(sigma) -> str:
        return "uncached" if not cached else caches.mode(phase_at(sigma))

    def forward(packed, t, mode, sigma):  # the run's one model call, whichever sampler asks
        call = ModelCall(sigma, mode, phase_at(sigma))
        hooks = [hook for part in parts for hook in part.hooks(call)]
        return model(torch.cat([packed, packed]) if use_cfg else packed, t, prefixes, sample_prefix,
                     cache=caches.get(call.phase).cache if cached else None, mode=mode,
                     attention=services.attention, hooks=(*hooks, interrupt))

    clock, watch, modes, succeeded = _StepClock(device), _FiniteWatch(device, sigmas, model, record), [], False
    denoiser = FlowDenoiser(forward, dtype=dtype, device=device, use_cfg=use_cfg, cfg=spec.cfg, grid=grid,
                            mode_of=mode_of, clock=clock, modes=modes,
                            on_call=None if spec.sampler is None else services.callback,
                            reads_sigma=any(part.reads_sigma() for part in parts))
    sampler = _sampler(spec, services, phases, caches if cached else None, clock, watch)
    try:
        latents = sampler(denoiser, sigmas, noise, init, mask)
        watch.finish()
        succeeded = True
    finally:
        for part in parts:
            part.close()
        if caches is not None:
            caches.close(succeeded, notes)
    facts.caches, facts.active_steps = caches, sum(phases) if spec.sampler is None else None
    report = _report(model, prefixes, grid, batch, sigmas, clock, modes, caches, prefix_key)
    for part in parts:
        part.finish(report, notes, facts)
    if spec.sampler is not None:
        report["model_calls"] = len(modes)
    if notes:
        report["notes"] = notes
    return SampleResult(latents, report)


def _guidance(spec: RunSpec, notes: list) -> bool:
    """Whether the run uses true CFG (a negative prompt and cfg > 1); what is ignored goes to `notes`."""
    if not spec.cfg >= 1.0:
        raise ValueError(f"cfg must be >= 1 (1 disables guidance); got {spec.cfg}.")
    use_cfg = spec.negative is not None and spec.cfg > 1.0
    if spec.negative is not None and not use_cfg:
        notes.append("negative prompt ignored: true CFG needs cfg > 1")
    elif spec.cfg > 1.0 and spec.negative is None:
        notes.append(f"cfg {spec.cfg} ignored: true CFG needs a negative prompt")
    return use_cfg


def _start(spec: RunSpec, batch: int, grid) -> tuple:
    """(the start latent, the noise mask) of img2img / inpainting, checked; (None, None) for text-to-image."""
    init = None if spec.latent_image is None else _match(spec.latent_image, batch, grid, "latent_image")
    mask = None if spec.noise_mask is None else _match(spec.noise_mask, batch, grid, "noise_mask", channels=1)
    if mask is not None and init is None:
        raise ValueError("a noise_mask needs the latent_image it keeps outside the mask.")
    if init is None and not spec.add_noise:
        raise ValueError("add_noise off needs a latent_image: the already-noised latent to continue from.")
    return init, mask


def _sampler(spec: RunSpec, services: RunServices, phases: list, caches, clock, watch):
    """The run's sampler over the denoiser: the built-in Euler (a phase's cache freed after its last step), or the
    SAMPLER given (which undoes the noise scaling itself)."""
    if spec.sampler is None:
        last_of = {phase: i for i, phase in enumerate(phases)}

        def after_call(i: int) -> None:  # the last step of a phase: its cache is no longer read
            if caches is not None and i == last_of[phases[i]]:
                caches.done_with(phases[i])

        return BuiltinEuler(add_noise=spec.add_noise, clock=clock, watch=watch, callback=services.callback,
                            after_call=after_call)

    def run_given(denoiser, sigmas, noise, latent, mask):
        final = run_sampler(spec.sampler, denoiser, sigmas, noise, latent, mask, spec.add_noise)
        watch.check(final, len(phases) - 1)
        return final
    return run_given


def _report(model, prefixes, grid, batch: int, sigmas, clock, modes, caches, prefix_key) -> dict:
    """The report's keys every run has (tokens, cache, timings); the features add theirs."""
    times = clock.seconds()  # the run's one host sync on a GPU
    prefill_seconds = next((t for t, mode in zip(times, modes) if mode == "prefill"), None)
    step_times = [t for t, mode in zip(times, modes) if mode != "prefill"]
    prefix_rows = sum(p.layout.prefix_len for p in prefixes)
    cached = caches is not None
    held_rows = caches.held_rows if cached else prefix_rows  # a partial window's two caches hold every row each
    computed_rows = caches.computed_rows if cached else prefix_rows
    return {
        "prefix_tokens": prefix_rows,
        "target_tokens": grid[0] * grid[1],
        "batch": batch,
        "steps": sigmas.numel() - 1,
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
