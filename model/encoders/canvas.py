"""Pad to multiples of 32 and crop back: edits that line up with their input pixel for pixel.

The reference pipeline resizes every reference to sides that are multiples of 32, so an edit comes out as a
slightly scaled copy of its input and cannot be laid back over it (docs/pad-and-crop.md). The other way to reach
those sides is to keep the picture's own pixels and add a few on the right and bottom: the picture then sits at
(0, 0) of a larger canvas, the DiT's pixel grid is the picture's, and the generated canvas is cropped back to
the picture's own box. This module holds that arithmetic for every place that needs it (references, VAE encode,
the Fun ControlNet's images, a noise mask), so all of them pad the same way.

The fill is `edge` (each padded pixel repeats the nearest edge pixel): on the toy it moved the unmoved shape
least and kept the edit's colour (docs/pad-and-crop.md measures edge, reflect and a neutral grey). Reflection
copies shapes near the edge into the padding, and grey adds a border the model reads as content.

Pure torch: no PIL, no ComfyUI.
"""

import math

import torch
import torch.nn.functional as F

from ..vae.latents import LATENT_TOKEN_PIXELS, VLM_TOKEN_PIXELS

#: How the padding is filled: `edge` repeats the edge pixel, `reflect` mirrors the picture, `grey` is the VAE's 0.
FILLS = ("edge", "reflect", "grey")
DEFAULT_FILL = "edge"
#: The LATENT key that carries the box: `(width, height)` of the picture at the canvas' top-left corner. The
#: samplers pass it on, Qwen-Image 2.1 VAE Decode crops to it; nodes that build a new LATENT drop it.
CROP_KEY = "qi21_crop"


def ceil_to(value: int, multiple: int = VLM_TOKEN_PIXELS) -> int:
    return -(-int(value) // multiple) * multiple


def padded_size(width: int, height: int, min_pixels: int = 0, multiple: int = VLM_TOKEN_PIXELS) -> tuple[int, int]:
    """The canvas a `width x height` picture is padded to: each side rounded up to `multiple`, then (when the area
    is below `min_pixels`, the vision processor's minimum) the shorter side grown by `multiple` until it is not."""
    if width <= 0 or height <= 0:
        raise ValueError(f"a picture to pad needs a positive size, got {width}x{height}.")
    canvas_w, canvas_h = ceil_to(width, multiple), ceil_to(height, multiple)
    while canvas_w * canvas_h < min_pixels:
        if canvas_w <= canvas_h:
            canvas_w += multiple
        else:
            canvas_h += multiple
    return canvas_w, canvas_h


def fit_inside(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) scaled down, aspect kept, to at most `max_pixels`; unchanged when it already fits. Pictures
    are only ever made smaller here, never larger: a larger one would move every pixel, which padding avoids."""
    if width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    new_w, new_h = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
    return new_w, new_h


def pad_images(images: torch.Tensor, size: tuple[int, int], fill: str = DEFAULT_FILL,
               alpha_fill: float | None = None) -> torch.Tensor:
    """ComfyUI-layout images `[B, H, W, C]` (floats in [0, 1]) padded on the right and bottom to `size` =
    (width, height). `alpha_fill` (with C = 4): the padding's alpha, e.g. 0 to mark it transparent; None pads the
    alpha like the colours. `fill` is one of `FILLS`."""
    if fill not in FILLS:
        raise ValueError(f"pad fill must be one of {', '.join(FILLS)}; got {fill!r}.")
    if images.ndim != 4:
        raise ValueError(f"images to pad must be [B, H, W, C]; got {list(images.shape)}.")
    height, width = images.shape[1:3]
    canvas_w, canvas_h = size
    if canvas_w < width or canvas_h < height:
        raise ValueError(f"cannot pad a {width}x{height} picture to a smaller {canvas_w}x{canvas_h} canvas.")
    right, bottom = canvas_w - width, canvas_h - height
    if right == 0 and bottom == 0:
        return images
    channels_first = images.movedim(-1, 1).float()  # (B, C, H, W): F.pad pads the last two dims
    if fill == "grey":
        padded = F.pad(channels_first, (0, right, 0, bottom), mode="constant", value=0.5)
    elif fill == "reflect" and right < width and bottom < height:
        padded = F.pad(channels_first, (0, right, 0, bottom), mode="reflect")
    else:  # edge (and reflect wider than the picture itself, which a mirror cannot fill: repeat the edge instead)
        padded = F.pad(channels_first, (0, right, 0, bottom), mode="replicate")
    if alpha_fill is not None and padded.shape[1] == 4:
        padded[:, 3, height:, :] = alpha_fill
        padded[:, 3, :, width:] = alpha_fill
    return padded.movedim(1, -1).contiguous()


def pad_masks(masks: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Masks `[B, H, W]` padded on the right and bottom to `size` = (width, height), repeating their edge (a region
    that touches the picture's edge continues into the padding, which the crop removes again)."""
    return pad_images(masks[..., None], size, "edge")[..., 0]


def check_box(box, canvas: tuple[int, int], what: str = "the LATENT's qi21_crop") -> tuple[int, int]:
    """`box` as (width, height) ints inside a `canvas` = (width, height), or a ValueError naming `what`."""
    try:
        width, height = (int(v) for v in box)
        valid = (width, height) == tuple(box)
    except (TypeError, ValueError):
        valid = False
    if not valid or not (0 < width <= canvas[0] and 0 < height <= canvas[1]):
        raise ValueError(f"{what} must be (width, height) within the {canvas[0]}x{canvas[1]} image; got {box!r}. "
                         "It is set by the Qwen-Image 2.1 samplers and VAE Encode with fit = pad.")
    return width, height


def crop_images(images: torch.Tensor, box: tuple[int, int]) -> torch.Tensor:
    """`[B, H, W, ...]` cut to the box at the top-left corner: the picture's own pixels, padding dropped."""
    width, height = box
    return images[:, :height, :width].contiguous()


def mask_on_canvas(mask: torch.Tensor, box: tuple[int, int], canvas: tuple[int, int]) -> torch.Tensor:
    """A noise mask drawn on the picture (`[..., H, W]` with (W, H) = box) padded to the canvas like the picture;
    a mask of any other size is returned as it is (the sampler stretches it to the latent, as ComfyUI does)."""
    mask = torch.as_tensor(mask)
    if mask.ndim < 2 or tuple(mask.shape[-2:]) != (box[1], box[0]) or tuple(box) == tuple(canvas):
        return mask
    flat = mask.reshape(-1, *mask.shape[-2:]).float()
    return pad_masks(flat, canvas).reshape(*mask.shape[:-2], canvas[1], canvas[0])


def padded_target(ref_shapes, ref_crops, width: int, height: int):
    """With a padded reference in the prompt: `((width, height), box)`, the size to generate (before flooring to
    multiples of 32) and the box to crop it to, else None (the reference pipeline's rule applies). The first padded
    reference leads: a 0 side takes its canvas, and its box is the output's when the size is its canvas (any other
    size is generated uncropped).

    `ref_shapes`: latent (h, w) per reference; `ref_crops`: the references' `crop` (None = resized)."""
    lead = next((i for i, crop in enumerate(ref_crops or ()) if crop is not None), None)
    if lead is None:
        return None
    h, w = ref_shapes[lead]
    canvas = (w * LATENT_TOKEN_PIXELS, h * LATENT_TOKEN_PIXELS)
    wanted = (width or canvas[0], height or canvas[1])
    floored = tuple(side // VLM_TOKEN_PIXELS * VLM_TOKEN_PIXELS for side in wanted)
    return wanted, (tuple(ref_crops[lead]) if floored == canvas else None)
