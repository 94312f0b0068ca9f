"""Starting from an image instead of pure noise: img2img, inpainting masks and split schedules, with ComfyUI's
semantics so graphs built from core nodes (`SetLatentNoiseMask`, `SplitSigmas`, `KSamplerAdvanced`) behave here
as users expect.

Flow matching mixes clean latents and noise linearly: the latent at sigma s is `s * noise + (1 - s) * clean`.
- img2img: the run starts at `sigma0 * noise + (1 - sigma0) * latent`; with sigma0 = 1 that is pure noise, so
  denoise 1.0 with a latent equals text-to-image.
- inpainting: after every step the kept region (mask 0) is reset to the input latent noised to the next sigma,
  so it ends as the input latent exactly; the model still sees the whole image at every step.
- a schedule that ends above 0 (the first half of a split) returns `x / (1 - sigma_end)`, and a run with
  `add_noise` off starts from `(1 - sigma0) * latent`: ComfyUI's scaling of a partly denoised latent for flow
  models, under which the second half of a split continues exactly where the first stopped.

Everything here works on normalised (DiT-space) latents `(B, 64, h, w)` in fp32.
"""

import torch
import torch.nn.functional as F

#: The longest schedule whose tail a denoise below 1 may take (`int(steps / denoise)` steps): a grid of a million
#: points is 8 MB and milliseconds, and covers every value the widgets offer (200 steps at denoise 0.01 is 20,000).
#: Beyond it the tail's sigmas would also stop being distinct in fp32. denoise = 1e-9 asked for 4e10 points (320 GB).
MAX_SCHEDULE_STEPS = 1_000_000


def smallest_denoise(steps: int) -> float:
    """The smallest denoise `denoise_tail` takes for `steps` steps: `steps / MAX_SCHEDULE_STEPS`."""
    return steps / MAX_SCHEDULE_STEPS


def denoise_tail(full_schedule, steps: int, denoise: float) -> torch.Tensor:
    """The last `steps` steps of the `int(steps / denoise)`-step schedule `full_schedule(n)`, as ComfyUI's
    KSampler builds an img2img schedule (denoise 1 gives the whole `steps`-step schedule). A denoise below
    `smallest_denoise(steps)` is refused rather than building a schedule of more than MAX_SCHEDULE_STEPS."""
    check_denoise(denoise, steps)
    if denoise > 0.9999:  # ComfyUI's own threshold: treated as a full run
        return full_schedule(steps)
    return full_schedule(int(steps / denoise))[-(steps + 1) :]


def denoise_problem(denoise: float, steps: int | None = None) -> str | None:
    """Why `denoise` cannot run (with `steps` Base steps, when given), or None."""
    if not 0.0 < denoise <= 1.0:  # also refuses NaN; compared as given: float(10**400) would overflow
        shown = denoise if isinstance(denoise, float) or abs(denoise) < 2**60 else "an integer past 2**60"
        return (f"denoise = {shown}: use a value in (0, 1]. 1 starts from pure noise; lower values keep "
                "more of the latent_image (0 would run no step at all).")
    if steps is not None and denoise < smallest_denoise(steps):  # compared before dividing: 1e-320 would overflow
        total = steps / denoise
        return (f"denoise = {denoise:g} with {steps} steps would take the last {steps} steps of a "
                f"{f'{total:,.0f}' if total < 1e15 else f'{total:.3g}'}-step schedule; the smallest denoise for "
                f"{steps} steps is "
                f"{smallest_denoise(steps):g} (a {MAX_SCHEDULE_STEPS:,}-step schedule). Use a larger denoise, or fewer "
                "steps.")
    return None


def check_denoise(denoise: float, steps: int | None = None) -> None:
    problem = denoise_problem(denoise, steps)
    if problem is not None:
        raise ValueError(problem)


