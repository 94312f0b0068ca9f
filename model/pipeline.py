"""The steps between components, shared by the ComfyUI nodes and plain-Python callers.

reference image -> (VAE latents + VLM pixels) -> prompt encoding -> Conditioning -> sampling -> raw latents
-> VAE decode -> RGB, alpha mask and RGBA in ComfyUI's conventions (`[B, H, W, C]` floats in [0, 1]).
"""

from dataclasses import dataclass

import torch

from .conditioning import Conditioning
from .references import PreparedReference
from .text_encoder import QwenImageTextEncoder
from .vae import QwenImage21VAE

MAX_REFERENCES = 10  # the released model's limit (`<image1>`..`<image10>`)
DEFAULT_SIZE = 1024


@dataclass(frozen=True, eq=False)
class Reference:
    """One reference image, resized once: the VLM sees `prepared.vlm_image`, the DiT its latent tokens."""

    prepared: PreparedReference
    tokens: torch.Tensor  # (h*w, 64) normalised latents, row-major, fp32 on the CPU
    shape: tuple[int, int]  # latent (h, w)


@torch.no_grad()
def encode_prepared(vae: QwenImage21VAE, prepared: PreparedReference, tiled: bool | None = None) -> Reference:
    """VAE-encode all 4 channels of a reference already resized by `prepare_reference`."""
    raw = vae.encode(prepared.pixels, tiled=tiled)  # (1, 64, h, w)
    if not bool(torch.isfinite(raw).all()):
        raise FloatingPointError(
            f"The VAE encoded the {prepared.width}x{prepared.height} reference to NaN/inf latents (it runs in "
            f"{next(vae.parameters()).dtype}); load the VAE with weight_dtype bf16 or fp32."
        )
    latents = vae.normalize(raw.float())[0]
    return Reference(prepared, latents.flatten(1).T.contiguous().cpu(), tuple(latents.shape[1:]))


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
    return Conditioning(
        text=encoded.embeds.detach().float().cpu(),
        image_slots=encoded.image_slots.detach().cpu(),
        references=tokens,
        ref_shapes=tuple(r.shape for r in references),
    )


def target_size(width: int, height: int, conditioning: Conditioning) -> tuple[int, int]:
    """The size to generate: a 0 side follows the last reference (the reference pipeline's default: its area
    ~ resolution^2 in the reference's aspect), or 1024 without references. Sides are floored to x32 later."""
    if conditioning.ref_shapes:
        last_h, last_w = conditioning.ref_shapes[-1]
        default_w, default_h = last_w * 16, last_h * 16
    else:
        default_w = default_h = DEFAULT_SIZE
    return (width or default_w), (height or default_h)


@torch.no_grad()
def decode_images(vae: QwenImage21VAE, raw_latents: torch.Tensor, tiled: bool | None = None):
    """Raw latents `(B, 64, h, w)` -> `(rgb [B,H,W,3], mask [B,H,W] (1 = transparent), rgba [B,H,W,4])` in [0, 1]."""
    pixels = vae.decode(raw_latents, tiled=tiled).float().cpu()  # (B, 4, H, W) in [-1, 1]
    rgba = ((pixels + 1) / 2).clamp(0, 1).movedim(1, -1).contiguous()
    return rgba[..., :3].contiguous(), 1.0 - rgba[..., 3], rgba
