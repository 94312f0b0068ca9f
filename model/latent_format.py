"""Latent conventions between the sampler, ComfyUI's LATENT and the VAE, and a cheap RGB preview.

ComfyUI's LATENT holds raw VAE latents `(B, 64, H/16, W/16)`; the DiT works on normalised ones,
`(z - mean) / std` with the published 64 + 64 numbers (`vae.LATENTS_MEAN/STD`).
"""

import numpy as np
import torch
from PIL import Image

from .vae import LATENTS_MEAN, LATENTS_STD

# Linear map from normalised latent channels to RGB in [-1, 1], and its bias: ComfyUI's published preview
# factors for this latent space (`latent_formats.QwenImage21`). Good enough to watch composition and colour
# arrive step by step; the real image comes from the VAE.
PREVIEW_RGB_FACTORS = (
    (-0.0158, -0.0115, -0.0174), (0.0030, 0.0120, 0.0027), (0.0637, 0.0470, -0.0127), (0.0360, 0.0661, -0.0030),
    (0.0159, 0.0181, 0.0082), (0.0132, 0.0326, 0.0169), (0.0191, 0.0261, 0.0136), (-0.0146, -0.0276, -0.0361),
    (0.0187, -0.0024, -0.0072), (-0.1059, -0.0090, 0.0350), (-0.0195, -0.0226, -0.0138), (-0.0295, 0.0024, -0.0215),
    (0.0191, -0.0393, -0.0001), (-0.0144, -0.0166, -0.0272), (0.0389, 0.0430, 0.0445), (-0.0153, -0.0336, 0.0031),
    (0.0339, 0.0122, 0.0220), (-0.0136, -0.0078, -0.0120), (-0.0340, -0.0282, -0.0245), (-0.0133, -0.0176, -0.0133),
    (0.0109, -0.0087, 0.0096), (-0.0010, 0.0044, 0.0016), (0.0301, 0.0053, 0.0361), (-0.0281, -0.0205, -0.0032),
    (-0.0725, 0.0002, 0.0160), (-0.0036, 0.0158, 0.0807), (0.0087, 0.0040, -0.0053), (-0.0260, 0.0183, -0.0077),
    (-0.0039, -0.0035, -0.0107), (-0.0026, 0.0172, 0.0237), (0.0088, 0.0078, 0.0078), (-0.0087, -0.0310, -0.0122),
    (-0.0027, 0.0018, 0.0094), (-0.0064, 0.0292, -0.0256), (0.0594, 0.1049, 0.1180), (0.0103, -0.0103, -0.0026),
    (-0.0091, 0.0025, -0.0015), (0.0178, 0.0243, 0.0292), (-0.0063, -0.0012, 0.0202), (0.0452, 0.0246, 0.0143),
    (0.0149, 0.0270, 0.0052), (0.1484, 0.0801, 0.0804), (-0.0120, 0.0040, 0.0010), (0.0181, 0.0051, -0.0021),
    (0.0132, 0.0050, 0.0019), (0.0291, 0.0020, 0.0092), (0.0066, -0.0410, -0.1314), (-0.1153, -0.0629, -0.0802),
    (0.0258, 0.0378, 0.0298), (0.0375, 0.1139, 0.0468), (-0.0142, -0.0126, -0.0276), (0.0339, 0.0153, 0.0138),
    (0.0346, 0.0211, 0.0267), (0.0369, -0.0431, -0.0993), (-0.0052, -0.0092, 0.0056), (-0.0279, 0.0410, -0.0357),
    (0.0036, 0.0017, -0.0083), (-0.0441, -0.0367, -0.0454), (-0.0001, -0.0092, -0.0001), (-0.0222, -0.0183, -0.0051),
    (0.0039, 0.0053, -0.0184), (-0.0094, -0.0075, -0.0143), (-0.0066, -0.0088, -0.0063), (0.0220, 0.0074, 0.0100),
)
PREVIEW_RGB_BIAS = (-0.1228, -0.1869, -0.3083)


def _stats(like: torch.Tensor):
    shape = (1, len(LATENTS_MEAN), 1, 1)
    mean = torch.tensor(LATENTS_MEAN).view(shape).to(like.device, like.dtype)
    std = torch.tensor(LATENTS_STD).view(shape).to(like.device, like.dtype)
    return mean, std


def to_raw(latents: torch.Tensor) -> torch.Tensor:
    """Normalised (DiT) latents -> raw VAE latents, `latents * std + mean`."""
    mean, std = _stats(latents)
    return latents * std + mean


def to_normalized(raw: torch.Tensor) -> torch.Tensor:
    """Raw VAE latents -> normalised (DiT) latents, `(z - mean) / std`."""
    mean, std = _stats(raw)
    return (raw - mean) / std


def preview_image(denoised: torch.Tensor, max_side: int = 512) -> Image.Image:
    """RGB PIL preview of the first sample of normalised latents `(B, 64, h, w)`: one pixel per latent."""
    factors = torch.tensor(PREVIEW_RGB_FACTORS, dtype=torch.float32)
    bias = torch.tensor(PREVIEW_RGB_BIAS, dtype=torch.float32)
    rgb = torch.einsum("chw,cr->hwr", denoised[0].float().cpu(), factors) + bias
    pixels = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    image = Image.fromarray(np.ascontiguousarray(pixels), "RGB")
    scale = max_side / max(image.size)
    if scale < 1:
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
    return image
