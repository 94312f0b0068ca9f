"""The built-in sampler: diffusers' flow-matching Euler (QwenImage21Pipeline's loop), as one more sampler over the
model as a flow denoiser (denoiser.py), beside ComfyUI's SAMPLERs.

Every sampler the loop runs is `sampler(denoiser, sigmas, noise, latent, mask) -> latents` (loop.py `sample`): the
denoiser makes the model call (the run's cache mode, the control phase, the step cache, true CFG), the sampler
decides where to call it and what to do with the answer. This one reads the guided velocity itself
(`FlowDenoiser.velocity`) instead of the clean-image estimate, and keeps the latents packed in the model's dtype
between steps, so its numbers are the reference pipeline's: the Euler update in fp32 (`schedule.euler_step`), the
kept region of an inpainting mask re-noised to the next sigma after every step (img2img.py).
"""

from dataclasses import dataclass, field

import torch
from einops import rearrange

from .img2img import finish_latents, start_latents
from .schedule import euler_step


def pack(latents: torch.Tensor) -> torch.Tensor:
    return rearrange(latents, "b c h w -> b (h w) c")  # row-major tokens


def unpack(tokens: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return rearrange(tokens, "b (h w) c -> b c h w", h=shape[0], w=shape[1])


@dataclass(frozen=True)
class StepInfo:
    """Handed to the per-step callback: progress, interrupt checks and previews hook in there. `latents` and
    `denoised` are computed only when read (a progress bar needs neither; a preview needs one)."""

    step: int  # 0-based index of the step just finished
    total: int
    sigma: float
    _after: torch.Tensor = field(repr=False)  # packed latents after the step
    _before: torch.Tensor = field(repr=False)  # packed latents the step started from
    _velocity: torch.Tensor = field(repr=False)
    _grid: tuple[int, int] = field(repr=False)

    @property
    def latents(self) -> torch.Tensor:
        """(B, 64, h, w) normalised latents after the step."""
        return unpack(self._after, self._grid)

    @property
    def denoised(self) -> torch.Tensor:
        """(B, 64, h, w) the model's clean-image estimate at this step, x - sigma * v."""
        return unpack(self._before.float() - self.sigma * self._velocity.float(), self._grid)


class BuiltinEuler:
    """The built-in Euler sampler of one run. `add_noise`: whether `noise` is added to the latent (else the latent is
    already noised); `clock` and `watch` time and check every step; `callback(StepInfo)` runs after each;
    `after_call(i)` after step i's model call (the loop frees a cache no later step reads)."""

    def __init__(self, *, add_noise: bool, clock, watch, callback=None, after_call=None):
        self.add_noise, self.clock, self.watch = add_noise, clock, watch
        self.callback, self.after_call = callback, after_call

    def __call__(self, denoiser, sigmas: torch.Tensor, noise: torch.Tensor, latent: torch.Tensor | None,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """`noise`, `latent` (or None) and `mask` (1 = repaint, or None) fp32 `(B, c, h, w)` on the CPU; returns the
        normalised latents `(B, 64, h, w)` (fp32 where a mask kept a region, else the model's dtype)."""
        device, dtype, grid = denoiser.device, denoiser.dtype, denoiser.grid
        steps = sigmas.numel() - 1
        x0 = start_latents(noise, latent, sigmas[0].item(), self.add_noise)
        kept_noise = noise.float() if self.add_noise else torch.zeros_like(x0)
        x = pack(x0).to(device=device, dtype=dtype)
        if mask is not None:
            mask, latent, kept_noise = (pack(t).to(device) for t in (mask, latent, kept_noise))
        for i in range(steps):
            started = self.clock.start()
            v = denoiser.velocity(x, sigmas[i])
            if self.after_call is not None:
                self.after_call(i)
            x_before = x
            x = euler_step(x, v, sigmas[i], sigmas[i + 1])
            if mask is not None:  # the kept region: the input latent noised to the next sigma
                sigma_next = sigmas[i + 1].item()
                kept = sigma_next * kept_noise + (1.0 - sigma_next) * latent
                blended = x.float() * mask + kept * (1.0 - mask)
                # the last step's blend stays fp32, so the kept region is the input latent exactly in any dtype
                x = blended if i == steps - 1 else blended.to(dtype)
            self.watch.check(x, i)
            self.clock.stop(started)
            if self.callback is not None:
                self.callback(StepInfo(i, steps, sigmas[i].item(), x, x_before, v, grid))
        return finish_latents(unpack(x, grid), sigmas[-1].item())
