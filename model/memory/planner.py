"""The memory planner: where each part of a run goes, chosen before anything moves.

Given what the device and the host can give (`Budget`), the weights as they are stored (`LayeredWeights`: bytes
per block and of everything else, counted from the real tensors, so fp8, int8 and GGUF weights count at their
stored size), the run (`RunShape`: prefix tokens, target tokens, batch, CFG) and the decode size, it predicts the
device peak of every phase and picks the fastest plan that fits:

    text encode   the text encoder whole on the device, or its decoder layers streamed (`plan_encoder`)
    prefill       the DiT weights resident, or streamed: k of N blocks resident, the other N - k in pinned host
    cached steps  memory, copied to the device one block ahead on a side stream (`streaming.LayerStreamer`);
                  the prefix cache on the device, or in pinned host memory streamed in per layer
    decode        the VAE in one pass (what the reference does), tiled only when one pass would not fit

"Fastest" is measured in bytes copied from the host per denoising step: streaming n >= 3 blocks copies n blocks
per step (with n <= 2 both stay in the two device slots after the first step, so they cost nothing after it), a
host-side cache copies its whole payload per cached step. Among plans that copy the same, the one with more
blocks resident wins. Phases are sequential and the host (ComfyUI, or our own offloading) releases one phase's
model before the next needs the room, so each phase must fit on its own.

The DiT's run terms are `memory.estimate_run`'s (the same formula the sampler's refusal used before), plus what
that estimate leaves to the planner: the weights on the device, the K/V concatenation of the target attention
off the CPU, and a fixed allowance for cuBLAS workspaces and allocator rounding. A run that fits no plan gets a
`PlanError` before any weight moves, naming the smallest memory that would run it and what to change.

Nothing here touches a device: every number comes in through the arguments, so the tables in the README and the
tests run on any machine (`benchmarks/memory.py plan-table`).
"""

import math
from dataclasses import dataclass, field, replace

from ..prefix_cache.storage_formats import CACHE_DEVICES, DECODE_ROWS, cache_row_bytes
from ..transformer.dit import DiTConfig
from .estimate import FP32, GIB, RunEstimate, VAEShape, decode_transient, estimate_run
from .slots import STREAM_SLOTS
from .weights import LINEAR_ITEMSIZE, LayeredWeights, synthetic_dit_weights

MIB = 2**20
#: Added to every device phase off the CPU: cuBLAS/cuDNN workspaces, the caching allocator's rounding.
DEVICE_OVERHEAD = 256 * MIB
#: A forward's transient on a CPU over `estimate_run`'s (which GPU peaks calibrated: its caching allocator reuses
#: each freed block at once): the process's anonymous memory (RssAnon) grew by 1.95-2.1 x the estimate in a bf16 run
#: on this pack's CPU (benchmarks/memory.py host, cpu-bf16, at widths 768 and 1024; docs/measurements.md).
CPU_STEP_FACTOR = 2
#: What the loader's `plan` input may ask for: the fastest plan that fits, every block resident, every block streamed.
PLAN_CHOICES = ("auto", "resident", "stream")
#: ComfyUI's VRAM modes as the bridge reports them: normal, low (--lowvram), no (--novram), high (--highvram).
VRAM_MODES = ("normal", "low", "no", "high")


class PlanError(MemoryError):
    """No plan for this run fits the memory it has; raised before any weight moves."""


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


