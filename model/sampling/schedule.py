"""Sampling schedules of Qwen-Image 2.1: Base (resolution-shifted), Turbo (stored grid), custom sigmas.

Everything returns fp32 sigma tensors that end with a terminal 0, as diffusers' FlowMatchEulerDiscreteScheduler
stores them. The Base schedule is computed in fp32 with the same operation order as that scheduler (which runs
in numpy fp32), so the values agree bit for bit rather than merely to a tolerance.
"""

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..vae.latents import latent_tokens


@dataclass(frozen=True)
class BaseScheduleConfig:
    """The released Base `scheduler_config.json` (exponential dynamic shifting, shift 1.0)."""

    num_train_timesteps: int = 1000  # timestep = sigma * 1000 (the DiT's time scale)
    base_shift: float = 0.5  # mu at base_image_seq_len target tokens
    max_shift: float = 0.9  # mu at max_image_seq_len target tokens (the line extrapolates beyond)
    base_image_seq_len: int = 256  # 256x256 px
    max_image_seq_len: int = 8192  # e.g. 2048x1024 px
    shift_terminal: float | None = 0.02  # last non-zero sigma; None or 0 disables the stretch


BASE_CONFIG = BaseScheduleConfig()

# Turbo's `model_index.json` `sample_sigmas`: used as stored (its scheduler has no shift and no terminal stretch).
TURBO_SIGMAS = (1.0, 0.978453, 0.954180, 0.926626, 0.895080, 0.845148, 0.704534, 0.414568)

#: Sigmas, timesteps and the Euler update are fp32 whatever the model computes in, as diffusers keeps them.
SIGMA_DTYPE = torch.float32


def schedule_mu(tokens: int, config: BaseScheduleConfig = BASE_CONFIG) -> float:
    """Shift `mu` (a Python float), linear in the token count and extrapolated outside the configured range.

    Written in slope/intercept form, the order diffusers' `calculate_shift` uses, so `mu` is the same double.
    """
    slope = (config.max_shift - config.base_shift) / (config.max_image_seq_len - config.base_image_seq_len)
    intercept = config.base_shift - slope * config.base_image_seq_len
    return tokens * slope + intercept


def base_sigmas(steps: int, width: int, height: int, config: BaseScheduleConfig = BASE_CONFIG) -> torch.Tensor:
    """Base schedule: fp32 tensor of shape `(steps + 1,)`, from 1.0 down to `shift_terminal`, then 0.

    Same values as the Qwen-Image 2.1 diffusers pipeline (`sigmas = linspace(1, 1/N, N)`, `mu` from the target
    tokens) fed to FlowMatchEulerDiscreteScheduler with the released config. One exception: `steps=1`, where the
    reference divides 0 by 0 in the terminal stretch and returns NaN; here it gives [1, 0] (see below).
    """
    _check_steps(steps)
    mu = schedule_mu(latent_tokens(width, height), config)
    # The grid is made in float64 (numpy linspace in the pipeline) and rounded to fp32 by the scheduler.
    t = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64).to(SIGMA_DTYPE)
    # Exponential time shift s = e^mu / (e^mu + (1/t - 1)), in fp32. e^mu is made an fp32 tensor on purpose:
    # `python_float / tensor` would run as reciprocal-then-multiply (two roundings), unlike numpy's one division.
    e_mu = torch.tensor(math.exp(mu), dtype=SIGMA_DTYPE)
    s = e_mu / (e_mu + (torch.reciprocal(t) - 1.0))
    if config.shift_terminal:
        # Stretch so the last sigma lands on shift_terminal while the first stays 1: with z = 1 - s,
        # sigma = 1 - z / k, k = z[-1] / (1 - shift_terminal).
        z = 1.0 - s
        k = z[-1] / torch.tensor(1.0 - config.shift_terminal, dtype=SIGMA_DTYPE)
        # steps=1: the only grid point is t=1, so z = [0] and k = 0. diffusers computes 0/0 = NaN there (numpy
        # warns, nothing raises) and would sample from a NaN timestep. A single point cannot both start at 1 and
        # end at shift_terminal; we keep the start (pure noise) and skip the stretch, i.e. one step 1 -> 0.
        if k > 0:
            s = 1.0 - z / k
    return torch.cat([s, torch.zeros(1, dtype=SIGMA_DTYPE)])


def turbo_sigmas(steps: int = 8) -> torch.Tensor:
    """Turbo schedule: the stored 8 sigmas + 0, fp32 shape `(9,)`, at any resolution (no shift, no stretch).

    Same as diffusers' Turbo pipeline (`sample_sigmas` through a scheduler with shift 1 and no terminal stretch).
    The distilled model was trained for exactly this grid, so any other step count is refused.
    """
    if steps != len(TURBO_SIGMAS):
        raise ValueError(
            f"The Turbo schedule is the stored {len(TURBO_SIGMAS)}-sigma grid; steps={steps} was asked for. "
            "Use the Base sampler for other step counts, or pass custom sigmas."
        )
    return torch.tensor(TURBO_SIGMAS + (0.0,), dtype=SIGMA_DTYPE)