def match_batch(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """ComfyUI's `repeat_to_batch_size`: the first `batch` entries, repeating the whole batch when it is shorter."""
    if tensor.shape[0] > batch:
        return tensor[:batch]
    if tensor.shape[0] < batch:
        repeats = -(-batch // tensor.shape[0])
        return tensor.repeat(repeats, *([1] * (tensor.ndim - 1)))[:batch]
    return tensor


def latent_mask(mask: torch.Tensor, grid: tuple[int, int], batch: int) -> torch.Tensor:
    """A noise mask (1 = repaint) `[H, W]`, `[B, H, W]` or `[B, 1, H, W]` at any size -> `(batch, 1, h, w)` fp32 on
    the latent grid: bilinear resize (as ComfyUI's `prepare_mask`), then the batch matched (`match_batch`)."""
    mask = torch.as_tensor(mask).detach().to("cpu", torch.float32)
    if mask.ndim == 2:
        mask = mask[None]
    if mask.ndim == 4 and mask.shape[1] == 1:
        mask = mask[:, 0]
    if mask.ndim != 3 or mask.numel() == 0:
        raise ValueError(f"noise_mask must be [H, W], [B, H, W] or [B, 1, H, W]; got {list(mask.shape)}.")
    if not torch.isfinite(mask).all():
        raise ValueError("noise_mask holds NaN or infinite values.")
    low, high = mask.min().item(), mask.max().item()
    if low < 0.0 or high > 1.0:  # the blend x * m + kept * (1 - m) would extrapolate past both images
        raise ValueError(f"noise_mask values must lie in [0, 1] (1 = repaint, 0 = keep); got {low:g} to {high:g}. "
                         "Scale or clamp the mask first.")
    resized = F.interpolate(mask[:, None], size=tuple(grid), mode="bilinear")
    return match_batch(resized, batch)


def start_latents(noise: torch.Tensor, latent: torch.Tensor | None, sigma0: float, add_noise: bool) -> torch.Tensor:
    """The latents the first step reads (fp32): `noise` alone without a latent, else `sigma0 * noise +
    (1 - sigma0) * latent`, where `noise` counts as zero when `add_noise` is off."""
    if latent is None:
        if not add_noise:
            raise ValueError("add_noise off needs a latent_image: the already-noised latent to continue from.")
        return noise.float()
    return sigma0 * (noise.float() if add_noise else torch.zeros_like(latent)) + (1.0 - sigma0) * latent


def finish_latents(x: torch.Tensor, sigma_end: float) -> torch.Tensor:
    """What a run returns: `x` when it reached sigma 0, else ComfyUI's `x / (1 - sigma_end)` (see module doc)."""
    return x if sigma_end == 0.0 else x / (1.0 - sigma_end)


def fixed_tail(sigmas: torch.Tensor, denoise: float) -> torch.Tensor:
    """A stored schedule (Turbo's 8 sigmas + 0) for img2img: its last `max(1, round(steps * denoise))` steps. A
    distilled grid cannot be stretched into a longer one, so the tail of the grid itself is the closest match."""
    check_denoise(denoise)
    steps = sigmas.numel() - 1
    keep = max(1, round(steps * float(denoise)))
    return sigmas[-(keep + 1) :]


#: Latent channel counts of other model families, to name them when their LATENT reaches our sampler.
OTHER_LATENTS = {
    4: "a Stable Diffusion 1.x / 2.x / XL latent (4 channels)",
    16: "an SD3 / Flux / Qwen-Image 1.x / Wan 2.1 latent (16 channels)",
    32: "a Flux 2 / HunyuanImage latent (32 channels)",
    48: "a Wan 2.2 latent (48 channels)",
    128: "a Flux 2 latent (128 channels)",
}


def check_latent(samples, channels: int = 64, name: str = "latent_image") -> torch.Tensor:
    """A LATENT's `samples` as fp32 `(B, channels, h, w)` on the CPU, or a clear error naming what it is."""
    if not isinstance(samples, torch.Tensor):
        raise ValueError(f"{name} has no 'samples' tensor; connect a LATENT (e.g. from Qwen-Image 2.1 VAE Encode).")
    if samples.ndim == 5 and samples.shape[2] == 1:  # a single-frame video latent (B, C, 1, h, w)
        samples = samples[:, :, 0]
    if samples.ndim != 4 or samples.shape[1] != channels:
        what = OTHER_LATENTS.get(samples.shape[1] if samples.ndim >= 2 else -1, f"shape {tuple(samples.shape)}")
        raise ValueError(
            f"{name} is {what}, not a Qwen-Image 2.1 latent (B, {channels}, H/16, W/16). Encode the image with "
            "Qwen-Image 2.1 VAE Encode, or use a Qwen-Image 2.1 sampler's LATENT."
        )
    if samples.shape[0] == 0 or samples.shape[2] == 0 or samples.shape[3] == 0:
        raise ValueError(f"{name} is empty: shape {tuple(samples.shape)}.")
    samples = samples.detach().to("cpu", torch.float32)
    if not torch.isfinite(samples).all():
        raise ValueError(f"{name} holds NaN or infinite values; the node that made it failed.")
    return samples
