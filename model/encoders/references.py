"""Reference images, resized once: the same pixels feed the VAE (RGBA) and the vision-language model (RGB).

Qwen-Image 2.1 puts each reference into the prompt twice: the text encoder's vision tower reads it (one VLM
image token per 32x32 pixels) and the VAE encodes it into latent tokens (one per 16x16 pixels) that fill those
image slots, 2x2 latent tokens per slot. Both counts only agree when both see the same x32-sized image, so the
reference pipeline (diffusers 0.42.1 `QwenImage21Pipeline.__call__`) resizes every reference once and hands
that one image to both. This module does the same:

- size: area about `resolution`^2 with the aspect kept, each side rounded to a multiple of 32
  (`reference_size`, the arithmetic of diffusers' `calculate_dimensions`); `resolution` 0 keeps the image's own
  size, floored to multiples of 32;
- resampling: the image is made RGBA first (an RGB image gets an opaque alpha) and resized by PIL with
  Lanczos, as diffusers' `VaeImageProcessor.resize` does for PIL input (its default `resample="lanczos"`,
  `reducing_gap=None`). PIL resizes RGBA with premultiplied alpha, so transparent pixels do not bleed colour;
- VAE pixels: the resized RGBA bytes / 255, then `2x - 1`, in float32 (`VaeImageProcessor.preprocess`);
- VLM image: the resized RGBA pasted over white with its alpha as the mask (the pipeline's
  `_get_qwen_prompt_embeds`); the vision tower never sees alpha.

`fit = "pad"` (model/encoders/canvas.py, docs/pad-and-crop.md) keeps the image's own pixels instead: it is padded on the
right and bottom to multiples of 32 (and to at least the VLM's minimum area), resampled only when it is larger than
`resolution`^2, and `crop` records its own box so the generated image can be cut back to it.

The VLM's processor rescales anything outside [65536, 16777216] pixels (`size` in the released
`processor/preprocessor_config.json`, see docs/checkpoints.md), after which its token grid no longer matches
the latent grid, so such sizes are refused here with the `resolution` that would work. Pure PIL + numpy +
torch: no torchvision, no ComfyUI.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..vae.latents import LATENT_TOKEN_PIXELS, VLM_TOKEN_PIXELS
from .canvas import DEFAULT_FILL, fit_inside, pad_images, padded_size

#: The vision processor's `size.shortest_edge` / `size.longest_edge`: min / max pixels (docs/checkpoints.md).
MIN_VLM_PIXELS = 65536
MAX_VLM_PIXELS = 16777216
#: transformers' `smart_resize` refuses images more elongated than this.
MAX_ASPECT = 200
#: How a reference reaches sides that are multiples of 32: `resize` (the reference pipeline's) or `pad`.
FITS = ("resize", "pad")


@dataclass(frozen=True, eq=False)
class PreparedReference:
    """One reference after its single resize.

    Attributes:
        pixels: `(1, 4, H, W)` float32 in [-1, 1], channels R, G, B, A (an RGB source has A = +1): the VAE input.
        vlm_image: `H x W` RGB PIL image, the alpha composited over white: the vision tower's input.
        width, height: the resized (or padded) size in pixels, both multiples of 32.
        crop: with `fit = "pad"`, (width, height) of the image's own pixels at the top-left corner (the rest is
            padding); None when the image was resized as the reference pipeline does.
    """

    pixels: torch.Tensor
    vlm_image: Image.Image
    width: int
    height: int
    crop: tuple[int, int] | None = None

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.width, self.height

    @property
    def latent_grid(self) -> tuple[int, int]:
        """(h, w) of the reference's latent: one token per 16x16 pixels."""
        return self.height // LATENT_TOKEN_PIXELS, self.width // LATENT_TOKEN_PIXELS

    @property
    def vlm_tokens(self) -> int:
        """Image slots the reference takes in the prompt: one per 32x32 pixels (= 2x2 latent tokens)."""
        return (self.height // VLM_TOKEN_PIXELS) * (self.width // VLM_TOKEN_PIXELS)


def reference_size(width: int, height: int, resolution: int) -> tuple[int, int]:
    """(width, height) a `width x height` image is resized to: area ~ resolution^2, aspect kept, sides x32.

    Same arithmetic as diffusers' `calculate_dimensions` (Python's round, ties to even). `resolution` 0 keeps the
    image's own size, floored to multiples of 32. Either side may come out 0 for tiny or extreme images; callers
    check the area.
    """
    if resolution < 0:
        raise ValueError(f"resolution must be 0 (keep the image's size) or positive, got {resolution}.")
    if width <= 0 or height <= 0:
        raise ValueError(f"A reference image needs a positive size, got {width}x{height}.")
    step = VLM_TOKEN_PIXELS
    if resolution == 0:
        return width // step * step, height // step * step
    ratio = width / height
    new_width = math.sqrt(resolution * resolution * ratio)
    new_height = new_width / ratio
    return round(new_width / step) * step, round(new_height / step) * step


def _fits_vlm(size: tuple[int, int]) -> bool:
    width, height = size
    return min(width, height) > 0 and MIN_VLM_PIXELS <= width * height <= MAX_VLM_PIXELS \
        and max(width, height) / min(width, height) <= MAX_ASPECT


def _resolutions_that_fit(width: int, height: int) -> list[int]:
    """The `resolution` values (multiples of 32, the node's step) whose resize the vision processor leaves alone."""
    return [r for r in range(32, 16384 + 1, 32) if _fits_vlm(reference_size(width, height, r))]


def _check_size(source: tuple[int, int], size: tuple[int, int], resolution: int) -> None:
    if _fits_vlm(size):
        return
    width, height = size
    fits = _resolutions_that_fit(*source)
    if min(width, height) > 0 and max(width, height) / min(width, height) > MAX_ASPECT:
        problem = f"more elongated than {MAX_ASPECT}:1, which the vision processor refuses"
        advice = "Crop the image first."
    elif width * height < MIN_VLM_PIXELS:
        problem = (f"{width * height} pixels, below the vision processor's minimum of {MIN_VLM_PIXELS} (256x256), "
                   "so it would be upscaled")
        advice = f"Use resolution >= {fits[0]}." if fits else "Crop the image to a less elongated shape first."
    else:
        problem = (f"{width * height} pixels, above the vision processor's maximum of {MAX_VLM_PIXELS}, so it "
                   "would be downscaled")
        advice = f"Use resolution <= {fits[-1]}." if fits else "Crop the image first."
    how = "keeping its own size (resolution 0)" if resolution == 0 else f"at resolution {resolution}"
    raise ValueError(
        f"Reference image {source[0]}x{source[1]} {how} becomes {width}x{height}: {problem} for the text encoder, "
        f"and its image tokens would no longer line up with its latent grid. {advice}"
    )


def _to_uint8(values: np.ndarray) -> np.ndarray:
    # ComfyUI loads 8-bit files as byte / 255; rounding (not truncation) gets those bytes back exactly.
    return np.clip(np.rint(values * 255.0), 0, 255).astype(np.uint8)


def _rgba_source(image, mask) -> Image.Image:
    """The reference as an 8-bit RGBA PIL image at its own size."""
    if isinstance(image, Image.Image):
        if image.width == 0 or image.height == 0:
            raise ValueError(f"Reference image is empty ({image.width}x{image.height}).")
        rgba = np.array(image.convert("RGBA"))
    else:
        array = torch.as_tensor(image).detach().to("cpu", torch.float32)
        if array.ndim == 4:
            array = array[0]  # a batch: the first image is the reference (ComfyUI passes one image per reference)
        if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
            raise ValueError(
                f"Reference image must be [H, W, C] or [B, H, W, C] with C = 3 or 4 (ComfyUI IMAGE; C = 1 is read as "
                f"grey), got {list(torch.as_tensor(image).shape)}."
            )
        if array.shape[-1] == 1:
            # one channel is unambiguous grey: the same three equal channels LoadImage makes of a grey PNG
            array = array.expand(-1, -1, 3)
        if array.shape[0] == 0 or array.shape[1] == 0:
            raise ValueError(f"Reference image is empty ({array.shape[1]}x{array.shape[0]} pixels).")
        if not torch.isfinite(array).all():
            raise ValueError("Reference image contains NaN or infinite values.")
        values = array.numpy()
        if values.shape[-1] == 3:
            values = np.concatenate([values, np.ones_like(values[..., :1])], axis=-1)  # RGB: opaque
        rgba = _to_uint8(values)
    if mask is not None:
        rgba[..., 3] = _alpha_from_mask(mask, rgba.shape[:2])
    return Image.fromarray(rgba, mode="RGBA")


def _alpha_from_mask(mask, shape: tuple[int, int]) -> np.ndarray:
    """8-bit alpha = 1 - mask (ComfyUI MASK: 1 = transparent), `[H, W]` or `[B, H, W]` (first used)."""
    values = torch.as_tensor(mask).detach().to("cpu", torch.float32)
    if values.ndim == 3:
        values = values[0]
    if values.ndim != 2 or values.numel() == 0:
        raise ValueError(f"Reference mask must be a non-empty [H, W] or [B, H, W] tensor, got {list(values.shape)}.")
    if tuple(values.shape) != tuple(shape):
        # LoadImage gives a 64x64 all-zero mask for an image without alpha: a constant mask of any size is
        # unambiguous, anything else would need a guess about how it maps onto the image.
        if values.min() != values.max():
            raise ValueError(
                f"Reference mask is {values.shape[1]}x{values.shape[0]} but the image is {shape[1]}x{shape[0]}; "
                "resize the mask to the image first."
            )
        values = values.flatten()[:1].expand(*shape)
    return _to_uint8(1.0 - values.clamp(0.0, 1.0).numpy())


def prepare_reference(image, mask=None, resolution: int = 1024, fit: str = "resize",
                      fill: str = DEFAULT_FILL) -> PreparedReference:
    """The reference resized once, as VAE pixels and as the VLM's RGB image.

    Args:
        image: ComfyUI IMAGE, `[H, W, C]` or `[B, H, W, C]` float in [0, 1], C = 3 (RGB) or 4 (RGBA); C = 1 is
            read as grey (three equal channels). With B > 1 only the first image is used. A PIL image is
            accepted too (converted to RGBA).
        mask: optional ComfyUI MASK, `[H, W]` or `[B, H, W]` (first used), 1 = transparent; alpha = 1 - mask. It
            replaces the image's own alpha when both are given. A constant mask of another size (LoadImage's
            64x64 placeholder) is broadcast; any other size mismatch is refused.
        resolution: area ~ resolution^2 with the aspect kept and sides rounded to 32; 0 keeps the image's size,
            floored to multiples of 32. With `fit = "pad"`: the largest area kept (a larger image is scaled down
            to it, aspect kept), 0 = no limit.
        fit: `resize` (the reference pipeline's) or `pad` (the image's own pixels, padded on the right and bottom
            with `fill`, see `canvas.pad_images`; an image with transparency gets transparent padding).

    Raises:
        ValueError: an empty image, a bad shape, or a size the vision processor would rescale (below 65536 or
            above 16777216 pixels, or more elongated than 200:1); the message names the `resolution` that works.
    """
    if fit not in FITS:
        raise ValueError(f"fit must be one of {', '.join(FITS)}; got {fit!r}.")
    source = _rgba_source(image, mask)
    if fit == "pad":
        return _padded_reference(source, resolution, fill)
    width, height = reference_size(source.width, source.height, resolution)
    _check_size(source.size, (width, height), resolution)
    # PIL returns a copy when the size is unchanged, so resolution 0 on an x32 image is lossless.
    resized = source.resize((width, height), resample=Image.Resampling.LANCZOS, reducing_gap=None)
    return _prepared(resized)


def _prepared(canvas: Image.Image, crop: tuple[int, int] | None = None) -> PreparedReference:
    """The VAE's pixels and the VLM's image of one x32-sized RGBA canvas."""
    rgba = np.array(canvas)  # (H, W, 4) uint8
    pixels = 2.0 * (rgba.astype(np.float32) / 255.0) - 1.0
    vlm_image = Image.new("RGB", canvas.size, (255, 255, 255))
    vlm_image.paste(canvas, mask=canvas.getchannel("A"))
    return PreparedReference(
        pixels=torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0).contiguous(),  # (1, 4, H, W)
        vlm_image=vlm_image,
        width=canvas.width,
        height=canvas.height,
        crop=crop,
    )


