"""The Fun ControlNet's 129-channel control latent for a target size: `[control 64 | keep 1 | inpaint 64]`.

ComfyUI core's semantics (docs/controlnet.md), built at the target's pixel size (latent x 16):
- control: the control image stretched (bicubic, as every image here) to the target, VAE-encoded, normalised
  `(z - mean) / std`; zeros without one;
- keep: `1 - nearest-downsample(regen)`, regen = the mask stretched (bilinear) and `>= 0.5` (1 = regenerate);
  without a mask, regen is 1 everywhere, so keep is 0;
- inpaint: the inpaint image with the regenerated pixels set to mid-grey (the VAE's zero), encoded and normalised;
  zeros without an inpaint image, and also without a mask (core ignores the image then).
Only the first image of each batch is used; images are cut to RGB (the VAE gets an opaque alpha).

`fit = "pad"` (docs/pad-and-crop.md) puts each image and the mask at the target's top-left corner at its own size
and repeats its right and bottom edges, as a padded reference is: a control map of the picture an edit pads then
lines up with it pixel for pixel. Only an image larger than the target is scaled down (aspect kept) first.
"""

import math

import torch
import torch.nn.functional as F

from ..vae.autoencoder import QwenImage21VAE
from ..vae.latents import LATENT_TOKEN_PIXELS
from .canvas import pad_images

FITS = ("stretch", "pad")

CONTROL_CHANNELS = 64


def _first_rgb(image, name: str) -> torch.Tensor:
    """ComfyUI IMAGE `[B, H, W, C]` -> `(1, 3, H, W)` fp32 in [0, 1] (first image, RGB)."""
    pixels = torch.as_tensor(image).detach().to("cpu", torch.float32)
    if pixels.ndim == 3:
        pixels = pixels[None]
    if pixels.ndim != 4 or pixels.shape[-1] not in (1, 3, 4) or 0 in pixels.shape:
        raise ValueError(f"{name} must be a ComfyUI IMAGE [B, H, W, C] with C = 1, 3 or 4; got {list(pixels.shape)}.")
    if not torch.isfinite(pixels).all():
        raise ValueError(f"{name} holds NaN or infinite values.")
    pixels = pixels[:1]
    pixels = pixels.expand(-1, -1, -1, 3) if pixels.shape[-1] == 1 else pixels[..., :3]
    return pixels.movedim(-1, 1).contiguous()


def _first_mask(mask) -> torch.Tensor:
    """ComfyUI MASK `[B, H, W]` or `[H, W]` -> `(1, 1, H, W)` fp32 (first mask)."""
    values = torch.as_tensor(mask).detach().to("cpu", torch.float32)
    if values.ndim == 2:
        values = values[None]
    if values.ndim != 3 or 0 in values.shape:
        raise ValueError(f"mask must be a ComfyUI MASK [B, H, W]; got {list(values.shape)}.")
    return values[:1, None]


def _encode(vae: QwenImage21VAE, pixels: torch.Tensor) -> torch.Tensor:
    """`(1, 3, H, W)` in [0, 1] -> normalised latents `(1, 64, H/16, W/16)` fp32 on the CPU."""
    raw = vae.encode(2.0 * pixels - 1.0).float().cpu()
    return vae.latent_format.normalize(raw)


def _on_target(pixels: torch.Tensor, size: tuple[int, int], fit: str, mode: str) -> torch.Tensor:
    """`(1, C, H, W)` onto the target's `size` = (height, width): stretched, or (`pad`) kept at its own size,
    scaled down only when it does not fit, and padded on the right and bottom with its edge."""
    if fit == "stretch":
        return F.interpolate(pixels, size=size, mode=mode, align_corners=False)
    height, width = pixels.shape[-2:]
    if height > size[0] or width > size[1]:
        scale = min(size[0] / height, size[1] / width)
        own = (max(1, math.floor(height * scale)), max(1, math.floor(width * scale)))
        pixels = F.interpolate(pixels, size=own, mode=mode, align_corners=False)
    return pad_images(pixels.movedim(1, -1), (size[1], size[0]), "edge").movedim(-1, 1)


def control_latents(vae: QwenImage21VAE | None, grid: tuple[int, int], control_image=None, inpaint_image=None,
                    mask=None, fit: str = "stretch") -> torch.Tensor:
    """`(h*w, 129)` fp32 row-major tokens of the control latent for a target of `grid` = (h, w) latent cells.
    `fit`: `stretch` the images and mask to the target (core's), or `pad` them at their own size."""
    if fit not in FITS:
        raise ValueError(f"fit must be one of {', '.join(FITS)}; got {fit!r}.")
    h, w = int(grid[0]), int(grid[1])
    size = (h * LATENT_TOKEN_PIXELS, w * LATENT_TOKEN_PIXELS)
    if vae is None and (control_image is not None or (mask is not None and inpaint_image is not None)):
        raise ValueError("the control image and the inpaint image are VAE-encoded: connect the VAE.")
    control = torch.zeros(1, CONTROL_CHANNELS, h, w)
    if control_image is not None:
        control = _encode(vae, _on_target(_first_rgb(control_image, "control_image"), size, fit, "bicubic"))
    if mask is not None:
        regen = _on_target(_first_mask(mask), size, fit, "bilinear") >= 0.5
        regen = regen.float()
    else:
        regen = torch.ones(1, 1, *size)
    keep = 1.0 - F.interpolate(regen, size=(h, w), mode="nearest")
    inpaint = torch.zeros(1, CONTROL_CHANNELS, h, w)
    if inpaint_image is not None and mask is not None:
        pixels = _on_target(_first_rgb(inpaint_image, "inpaint_image"), size, fit, "bicubic")
        inpaint = _encode(vae, pixels * (1.0 - regen) + 0.5 * regen)
    stacked = torch.cat([control, keep, inpaint], dim=1)  # (1, 129, h, w)
    return stacked[0].flatten(1).transpose(0, 1).contiguous()  # (h*w, 129)
