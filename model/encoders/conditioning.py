"""What a prompt hands to the sampler: the text encoder's states, where the image slots are, and the
references' latents. Immutable, and fingerprinted by content so a kept prefix cache can be found again."""

import hashlib
from dataclasses import dataclass, field

import torch

from ..transformer.layout import SequenceLayout, build_layout
from ..vae.latents import RELEASED_LATENT_FORMAT, LatentFormat


def _tensor_digest(hasher, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().contiguous().cpu()
    hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    hasher.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")


@dataclass(frozen=True, eq=False)
class Conditioning:
    """One prompt with its references.

    Attributes:
        text: `(L, context_dim)` text-encoder states over the kept VLM sequence (padding removed).
        image_slots: `(L,)` bool, True at the `<|image_pad|>` positions (each stands for 2x2 latent tokens).
        references: `(sum h*w, 64)` packed, normalised reference latents (row-major per reference), or None.
        ref_shapes: latent `(h, w)` of each reference, in prompt order.
        ref_crops: per reference, the box `(width, height)` of its own pixels in a padded reference
            (`fit = "pad"`), or None for a resized one; empty when unknown. Not part of the fingerprint: the
            box changes what is cut from the output, not a key or value of the prefix.
        latent_format: the VAE statistics the references were normalised with; the sampler turns its output
            back into raw latents with the same (the released ones when there are no references).
        lead_key: a hash of what the user gave for the prompt's leading run (the token ids up to the last
            reference and the references' resized pixels), the same on every machine; None when unknown or
            without references. The report's `prefix_key`.
    """

    text: torch.Tensor
    image_slots: torch.Tensor
    references: torch.Tensor | None = None
    ref_shapes: tuple[tuple[int, int], ...] = ()
    ref_crops: tuple[tuple[int, int] | None, ...] = ()
    latent_format: LatentFormat = RELEASED_LATENT_FORMAT
    lead_key: str | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.text.ndim != 2 or self.image_slots.shape != self.text.shape[:1]:
            raise ValueError(
                f"Conditioning needs text (L, dim) and image_slots (L,); got {tuple(self.text.shape)} and "
                f"{tuple(self.image_slots.shape)}."
            )
        ref_tokens = sum(h * w for h, w in self.ref_shapes)
        got = 0 if self.references is None else self.references.shape[0]
        if got != ref_tokens:
            raise ValueError(f"ref_shapes {list(self.ref_shapes)} hold {ref_tokens} latent tokens, references {got}.")

    def fingerprint(self) -> str:
        """Content hash (text states, slots, references, shapes): equal for equal conditioning."""
        if "fingerprint" not in self._memo:
            hasher = hashlib.sha256()
            for tensor in (self.text, self.image_slots) + (() if self.references is None else (self.references,)):
                _tensor_digest(hasher, tensor)
            hasher.update(repr(self.ref_shapes).encode())
            self._memo["fingerprint"] = hasher.hexdigest()
        return self._memo["fingerprint"]

    def layout(self, target_shape: tuple[int, int]) -> SequenceLayout:
        key = ("layout", tuple(target_shape))
        if key not in self._memo:
            self._memo[key] = build_layout(self.image_slots, self.ref_shapes, target_shape)
        return self._memo[key]
