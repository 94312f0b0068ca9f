"""The steps between components, shared by the ComfyUI nodes and plain-Python callers.

reference image -> (VAE latents + VLM pixels) -> prompt encoding -> Conditioning -> sampling -> raw latents
-> VAE decode -> RGB, alpha mask and RGBA in ComfyUI's conventions (`[B, H, W, C]` floats in [0, 1]).
"""

import hashlib
from dataclasses import dataclass

import torch

from ..vae.autoencoder import QwenImage21VAE
from ..vae.latents import RELEASED_LATENT_FORMAT, LatentFormat
from .canvas import DEFAULT_FILL, pad_images, padded_size
from .conditioning import Conditioning
from .references import PreparedReference
from .text_encoder import QwenImageTextEncoder

MAX_REFERENCES = 10  # the released model's limit (`<image1>`..`<image10>`)


@dataclass(frozen=True, eq=False)
class Reference:
    """One reference image, resized once: the VLM sees `prepared.vlm_image`, the DiT its latent tokens."""

    prepared: PreparedReference
    tokens: torch.Tensor  # (h*w, 64) normalised latents, row-major, fp32 on the CPU
    shape: tuple[int, int]  # latent (h, w)
    latent_format: LatentFormat = RELEASED_LATENT_FORMAT  # the statistics `tokens` were normalised with


@torch.no_grad()
def encode_prepared(vae: QwenImage21VAE, prepared: PreparedReference, tiled: bool | None = None) -> Reference:
    """VAE-encode all 4 channels of a reference already resized by `prepare_reference`."""
    raw = vae.encode(prepared.pixels, tiled=tiled)  # (1, 64, h, w)
    if not bool(torch.isfinite(raw).all()):
        raise FloatingPointError(
            f"The VAE encoded the {prepared.width}x{prepared.height} reference to NaN/inf latents (it runs in "
            f"{next(vae.parameters()).dtype}); load the VAE with weight_dtype bf16 or fp32."
        )
    latent_format = vae.latent_format
    latents = latent_format.normalize(raw.float())[0]
    return Reference(prepared, latents.flatten(1).T.contiguous().cpu(), tuple(latents.shape[1:]), latent_format)


def check_room_for_reference(previous) -> None:
    """Refuse an 11th reference before any work is done on it."""
    if len(previous or ()) >= MAX_REFERENCES:
        raise ValueError(
            f"{len(previous) + 1} references are chained; Qwen-Image 2.1 takes at most {MAX_REFERENCES} "
            "(<image1>..<image10>). Remove one from the chain."
        )


def chain_references(previous, reference: Reference) -> tuple[Reference, ...]:
    check_room_for_reference(previous)
    return tuple(previous or ()) + (reference,)


def encode_prompt(text_encoder: QwenImageTextEncoder, prompt: str, references=()) -> Conditioning:
    """Encode `prompt` with its references (`<image1>`.. in chain order) into the sampler's Conditioning."""
    references = tuple(references or ())
    encoded = text_encoder.encode(prompt, [r.prepared for r in references])
    if not bool(torch.isfinite(encoded.embeds).all()):
        # caught here, it names the culprit; caught by the sampler, it would read as a DiT failure at step 1
        raise FloatingPointError(
            f"The text encoder returned NaN/inf states for the prompt {prompt[:60]!r} (it runs in "
            f"{text_encoder.dtype}); load it with weight_dtype bf16 or fp32."
        )
    tokens = torch.cat([r.tokens for r in references]) if references else None
    formats = {r.latent_format for r in references}
    if len(formats) > 1:
        raise ValueError("the references were encoded by VAEs with different latent statistics; encode every "
                         "reference with the same Qwen-Image 2.1 VAE.")
    return Conditioning(
        text=encoded.embeds.detach().float().cpu(),
        image_slots=encoded.image_slots.detach().cpu(),
        references=tokens,
        ref_shapes=tuple(r.shape for r in references),
        ref_crops=tuple(r.prepared.crop for r in references),
        latent_format=formats.pop() if formats else RELEASED_LATENT_FORMAT,
        lead_key=lead_key(encoded.token_ids, text_encoder.vision_end_id, references),
    )


def lead_key(token_ids: torch.Tensor, vision_end_id: int, references) -> str | None:
    """SHA-256 of a prompt's leading run as the user gave it: the kept token ids up to the last `<|vision_end|>`
    and each reference's resized RGBA pixels with their size. Tokenizer and resize are deterministic, so equal
    inputs give equal keys on any machine. None without references."""
    if not references:
        return None
    ids = token_ids.detach().cpu().to(torch.int64)
    ends = (ids == vision_end_id).nonzero().flatten()
    if not len(ends):
        return None
    hasher = hashlib.sha256(b"qi21-lead")
    hasher.update(ids[: int(ends[-1]) + 1].numpy().tobytes())
    for reference in references:
        pixels = reference.prepared.pixels.detach().contiguous().cpu().float()
        hasher.update(repr(tuple(pixels.shape)).encode() + pixels.numpy().tobytes())
    return hasher.hexdigest()


