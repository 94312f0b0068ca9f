"""The denoising loop, which owns the prefix cache from its first step to its last.

    step 1        prefill: the whole sequence runs, every layer's prefix K/V is copied into the cache
    steps 2..N    cached: only the target rows run, attending over [cached prefix | target]
    finally       the cache is freed (success, error or interrupt), or handed to the store (`keep_cache`)

A batch of B seeds shares one prefix copy. True CFG (cfg > 1 with a negative prompt) puts the negative
prompt's prefix next to the positive's in the same cache and runs both halves as one forward; the rows are
ragged, so the two prompts need no padding and the result equals two separate passes.

Numerics follow diffusers' QwenImage21Pipeline: sigmas from `schedule.py`, the timestep rounded through the
latent dtype, the Euler update in fp32, the latents kept in the model's dtype between steps.
"""

import time
from dataclasses import dataclass

import torch

from .cache_store import DEFAULT_STORE, PrefixCacheStore
from .conditioning import Conditioning
from .dit import PrefixInputs, QwenImage21DiT
from .prefix_cache import PrefixKVCache
from .schedule import euler_step, sampling_size, transformer_timestep

LATENT_CHANNELS = 64
VAE_SCALE = 16


class NonFiniteLatentsError(FloatingPointError):
    """The latents became NaN or infinite; raised at the step where it happened instead of decoding black."""


@dataclass(frozen=True)
class StepInfo:
    """Handed to the per-step callback: progress, interrupt checks and previews hook in there."""

    step: int  # 0-based index of the step just finished
    total: int
    sigma: float
    latents: torch.Tensor  # (B, 64, h, w) normalised latents after the step
    denoised: torch.Tensor  # (B, 64, h, w) the model's clean-image estimate at this step, x - sigma * v


@dataclass(frozen=True)
class SampleResult:
    latents: torch.Tensor  # (B, 64, h, w) normalised, in the model's dtype
    report: dict  # the `qi21_report` entry of this run


def initial_noise(seed: int, batch: int, height: int, width: int) -> torch.Tensor:
    """`(B, 64, H/16, W/16)` fp32 noise from a CPU generator seeded with `seed` (ComfyUI's convention, and
    what diffusers draws for a CPU generator with the same seed). Sizes are floored to x32 first."""
    width, height = sampling_size(width, height)
    generator = torch.Generator("cpu").manual_seed(int(seed))
    shape = (batch, LATENT_CHANNELS, height // VAE_SCALE, width // VAE_SCALE)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _pack(latents: torch.Tensor) -> torch.Tensor:
    return latents.flatten(2).transpose(1, 2)  # (B, 64, h, w) -> (B, h*w, 64), row-major tokens


def _unpack(tokens: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], *shape)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
) -> SampleResult:
    """Denoise from noise along `sigmas` (ending in 0); returns normalised latents and the run's report.

    `noise` `(B, 64, H/16, W/16)` overrides `seed`/`batch_size`. `callback(StepInfo)` runs after every step;
    an exception it raises (ComfyUI's interrupt) ends the run with the cache freed. `keep_cache` keeps the
    prefix cache in `store` (default: the process-wide store) for the next run with this conditioning.
    """
    notes = []
    width, height = sampling_size(width, height)
    latent_shape = (height // VAE_SCALE, width // VAE_SCALE)
    if noise is None:
        noise = initial_noise(seed, batch_size, height, width)
    if tuple(noise.shape[1:]) != (LATENT_CHANNELS, *latent_shape):
        raise ValueError(f"noise must be (B, 64, {latent_shape[0]}, {latent_shape[1]}), got {tuple(noise.shape)}.")
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32).flatten()
    steps = sigmas.numel() - 1
    if steps < 1 or sigmas[-1].item() != 0.0:
        raise ValueError(f"sigmas must hold at least one step and end in 0; got {sigmas.tolist()}.")
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
    prefixes = [PrefixInputs(layout=c.layout(latent_shape), text=c.text, references=c.references) for c in conditionings]
    sample_prefix = [0] * batch + ([1] * batch if use_cfg else [])
    cached = bool(prefix_cache) and model.config.causal_condition
    if prefix_cache and not cached:
        notes.append("prefix cache off: this model has causal_condition=false")

    store = store if store is not None else DEFAULT_STORE
    key = store.key(model, *(c.fingerprint() for c in conditionings), dtype=dtype) if cached and keep_cache else None
    cache = store.take(key) if key is not None else None
    hit = cache is not None
    if hit:
        cache.to(device)
    elif cached:
        cache = PrefixKVCache()

    x = _pack(noise).to(device=device, dtype=dtype)
    prefill_seconds, step_times, succeeded = None, [], False
    try:
        for i in range(steps):
            mode = "uncached" if not cached else ("prefill" if i == 0 and not hit else "cached")
            _synchronize(device)
            start = time.perf_counter()
            t = transformer_timestep(sigmas[i], dtype).to(device)
            v = model(torch.cat([x, x]) if use_cfg else x, t, prefixes, sample_prefix,
                      cache=cache if cached else None, mode=mode, attention=attention)
            if use_cfg:
                v_pos, v_neg = v.chunk(2)
                v = v_neg + cfg * (v_pos - v_neg)
            x_before = x
            x = euler_step(x, v, sigmas[i], sigmas[i + 1])
            if not bool(torch.isfinite(x).all()):
                raise NonFiniteLatentsError(
                    f"the latents became NaN/inf at step {i + 1} of {steps} (sigma {sigmas[i].item():.4f}); "
                    "with fp16 weights try bf16 or fp32."
                )
            _synchronize(device)
            elapsed = time.perf_counter() - start
            if mode == "prefill":
                prefill_seconds = elapsed
            else:
                step_times.append(elapsed)
            if callback is not None:
                denoised = x_before.float() - sigmas[i].item() * v.float()
                callback(StepInfo(i, steps, sigmas[i].item(), _unpack(x, latent_shape), _unpack(denoised, latent_shape)))
        succeeded = True
    finally:
        cache_bytes = cache.nbytes if cache is not None else 0
        cache_device = str(cache.device) if cache is not None and cache.filled else None
        if cache is not None:
            if not (succeeded and key is not None and store.put(key, cache, model)):
                cache.free()
            if succeeded and key is not None and not cache.filled:
                notes.append("cache not kept: larger than the store's budget")
        del cache

    report = {
        "prefix_tokens": sum(p.layout.prefix_len for p in prefixes),
        "target_tokens": latent_shape[0] * latent_shape[1],
        "batch": batch,
        "steps": steps,
        "cache": "off" if not cached else ("hit" if hit else "miss"),
        "cache_bytes": cache_bytes,
        "cache_device": cache_device,
        "prefill_seconds": None if prefill_seconds is None else round(prefill_seconds, 4),
        "step_seconds": round(sum(step_times) / len(step_times), 4) if step_times else None,
    }
    if notes:
        report["notes"] = notes
    return SampleResult(_unpack(x, latent_shape), report)