def custom_sigmas(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Validate explicit sigmas; return a 1-D fp32 tensor of them ending in one 0 (appended if not given).

    Used exactly as given (unlike diffusers' `sigmas=` argument, which still goes through the scheduler's shift
    and stretch; this matches ComfyUI's ManualSigmas). Rules, checked after rounding to fp32 (what is used):
    at least one non-zero value, all finite, in (0, 1] except a final 0, strictly decreasing.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().flatten().tolist()
    try:
        given = [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ValueError(f"Custom sigmas must be numbers; got {values!r}.") from err
    if not given:
        raise ValueError("Custom sigmas are empty; give at least one value in (0, 1].")
    sig = torch.tensor(given, dtype=SIGMA_DTYPE)
    for i, (g, v) in enumerate(zip(given, sig.tolist())):
        if not math.isfinite(g):
            raise ValueError(f"Custom sigma {i} is {g}; every sigma must be finite.")
        if v == 0.0 and i == len(given) - 1 and i > 0:
            continue  # the terminal 0 may be given explicitly
        if not 0.0 < v <= 1.0:
            raise ValueError(f"Custom sigma {i} is {g}; sigmas must lie in (0, 1] (only a final 0 is allowed).")
        if i > 0 and v >= sig[i - 1].item():
            raise ValueError(
                f"Custom sigmas must be strictly decreasing; sigma {i} = {g} follows sigma {i - 1} = {given[i - 1]}"
                + (" (equal in fp32)." if g < given[i - 1] else ".")
            )
    if sig[-1].item() != 0.0:
        sig = torch.cat([sig, torch.zeros(1, dtype=SIGMA_DTYPE)])
    return sig


MAX_SIGMAS = 10_001  # ComfyUI's samplers take at most 10,000 steps


def _few(sig: torch.Tensor, count: int = 12) -> str:
    """The first `count` values of a schedule for a message (a 10,000-value one is not echoed whole)."""
    shown = ", ".join(f"{v:g}" for v in sig[:count].tolist())
    return f"[{shown}{f', ... ({sig.numel():,} values)' if sig.numel() > count else ''}]"


def literal_sigmas(values, name: str = "sigmas") -> torch.Tensor:
    """Sigmas used exactly as given (ComfyUI's SIGMAS), fp32 `(n,)`: at least two values (one step), all finite,
    in [0, 1] and strictly decreasing. Unlike `custom_sigmas` nothing is appended: a schedule that ends above 0
    stops there (the first half of a split schedule)."""
    sig = torch.as_tensor(values).detach()
    if sig.dim() > 8 or sum(size > 1 for size in sig.shape) > 1:  # a batch or grid: flattening would make up one
        raise ValueError(f"{name} must be one schedule (a 1-D list of sigmas); got shape {list(sig.shape)[:8]}.")
    if sig.numel() > MAX_SIGMAS:  # before the copy: a link may carry any tensor
        raise ValueError(f"{name} holds {sig.numel():,} values; at most {MAX_SIGMAS:,} are run ({MAX_SIGMAS - 1:,} "
                         "steps, as many as ComfyUI's own samplers take).")
    sig = sig.to("cpu", SIGMA_DTYPE).flatten()
    if sig.numel() < 2:
        raise ValueError(f"{name} holds {sig.numel()} value(s); a schedule needs at least two (one step).")
    if not torch.isfinite(sig).all():
        raise ValueError(f"{name} holds NaN or infinite values: {_few(sig)}.")
    if sig.min() < 0 or sig.max() > 1:
        raise ValueError(f"{name} must lie in [0, 1] (flow matching: 1 is pure noise, 0 the clean image); got "
                         f"{_few(sig)}.")
    steps_up = (sig[1:] >= sig[:-1]).nonzero()
    if steps_up.numel():
        i = int(steps_up[0]) + 1
        raise ValueError(f"{name} must be strictly decreasing; value {i} ({sig[i].item():g}) follows "
                         f"{sig[i - 1].item():g}. Use FlipSigmas on an ascending schedule.")
    return sig


def transformer_timestep(sigma: float | torch.Tensor, dtype: torch.dtype, num_train_timesteps: int = 1000):
    """Timestep the DiT receives for `sigma`: a tensor of `dtype`, shaped like `sigma` (0-d for a float).

    Mirrors the reference pipeline: scheduler timestep `T = sigma * 1000` in fp32, cast to the latent dtype,
    then divided by 1000 in that dtype. For bf16 that rounds twice (e.g. sigma 0.986964 -> T 988 -> 0.988281);
    for fp32 it returns sigma up to one fp32 rounding. Runs on `sigma`'s device, as the reference op does.
    """
    t = torch.as_tensor(sigma, dtype=SIGMA_DTYPE) * num_train_timesteps
    return t.to(dtype) / num_train_timesteps


def euler_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """One flow-matching Euler step `x + (sigma_next - sigma) * v`, returned in `x`'s dtype.

    Bit for bit what diffusers' FlowMatchEulerDiscreteScheduler.step returns when `x` and `v` share a dtype
    (it casts to `v`'s dtype; its pipeline keeps both equal): `x` is upcast to fp32 and the sum is fp32, but
    `dt * v` takes `v`'s dtype, because a 0-d fp32 `dt` does not promote a bf16 tensor. The sigmas are put on
    `x`'s device as fp32 0-d tensors, so the device-specific kernels are the reference's too.
    """
    sigma = torch.as_tensor(sigma, dtype=SIGMA_DTYPE, device=x.device)
    sigma_next = torch.as_tensor(sigma_next, dtype=SIGMA_DTYPE, device=x.device)
    dt = sigma_next - sigma
    return (x.to(SIGMA_DTYPE) + dt * v).to(x.dtype)


def _check_steps(steps) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1; got {steps!r}.")
