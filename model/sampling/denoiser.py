"""The DiT as a flow-matching denoiser `denoise(x, sigma) -> x0`, for samplers written against that interface
(ComfyUI's SAMPLER objects and k-diffusion functions, through nodes/bridge.py).

Flow matching with CONST noise scaling: the latent at sigma s is `x = s * noise + (1 - s) * x0`, the DiT predicts
the velocity `v = noise - x0` at timestep s, so `x0 = x - s * v`. Any sampler that only asks for x0 at the sigmas
it chooses (Euler, Heun, DPM++, UniPC, ancestral and SDE ones) then runs over our model unchanged.

The prefix cache is the run's (loop.py `sample` owns it, from its first model call to its freeing): the first call
fills it (prefill), every later call reads it, whatever sigma it asks for and however many calls a step makes. True
CFG stays one batched forward over both prompts.
"""

import time

import torch
from einops import rearrange

from .flow_schedulers import flux_shift
from .schedule import transformer_timestep


class FlowModelSampling:
    """What ComfyUI's samplers read from a model's `model_sampling`: a flux-style flow model (CONST noise scaling,
    timestep = sigma) whose sigmas are `flux_shift(mu, t)`. `mu` = the official shift for the image size (Base),
    0 (the identity) for Turbo's stored grid. With ComfyUI the bridge mixes ComfyUI's CONST class in, so the
    samplers' `isinstance(..., CONST)` checks pick their flow-matching branches."""

    TABLE = 10_000

    def __init__(self, mu: float = 0.0):
        self.shift = float(mu)
        self.sigmas = flux_shift(self.shift, torch.arange(1, self.TABLE + 1) / self.TABLE)

    @property
    def sigma_min(self) -> torch.Tensor:
        return self.sigmas[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        return self.sigmas[-1]

    def timestep(self, sigma):
        return sigma

    def sigma(self, timestep):
        return flux_shift(self.shift, timestep)

    def percent_to_sigma(self, percent: float) -> float:
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return flux_shift(self.shift, torch.tensor(1.0 - percent)).item()

    # -- CONST noise scaling ---------------------------------------------------------------------------------
    @staticmethod
    def _shaped(sigma, like: torch.Tensor) -> torch.Tensor:
        sigma = torch.as_tensor(sigma, device=like.device)
        return sigma.reshape(()) if sigma.numel() == 1 else sigma.reshape(-1, *([1] * (like.ndim - 1)))

    def calculate_input(self, sigma, noise):
        return noise

    def calculate_denoised(self, sigma, model_output, model_input):
        return model_input - model_output * self._shaped(sigma, model_output)

    def noise_scaling(self, sigma, noise, latent_image, max_denoise=False):
        sigma = self._shaped(sigma, noise)
        return sigma * noise + (1.0 - sigma) * latent_image

    def inverse_noise_scaling(self, sigma, latent):
        return latent / (1.0 - self._shaped(sigma, latent))


def sigma_rows(sigma, batch: int) -> torch.Tensor:
    """A sampler's sigma (a float, a 0-d tensor or one per sample) as fp32 `(batch,)`, where it was given (a
    float: on the CPU). A sigma on a GPU stays there: reading it here would be a host sync on every model call, which
    also keeps a cached step from running as a CUDA graph; its values are checked on the host only when it is there
    (a NaN sigma on a GPU shows up as NaN latents, which the loop's finite check reports)."""
    sigma = torch.as_tensor(sigma).detach().to(torch.float32).reshape(-1)
    if sigma.numel() not in (1, batch):
        raise ValueError(f"the sampler passed {sigma.numel()} sigmas for a batch of {batch}.")
    if sigma.device.type == "cpu" and (not torch.isfinite(sigma).all() or (sigma < 0).any()):
        raise ValueError(f"the sampler asked for the model at sigma {sigma.tolist()}; flow sigmas are >= 0.")
    return sigma.expand(batch)


class FlowDenoiser:
    """`denoiser(x, sigma) -> x0` over the DiT, `x` `(B, 64, h, w)` normalised latents (any float dtype, fp32
    result). `parts(x, sigma)` also gives the unguided predictions (CFG++ samplers read them).

    `forward(packed_x, t, mode, sigma)` runs the model (CFG rows batched) in the mode `mode_of(sigma)` says: the
    loop's, which owns the cache ("prefill" until the cache that sigma reads is filled, then "cached"; "uncached"
    with the cache off), whatever sigma a sampler asks for and however many calls a step makes. `on_call(info)` runs
    after every call (progress, previews, interrupt); `clock`/`modes` record the calls' times and modes for the
    report. `mode_of` and `forward` get sigma as a float only when `reads_sigma` (a control window or a step cache
    decides by it);
    otherwise they get None and a sigma on the GPU is never copied to the host."""

    def __init__(self, forward, *, dtype, device, use_cfg: bool, cfg: float, grid, mode_of, clock=None, modes=None,
                 on_call=None, reads_sigma: bool = True):
        self.forward, self.dtype, self.device, self.mode_of = forward, dtype, device, mode_of
        self.reads_sigma = reads_sigma
        self.use_cfg, self.cfg, self.grid = use_cfg, float(cfg), tuple(grid)
        self.clock, self.modes = clock, modes if modes is not None else []
        self.on_call = on_call
        self.step = 0  # the sampler step the calls belong to (moved on by the sampler's own callback)
        self.total_steps = None

    @property
    def calls(self) -> int:
        return len(self.modes)

    def __call__(self, x: torch.Tensor, sigma) -> torch.Tensor:
        return self.parts(x, sigma)[0]

    def parts(self, x: torch.Tensor, sigma):
        """(guided x0, positive x0, negative x0) fp32 `(B, 64, h, w)`; without CFG all three are the same."""
        if x.ndim != 4 or tuple(x.shape[-2:]) != self.grid:
            raise ValueError(f"the sampler passed latents of shape {tuple(x.shape)}; expected (B, 64, "
                             f"{self.grid[0]}, {self.grid[1]}).")
        started = self.clock.start() if self.clock is not None else time.perf_counter()
        packed = rearrange(x, "b c h w -> b (h w) c").to(device=self.device, dtype=self.dtype)
        sig, v, v_pos, v_neg = self._call(packed, sigma)
        x32 = x.to(self.device, torch.float32)
        shaped = sig.to(self.device).view(-1, 1, 1, 1)

        def clean(velocity):
            return x32 - shaped * rearrange(velocity.float(), "b (h w) c -> b c h w", h=self.grid[0])

        guided = clean(v)
        cond, uncond = (clean(v_pos), clean(v_neg)) if self.use_cfg else (guided, guided)
        if self.clock is not None:
            self.clock.stop(started)
        if self.on_call is not None:
            step = self.step if self.total_steps is None else min(self.step, self.total_steps - 1)
            self.on_call(CallInfo(self.calls - 1, step, self.total_steps, sig[0], guided))
        return guided, cond, uncond

    def velocity(self, packed: torch.Tensor, sigma) -> torch.Tensor:
        """The guided velocity `(B, T, 64)` in the model's dtype for packed latents `(B, T, 64)` (the built-in Euler
        sampler's question, euler.py); no clock and no `on_call`: that sampler times and reports its own steps."""
        return self._call(packed, sigma)[1]

    def _call(self, packed: torch.Tensor, sigma):
        """The model call: `(sigma rows, guided v, positive v, negative v)`; the mode is recorded in `modes`."""
        sig = sigma_rows(sigma, packed.shape[0])
        host_sigma = float(sig[0]) if self.reads_sigma else None
        mode = self.mode_of(host_sigma)
        self.modes.append(mode)
        t = transformer_timestep(sig, self.dtype).to(self.device)  # rounded through the dtype, as the reference
        t = torch.cat([t, t]) if self.use_cfg else t
        v = self.forward(packed, t, mode, host_sigma)
        v_pos = v_neg = v
        if self.use_cfg:
            v_pos, v_neg = v.chunk(2)
            v = v_neg + self.cfg * (v_pos - v_neg)
        return sig, v, v_pos, v_neg

    def step_done(self, step: int) -> None:
        """The sampler reported step `step` (0-based): later calls belong to the next one."""
        self.step = step + 1


class CallInfo:
    """One model call, for progress and previews: `step` is the sampler step it belongs to (0-based), `denoised`
    the guided x0 `(B, 64, h, w)` fp32, `sigma` a float (read from the device only when asked for)."""

    __slots__ = ("call", "step", "total", "_sigma", "denoised")

    def __init__(self, call, step, total, sigma, denoised):
        self.call, self.step, self.total, self._sigma, self.denoised = call, step, total, sigma, denoised

    @property
    def sigma(self) -> float:
        return float(self._sigma)


def run_sampler(sampler, denoiser: FlowDenoiser, sigmas: torch.Tensor, noise: torch.Tensor,
                latent: torch.Tensor | None, mask: torch.Tensor | None, add_noise: bool) -> torch.Tensor:
    """Run `sampler(denoiser, sigmas, noise, latent, mask) -> x` (fp32 `(B, 64, h, w)`, noise scaling and its
    inverse done by the sampler as ComfyUI's KSAMPLER does) with ComfyUI's inputs: `noise` (zeros when
    `add_noise` is off: the latent is already noised), `latent` (zeros without one), `mask` (1 = repaint). The
    kept region of a masked run that reaches sigma 0 ends as the input latent exactly, as in loop.py."""
    device = denoiser.device
    denoiser.total_steps = sigmas.numel() - 1
    noise = noise.to(device, torch.float32) if add_noise else torch.zeros_like(noise, device=device)
    latent = torch.zeros_like(noise) if latent is None else latent.to(device, torch.float32)
    mask = None if mask is None else mask.to(device, torch.float32)
    x = sampler(denoiser, sigmas.to(device), noise, latent, mask)
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(noise.shape):
        raise ValueError(f"the sampler returned {type(x).__name__} {tuple(getattr(x, 'shape', ()))}; expected "
                         f"latents of shape {tuple(noise.shape)}.")
    x = x.to(device, torch.float32)
    if mask is not None and float(sigmas[-1]) == 0.0:
        x = x * mask + latent * (1.0 - mask)
    return x