@torch.no_grad()
def decode_images(vae: QwenImage21VAE, raw_latents: torch.Tensor, tiled: bool | None = None):
    """Raw latents `(B, 64, h, w)` -> `(rgb [B,H,W,3], mask [B,H,W] (1 = transparent), rgba [B,H,W,4])` in [0, 1]."""
    pixels = vae.decode(raw_latents, tiled=tiled).float().cpu()  # (B, 4, H, W) in [-1, 1]
    rgba = ((pixels + 1) / 2).clamp(0, 1).movedim(1, -1).contiguous()
    return rgba[..., :3].contiguous(), 1.0 - rgba[..., 3], rgba


@torch.no_grad()
def encode_images(vae: QwenImage21VAE, image, mask=None, tiled: bool | None = None, fit: str = "crop",
                  fill: str = DEFAULT_FILL) -> tuple[torch.Tensor, str | None]:
    """ComfyUI IMAGE `[B, H, W, C]` (C = 3 or 4; 1 = grey) and optional MASK (1 = transparent) -> raw VAE latents
    `(B, 64, H/16, W/16)` fp32 on the CPU, and a note when the image was cropped.

    RGB gets an opaque alpha; a mask replaces the alpha (alpha = 1 - mask). Pixels are used as they are (no 8-bit
    rounding), `2x - 1`, as the reference pipeline's image processor does. Sides are centre-cropped to multiples
    of 32, the sizes the samplers generate (ComfyUI crops to the VAE's 16 the same way). `fit = "pad"` keeps
    every pixel instead: the images are padded on the right and bottom to multiples of 32 (`canvas.pad_images`,
    transparent padding when the images have transparency), so the picture keeps its own pixel grid at (0, 0).
    """
    if fit not in ("crop", "pad"):
        raise ValueError(f"fit must be crop or pad; got {fit!r}.")
    pixels = torch.as_tensor(image).detach().to("cpu", torch.float32)
    if pixels.ndim == 3:
        pixels = pixels[None]
    if pixels.ndim != 4 or pixels.shape[-1] not in (1, 3, 4) or 0 in pixels.shape:
        raise ValueError(f"image must be a ComfyUI IMAGE [B, H, W, C] with C = 3 or 4; got {list(pixels.shape)}.")
    if not torch.isfinite(pixels).all():
        raise ValueError("image holds NaN or infinite values.")
    if pixels.shape[-1] == 1:
        pixels = pixels.expand(-1, -1, -1, 3)
    if pixels.shape[-1] == 3:
        pixels = torch.cat([pixels, torch.ones_like(pixels[..., :1])], dim=-1)
    batch, height, width = pixels.shape[:3]
    if mask is not None:
        pixels = pixels.clone()
        pixels[..., 3] = 1.0 - _mask_for(mask, batch, height, width)
    note = None
    if fit == "pad":
        canvas = padded_size(width, height)
        transparent = bool((pixels[..., 3] < 1.0).any())
        pixels = pad_images(pixels, canvas, fill, 0.0 if transparent else None)
        if canvas != (width, height):
            note = f"image {width}x{height} padded to {canvas[0]}x{canvas[1]} (multiples of 32)"
        width, height = canvas  # nothing left to crop
    crop_h, crop_w = height // 32 * 32, width // 32 * 32
    if min(crop_h, crop_w) == 0:
        raise ValueError(f"image is {width}x{height}; the VAE needs at least 32x32 pixels.")
    if (crop_h, crop_w) != (height, width):
        top, left = (height - crop_h) // 2, (width - crop_w) // 2
        pixels = pixels[:, top : top + crop_h, left : left + crop_w]
        note = f"image {width}x{height} centre-cropped to {crop_w}x{crop_h} (multiples of 32)"
    x = (2.0 * pixels.clamp(0.0, 1.0) - 1.0).movedim(-1, 1).contiguous()  # (B, 4, H, W) in [-1, 1]
    raw = torch.cat([vae.encode(x[i : i + 1], tiled=tiled).float().cpu() for i in range(batch)])
    if not bool(torch.isfinite(raw).all()):
        raise FloatingPointError(f"The VAE encoded the image to NaN/inf latents (it runs in {vae.dtype}); load the "
                                 "VAE with weight_dtype bf16 or fp32.")
    return raw, note


def _mask_for(mask, batch: int, height: int, width: int) -> torch.Tensor:
    """MASK `[H, W]` or `[B, H, W]` (1 = transparent) as `(batch, H, W)`: one mask broadcasts over the batch; a
    constant mask of any size (LoadImage's 64x64 placeholder) is broadcast too; otherwise sizes must match."""
    values = torch.as_tensor(mask).detach().to("cpu", torch.float32)
    if values.ndim == 2:
        values = values[None]
    if values.ndim != 3 or values.numel() == 0 or values.shape[0] not in (1, batch):
        raise ValueError(f"mask must be [H, W] or [B, H, W] with B = 1 or {batch}; got {list(values.shape)}.")
    if tuple(values.shape[1:]) != (height, width):
        if values.min() != values.max():
            raise ValueError(f"mask is {values.shape[2]}x{values.shape[1]} but the image is {width}x{height}; "
                             "resize the mask to the image first.")
        values = values.flatten()[:1].view(1, 1, 1).expand(values.shape[0], height, width)
    return values.clamp(0.0, 1.0).expand(batch, -1, -1)