# -- budget and run --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    """What a run may use.

    Attributes:
        device: bytes on the compute device, its own weights included (what is free plus what the host would
            evict for it, minus the reserve).
        host: bytes of host memory for streamed weights and a host-side cache (None: unknown, not checked).
        unified: the device is the host (a CPU): streaming would only copy memory to itself.
        where: the device, for messages.
        mode: ComfyUI's VRAM mode, one of `VRAM_MODES`.
        reserve: bytes kept back for other programs (ComfyUI's --reserve-vram), already taken off `device`.
        held: bytes of `device` the model being planned already holds (counted in `device`; messages say what is
            free besides them).
    """

    device: int
    host: int | None = None
    unified: bool = False
    where: str = "cuda"
    mode: str = "normal"
    reserve: int = 0
    held: int = 0

    def __post_init__(self):
        if self.mode not in VRAM_MODES:
            raise ValueError(f"mode must be one of {VRAM_MODES}, got {self.mode!r}.")

    @classmethod
    def gpu(cls, card_bytes: int, host_bytes: int | None = 64 * GIB, reserve: int = 400 * MIB,
            context: int = 600 * MIB) -> "Budget":
        """A whole GPU of `card_bytes` as the tables assume it: minus the CUDA context and ComfyUI's reserve."""
        return cls(card_bytes - reserve - context, host_bytes, where=f"a {card_bytes / GIB:.0f} GiB GPU",
                   reserve=reserve)


@dataclass(frozen=True)
class RunShape:
    """One sampling run: what its memory depends on.

    Attributes:
        prefix_tokens: tokens of each distinct prompt's prefix (text + references; two with CFG).
        grid: the target's latent grid (h, w): h * w target tokens.
        batch: images per run.
        cfg: true CFG (two passes per step, batched).
        prefix_cache: whether the prefix is cached.
        reference_tokens: latent tokens of each reference of the positive prompt (for the advice in errors).
        cache_layers: layers the run's prefix caches hold together (None: the DiT's blocks). A Fun ControlNet adds
            its blocks' layers, and a partial window a plain cache beside the controlled one (prefix_cache/
            lifecycle.py).
        extra_row_buffers: `(rows, width)` buffers a step holds besides the DiT's (a control stream: 3).
        cache_dtype: how the cache stores its rows ("default": the compute dtype; "int8" / "int4": quantized,
            scales included; prefix_cache/storage_formats.py).
        step_cache: the step cache's mode ("off", "t8", "extrapolate", "taylor"; sampling/step_cache.py): it
            holds fp32 target-sized tensors across the blocks (`step_cache_bytes`).
    """

    prefix_tokens: tuple[int, ...]
    grid: tuple[int, int]
    batch: int = 1
    cfg: bool = False
    prefix_cache: bool = True
    reference_tokens: tuple[int, ...] = ()
    cache_layers: int | None = None
    extra_row_buffers: int = 0
    cache_dtype: str = "default"
    step_cache: str = "off"

    @property
    def target_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @classmethod
    def released(cls, size: int = 1024, references: int = 0, text_tokens: int = 75, batch: int = 1,
                 cfg: bool = False, reference_size: int = 1024) -> "RunShape":
        """A `size` x `size` run with `references` references of `reference_size`^2 and a `text_tokens` prompt."""
        ref = (reference_size // 16) ** 2
        prefix = text_tokens + references * ref
        return cls((prefix,) * (2 if cfg else 1), (size // 16, size // 16), batch, cfg,
                   reference_tokens=(ref,) * references)


# -- plans -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Where a sampling run puts its parts, and the device peak predicted for each phase.

    Attributes:
        streamed: indices of the blocks that are streamed (empty: all resident).
        blocks: N, the model's block count.
        cache: "device", "host" (pinned host memory, streamed in per layer) or "off".
        decode: "one-pass" or "tiled" (predicted for the released VAE when the run does not know its VAE).
        phases: predicted device peak per phase, in bytes ("prefill", "cached" or "uncached", "decode").
        budget: what the plan was made for.
        store_budget: bytes the kept-cache store may hold beside this run (device, or host with a host cache).
        copied_per_step: bytes copied from the host per step (0: nothing streamed after the first step).
        host_bytes: host memory the plan pins (streamed blocks, a host-side cache).
        cache_bytes: the prefix caches' predicted bytes (as stored: a quantized cache's bytes and scales).
        cache_dtype: how the cache stores its rows (`RunShape.cache_dtype`).
    """

    streamed: tuple[int, ...]
    blocks: int
    cache: str
    decode: str
    phases: dict = field(default_factory=dict)
    budget: Budget | None = None
    store_budget: int = 0
    copied_per_step: int = 0
    host_bytes: int = 0
    cache_bytes: int = 0
    cache_dtype: str = "default"

    @property
    def weights(self) -> str:
        return "streamed" if self.streamed else "resident"

    @property
    def resident_blocks(self) -> int:
        return self.blocks - len(self.streamed)

    @property
    def weights_label(self) -> str:
        return f"streamed {self.resident_blocks}/{self.blocks}" if self.streamed else "resident"

    @property
    def sampling_peak(self) -> int:
        return max(v for k, v in self.phases.items() if k != "decode")

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    def report(self) -> dict:
        """The sampler report's `plan` entry."""
        return {"weights": self.weights_label, "cache": self.cache, "decode": self.decode,
                "predicted_peak_bytes": int(self.sampling_peak),
                "phases": {k: int(v) for k, v in self.phases.items()},
                "cache_bytes": int(self.cache_bytes), "cache_dtype": self.cache_dtype}

    def describe(self) -> str:
        phases = ", ".join(f"{k} {gib(v)}" for k, v in self.phases.items())
        return f"weights {self.weights_label}, cache {self.cache}, decode {self.decode} ({phases})"


@dataclass(frozen=True)
class LayerPlan:
    """A model run once per call with its layers resident or some streamed (the text encoder)."""

    streamed: tuple[int, ...]
    layers: int
    peak: int

    @property
    def label(self) -> str:
        return f"streamed {self.layers - len(self.streamed)}/{self.layers}" if self.streamed else "resident"


def spread(count: int, total: int) -> tuple[int, ...]:
    """`count` of `total` layer indices spread evenly (streamed layers between resident ones leave the copies time)."""
    if count <= 0:
        return ()
    if count >= total:
        return tuple(range(total))
    return tuple(sorted({min(total - 1, int((i + 0.5) * total / count)) for i in range(count)}))


def run_estimate(config: DiTConfig, run: RunShape, itemsize: int, cached: bool = True, prefix=None) -> RunEstimate:
    """`estimate_run` for this run: its caches' layers (`run.cache_layers`) and a control stream's buffers."""
    prefix = list(run.prefix_tokens) if prefix is None else list(prefix)
    full = estimate_run(config, prefix, run.target_tokens, run.batch, run.cfg, itemsize, cached)
    layers = run.cache_layers or config.num_layers
    cache = full.cache * layers // config.num_layers
    if run.cache_dtype != "default" and cache:  # rows as stored: quantized bytes and their scales
        cache = 2 * layers * sum(prefix) * cache_row_bytes(run.cache_dtype, config.width, itemsize)
    return replace(full, cache=cache, step=full.step + run.extra_row_buffers * full.rows * config.width * itemsize)


def storage_transient(config: DiTConfig, run: RunShape, itemsize: int) -> int:
    """What a quantized cache adds to a step that reads or writes it: every prefix's keys and values of one layer
    dequantized into the compute dtype for the target attention, and the layout's fp32 temporaries of one block of
    rows (`DECODE_ROWS`; quantizing works in smaller blocks). 0 for the default storage."""
    if run.cache_dtype == "default" or not run.prefix_tokens:
        return 0
    width = config.width
    return 2 * sum(run.prefix_tokens) * width * itemsize + 2 * DECODE_ROWS * width * FP32


def step_cache_bytes(config: DiTConfig, run: RunShape, itemsize: int, prefill: bool = False) -> tuple[int, int]:
    """(bytes the step cache holds while the blocks after block 0 run, bytes it holds at its largest between blocks)
    of one forward; (0, 0) without a step cache. Every tensor is fp32 over the target rows of every sample (both CFG
    halves): `t` = samples x target tokens x width x 4 bytes (step_cache.py):

        across the blocks   block 0's output kept to take the residual from (the anchor), the last full pass's
                            residual, the one before it (extrapolate), and two sampled copies (every 8th row
                            and channel: the indicator now and at the last full pass)
        between blocks      after the last block: the anchor, the old residuals, the new one and the target rows
                            in fp32 (a copy unless the compute dtype is fp32); on a skipped call: the residuals,
                            the fp32 rows, their sum and the extrapolation's two temporaries

    The prefill is a run's first call: no residual yet. The first figure adds to the block transient; the second
    replaces it (the blocks' buffers are gone by then)."""
    if run.step_cache == "off":
        return 0, 0
    samples = run.batch * (2 if run.cfg else 1)
    t = samples * run.target_tokens * config.width * FP32
    sampled = 2 * samples * -(-run.target_tokens // 8) * -(-config.width // 8) * FP32
    extrapolate = run.step_cache in ("extrapolate", "taylor")
    # the residuals of the last full passes: one (t8), two (extrapolate), up to three (taylor: its order + 1, the
    # mode alone reaches the planner, so its largest order is counted)
    kept = 0 if prefill else {"extrapolate": 2, "taylor": 3}.get(run.step_cache, 1)
    copy = int(itemsize != FP32)  # `.float()` of the target rows copies them unless they already are fp32
    across = (1 + kept) * t + sampled
    after = (1 + kept + 1 + copy) * t + sampled
    skipped = 0 if prefill else (kept + copy + 1 + 2 * extrapolate) * t + sampled
    return across, max(after, skipped)


def sampling_phases(weights: LayeredWeights, config: DiTConfig, run: RunShape, itemsize: int,
                    streamed=(), cache: str = "device", unified: bool = False) -> dict[str, int]:
    """Predicted device peak of each sampling phase with these choices (bytes)."""
    prefix = list(run.prefix_tokens)
    cached = cache != "off"
    full = run_estimate(config, run, itemsize, cached)
    targets_only = run_estimate(config, run, itemsize, False, prefix=[])
    # off the CPU each sample's keys and values are [prefix | target] concatenated for the target attention
    concat = 0 if unified else 2 * run.batch * (max(prefix, default=0) + run.target_tokens) * config.width * itemsize
    base = weights.device_bytes(streamed) + full.latents + concat + (0 if unified else DEVICE_OVERHEAD)

    def step(transient: int, prefill: bool = False) -> int:  # one forward's transient with the step cache's tensors
        across, between = step_cache_bytes(config, run, itemsize, prefill)
        return max(transient * (CPU_STEP_FACTOR if unified else 1) + across, between)

    if not cached:
        return {"uncached": base + step(full.step)}
    per_layer = full.cache // (run.cache_layers or config.num_layers)
    on_device = full.cache if cache == "device" else STREAM_SLOTS * per_layer
    quantized = storage_transient(config, run, itemsize)
    return {
        "prefill": base + step(full.step, prefill=True) + (full.cache if cache == "device" else 0) + quantized,
        "cached": base + step(targets_only.step) + on_device + quantized,
    }


def _copied_per_step(weights: LayeredWeights, streamed, cache: str, cache_bytes: int) -> int:
    moved = weights.streamed_bytes(streamed) if len(streamed) > STREAM_SLOTS else 0
    return moved + (cache_bytes if cache == "host" else 0)


def plan_run(weights: LayeredWeights, config: DiTConfig, run: RunShape, budget: Budget, itemsize: int,
             choice: str = "auto", vae: VAEShape | None = None, cache_choice: str = "auto") -> Plan:
    """The fastest plan of a sampling run that fits `budget`; `PlanError` (naming the least memory that would
    run it and what to change) when none does.

    `choice`: "auto"; "resident" (all blocks on the device, or an error); "stream" (every block streamed).
    Under ComfyUI's --lowvram ("low") auto always streams at least three blocks (fewer would sit in the two slots
    and save nothing); under --novram ("no") it streams all and
    keeps the cache in host memory. `vae` (default: the released one in the DiT's dtype) predicts the decode.
    `cache_choice` (the cache options' `device`): "auto", "gpu" (the cache on the device, or an error), "cpu" (in
    pinned host memory, streamed in per layer); "off" is a run without the cache (`run.prefix_cache` False).
    """
    if choice not in PLAN_CHOICES:
        raise ValueError(f"the plan choice must be one of {PLAN_CHOICES}, got {choice!r}.")
    if cache_choice not in CACHE_DEVICES:
        raise ValueError(f"the cache device must be one of {', '.join(CACHE_DEVICES)}, got {cache_choice!r}.")
    n = len(weights.layers)
    vae = vae or VAEShape.released(itemsize)
    cache_bytes = run_estimate(config, run, itemsize).cache
    if not run.prefix_cache or cache_choice == "off":
        caches = ("off",)
    elif cache_choice != "auto":
        caches = ("device",) if cache_choice == "gpu" else ("host",)
    elif budget.unified:
        caches = ("device",)
    elif budget.mode == "no":
        caches = ("host",)
    else:
        caches = ("device", "host")
    if choice == "resident":
        counts = [n]
    elif choice == "stream" or budget.mode == "no":
        counts = [0]
    elif budget.unified:
        counts = [n]
    elif budget.mode == "low":  # stream enough blocks to save memory: up to two fit the slots and save nothing
        counts = list(range(max(0, n - STREAM_SLOTS - 1), -1, -1))
    else:
        counts = list(range(n, -1, -1))

    best = None
    for cache in caches:
        for resident in counts:  # most resident first: the first that fits is the fastest with this cache
            streamed = spread(n - resident, n)
            phases = sampling_phases(weights, config, run, itemsize, streamed, cache, budget.unified)
            host = (0 if budget.unified else weights.streamed_bytes(streamed)) + (cache_bytes if cache == "host" else 0)
            if max(phases.values()) > budget.device or (budget.host is not None and host > budget.host):
                continue
            key = (_copied_per_step(weights, streamed, cache, cache_bytes), len(streamed), cache != "device")
            if best is None or key < best[0]:
                best = (key, streamed, cache, phases, host)
            break
    if best is None:
        raise PlanError(_no_plan_message(weights, config, run, budget, itemsize, choice, vae,
                                         "device" if cache_choice == "gpu" else None))
    (copied, _, _), streamed, cache, phases, host = best
    decode = plan_decode(vae, run.batch, run.grid, budget, must_fit=False)
    phases = {**phases, "decode": decode.peak}
    if cache == "host" and not budget.unified:
        store_budget = max(0, budget.host - host) if budget.host is not None else cache_bytes
    else:
        # the run's own (new or taken) cache is part of its peak already: kept entries get only what is left. On
        # unified memory (a CPU) a host cache is in the same memory but not in the peak (only its slots are)
        sampling_peak = max(v for k, v in phases.items() if k != "decode")
        store_budget = max(0, budget.device - sampling_peak - (cache_bytes if cache == "host" else 0))
    return Plan(streamed, n, cache, decode.label, phases, budget, store_budget, copied, host,
                cache_bytes if cache != "off" else 0, run.cache_dtype)


def least_memory(weights: LayeredWeights, config: DiTConfig, run: RunShape, itemsize: int, unified: bool = False,
                 choice: str = "auto", cache: str | None = None) -> int:
    """The smallest device budget any plan of this run fits: every block streamed and the cache on the host (on a
    CPU, or with `choice="resident"`, the weights stay whole; `cache` forces where the cache is)."""
    streamed = () if unified or choice == "resident" else tuple(range(len(weights.layers)))
    if cache is None:
        cache = "off" if not run.prefix_cache else ("device" if unified else "host")
    return max(sampling_phases(weights, config, run, itemsize, streamed, cache, unified).values())


def _no_plan_message(weights, config, run, budget, itemsize, choice, vae, cache=None) -> str:
    forced = cache if cache == "device" and not budget.unified and run.prefix_cache else None  # device = gpu
    need = least_memory(weights, config, run, itemsize, budget.unified, choice, forced)
    est = estimate_run(config, list(run.prefix_tokens), run.target_tokens, run.batch, run.cfg, itemsize,
                       run.prefix_cache)
    if run.cache_dtype != "default":  # the cache as stored
        est = replace(est, cache=run_estimate(config, run, itemsize, run.prefix_cache).cache)
    if budget.unified:
        lean = "weights resident"
    elif choice == "resident":
        lean = "weights resident (plan = resident)"
    elif forced:
        lean = f"weights streamed 0/{len(weights.layers)}, prefix cache on the device (the cache options' device = gpu)"
    else:
        lean = f"weights streamed 0/{len(weights.layers)}, prefix cache in host memory"
    host_note = ""
    if budget.host is not None and not budget.unified and need <= budget.device:
        host_note = (f" It would fit the device, but streaming needs {gib(weights.total + est.cache)} of host "
                     f"memory and {gib(budget.host)} is available.")
    advice = []
    for what, other_run, other_weights in _alternatives(run, weights, config):
        other = least_memory(other_weights, config, other_run, itemsize, budget.unified, choice, forced)
        if other < 0.95 * need:  # only what makes a real difference
            advice.append(f"{what}: {gib(other)}")
    held = f"; {gib(budget.held)} of it is already there" if budget.held >= 0.05 * GIB else ""
    return (
        f"This run needs at least {gib(need)} on {budget.where} (the leanest plan: {lean}; {est.rows:,} rows per "
        f"step: {gib(est.step)} for one step, {gib(est.cache)} of prefix cache, {gib(est.latents)} of latents, "
        f"{gib(weights.total)} of {weights.label or 'DiT'} weights{held}), but only "
        f"{gib(budget.device - budget.held)} is free on {budget.where}. Lower batch_size, width/height or the number "
        f"of references, or load an int8 / GGUF file of the DiT" + (f" ({'; '.join(advice)})." if advice else ".")
        + host_note
    )


def _alternatives(run: RunShape, weights: LayeredWeights, config: DiTConfig):
    """Smaller versions of a run, each as (what changed, run, weights), for the advice in `PlanError`."""
    out = []
    if run.batch > 1:
        out.append((f"batch_size {run.batch // 2}", replace(run, batch=run.batch // 2), weights))
    h, w = run.grid
    if h * w > 16 * 16:
        half = (max(1, round(h / math.sqrt(2))), max(1, round(w / math.sqrt(2))))
        out.append((f"{half[1] * 16}x{half[0] * 16}", replace(run, grid=half), weights))
    if run.reference_tokens:
        last = run.reference_tokens[-1]
        fewer = replace(run, prefix_tokens=tuple(p - last for p in run.prefix_tokens),
                        reference_tokens=run.reference_tokens[:-1])
        out.append((f"{len(run.reference_tokens) - 1} references", fewer, weights))
    if LINEAR_ITEMSIZE.get(weights.label, (0, 0))[0] > LINEAR_ITEMSIZE["int8"][0]:  # a float file: int8 is smaller
        out.append(("an int8 file", run, synthetic_dit_weights(config, "int8")))
    return out


# -- decode and encode -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodePlan:
    tiled: bool
    peak: int

    @property
    def label(self) -> str:
        return "tiled" if self.tiled else "one-pass"


def plan_decode(vae: VAEShape, batch: int, grid: tuple[int, int], budget: Budget, must_fit: bool = True) -> DecodePlan:
    """One pass when it fits (what the reference does, exactly), tiled otherwise; `PlanError` when neither fits
    (with `must_fit`; else the tiled plan is returned for the record)."""
    overhead = 0 if budget.unified else DEVICE_OVERHEAD
    one = vae.weight_bytes + decode_transient(vae, batch, grid, False) + overhead
    if one <= budget.device:
        return DecodePlan(False, one)
    tiled = vae.weight_bytes + decode_transient(vae, batch, grid, True) + overhead
    if tiled <= budget.device or not must_fit:
        return DecodePlan(True, tiled)
    f = vae.config.spatial_compression
    raise PlanError(
        f"Decoding {batch} image(s) of {grid[1] * f}x{grid[0] * f} needs at least {gib(tiled)} on {budget.where} "
        f"(tiled: {gib(vae.weight_bytes)} of VAE weights, tiles of {vae.tiling.tile * f} px), but only "
        f"{gib(budget.device)} is free on {budget.where}. Decode fewer images at once or a smaller size."
    )


def plan_layers(weights: LayeredWeights, transient: int, budget: Budget, choice: str = "auto",
                what: str = "the text encoder") -> LayerPlan:
    """A model run once per call (the text encoder): all layers resident when they fit beside `transient`, else
    as many as fit (the rest streamed through two slots); `PlanError` when even full streaming does not fit."""
    n = len(weights.layers)
    overhead = 0 if budget.unified else DEVICE_OVERHEAD
    counts = [n] if budget.unified or choice == "resident" else (
        [0] if choice == "stream" or budget.mode == "no" else range(n, -1, -1))
    for resident in counts:
        streamed = spread(n - resident, n)
        peak = weights.device_bytes(streamed) + transient + overhead
        host = 0 if budget.unified else weights.streamed_bytes(streamed)
        if peak <= budget.device and (budget.host is None or host <= budget.host):
            return LayerPlan(streamed, n, peak)
    least = weights.device_bytes(() if budget.unified else range(n)) + transient + overhead
    raise PlanError(
        f"Running {what} needs at least {gib(least)} on {budget.where} ({gib(weights.total)} of weights"
        f"{'' if budget.unified else ', its layers streamed'}, {gib(transient)} of activations), but only "
        f"{gib(budget.device)} is free on {budget.where}. Use a shorter prompt or fewer/smaller references, or "
        "encode on the CPU (the text encoder loader's device = cpu)."
    )