def _padded_reference(source: Image.Image, resolution: int, fill: str) -> PreparedReference:
    """`fit = "pad"`: own pixels (scaled down only above resolution^2), padded right / bottom to x32 and to at
    least the VLM's minimum area."""
    if resolution < 0:
        raise ValueError(f"resolution must be 0 (no limit) or positive, got {resolution}.")

    def own_and_canvas(limit: int):
        own = fit_inside(source.width, source.height, limit * limit) if limit else source.size
        return own, padded_size(*own, min_pixels=MIN_VLM_PIXELS)

    own, canvas = own_and_canvas(resolution)
    if own != source.size:
        source = source.resize(own, resample=Image.Resampling.LANCZOS, reducing_gap=None)
    if not _fits_vlm(canvas):
        fits = [r for r in range(4096, 0, -32) if _fits_vlm(own_and_canvas(r)[1])]
        advice = (f"Use a resolution of at most {fits[0]} (the image is then scaled down before padding)."
                  if fits else "Crop the image to a less elongated shape first.")
        raise ValueError(f"Reference image {own[0]}x{own[1]} padded to {canvas[0]}x{canvas[1]} does not fit the "
                         f"vision processor (from {MIN_VLM_PIXELS} to {MAX_VLM_PIXELS} pixels, at most "
                         f"{MAX_ASPECT}:1). {advice}")
    rgba = np.array(source)
    transparent = bool((rgba[..., 3] < 255).any())  # the padding is marked transparent where alpha is in play
    padded = pad_images(torch.from_numpy(rgba)[None].float() / 255.0, canvas, fill, 0.0 if transparent else None)
    return _prepared(Image.fromarray(_to_uint8(padded[0].numpy()), mode="RGBA"), crop=own)
