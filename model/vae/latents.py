"""The latent space of Qwen-Image 2.1 in one place: sizes, token counts, normalisation and a cheap preview.

Sizes. The VAE compresses 16x per side into 64 channels (one latent token per 16x16 px); the VLM sees one image
token per 32x32 px (patch 16, 2x2 merge), which stands for 2x2 latent tokens. The reference pipeline floors
every target side to a multiple of 32 so both counts agree; the target's token count drives the Base schedule.

Latent convention. ComfyUI's LATENT holds raw VAE latents `(B, 64, H/16, W/16)`; the DiT reads and writes
normalised ones, `(z - mean) / std` per channel. The statistics belong to the VAE (its `config.json`); a
`LatentFormat` built from them is the only code that converts in either direction: the VAE uses its own, a
reference's latents carry it into the conditioning, and the sampler converts back with the same one.
"""

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

LATENT_CHANNELS = 64
LATENT_TOKEN_PIXELS = 16  # the VAE's spatial compression: one latent token per 16x16 px
VLM_TOKEN_PIXELS = 32  # one VLM image token: the vision patch 16 x its 2x2 spatial merge
LATENT_TOKENS_PER_SLOT = (VLM_TOKEN_PIXELS // LATENT_TOKEN_PIXELS) ** 2  # one VLM image slot = 2x2 latent tokens
SIZE_MULTIPLE = VLM_TOKEN_PIXELS  # target sides are floored to this, as the reference pipeline does
DEFAULT_SIZE = 1024  # a side of 0 without references

#: `vae/config.json` latents_mean / latents_std (listed in docs/checkpoints.md); ComfyUI's `latent_formats.QwenImage21`
#: agrees.
LATENTS_MEAN = (
    0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722, 1.8873, -1.7177, -0.6510, 0.2732, 0.7562,
    -0.6163, -1.0277, 3.8363, 2.0210, 0.0472, 0.9320, 2.0087, 2.4954, -0.1391, -1.4249, 1.8464, -0.5236, 1.2826,
    3.7046, -1.3035, 2.7286, -1.4518, -1.9036, -1.9955, -0.0342, -1.0265, -0.7636, 3.0555, 0.0746, -3.0751, -0.1076,
    1.7376, -1.0914, -1.9435, -0.2784, -1.3680, 0.4809, -0.4433, 0.3764, 0.5729, -2.0595, 1.0960, -1.3260, -2.0211,
    -5.0179, 0.5275, 4.0162, 1.8505, 0.3026, 1.9373, 1.4937, 0.2632, 0.5547, -1.7121, -0.1562, 0.0304,
)
LATENTS_STD = (
    3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.7910, 3.0785, 3.6500, 3.9308, 3.0904, 2.8778, 3.7675,
    3.7320, 5.0756, 3.2864, 4.0397, 3.1317, 4.0443, 2.9249, 3.9454, 3.0988, 4.2489, 3.4896, 3.8513, 3.9323, 3.4719,
    3.7498, 4.2830, 3.5694, 4.2467, 3.9037, 3.2947, 5.0770, 3.5075, 3.2700, 3.4767, 2.8063, 5.1125, 3.5327, 4.7833,
    3.1286, 4.1819, 3.8527, 3.8312, 3.5605, 4.3875, 3.9624, 4.0168, 3.5643, 4.0550, 5.5614, 4.2963, 4.4080, 3.4959,
    3.8747, 3.7608, 3.5735, 3.1490, 3.7662, 3.6746, 3.4563, 3.8161,
)


def sampling_size(width: int, height: int) -> tuple[int, int]:
    """Floor `(width, height)` to multiples of 32 px, as the reference pipeline does before it makes latents.

    The floored size is what is generated, and so what decides the number of latent tokens. Raises ValueError
    below 32 px.
    """
    w, h = int(width) // SIZE_MULTIPLE * SIZE_MULTIPLE, int(height) // SIZE_MULTIPLE * SIZE_MULTIPLE
    if w < SIZE_MULTIPLE or h < SIZE_MULTIPLE:
        raise ValueError(f"width and height must be at least {SIZE_MULTIPLE} px; got {width}x{height}.")
    return w, h


def latent_shape(width: int, height: int) -> tuple[int, int]:
    """Latent `(h, w)` in tokens of a `width x height` px target, after flooring to 32 px."""
    w, h = sampling_size(width, height)
    return h // LATENT_TOKEN_PIXELS, w // LATENT_TOKEN_PIXELS


def latent_tokens(width: int, height: int) -> int:
    """Target latent tokens `L = (H/16) * (W/16)` after flooring to 32 px (references never count)."""
    h, w = latent_shape(width, height)
    return h * w


def target_size(width: int, height: int, last_reference: tuple[int, int] | None = None) -> tuple[int, int]:
    """The size to generate before flooring: a 0 side follows the last reference (latent `(h, w)`; the reference
    pipeline's default: its area ~ resolution^2 in the reference's aspect), or 1024 without references."""
    if last_reference is not None:
        default_w, default_h = last_reference[1] * LATENT_TOKEN_PIXELS, last_reference[0] * LATENT_TOKEN_PIXELS
    else:
        default_w = default_h = DEFAULT_SIZE
    return (width or default_w), (height or default_h)


@dataclass(frozen=True)
class LatentFormat:
    """Per-channel statistics of a VAE's latents: `normalize` (raw -> DiT space) and `denormalize` (back)."""

    mean: tuple[float, ...] = LATENTS_MEAN
    std: tuple[float, ...] = LATENTS_STD

    def __post_init__(self):
        if len(self.mean) != len(self.std):
            raise ValueError(f"latents_mean has {len(self.mean)} values, latents_std {len(self.std)}.")

    @property
    def channels(self) -> int:
        return len(self.mean)

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # cast to the latents' dtype first, as the diffusers pipeline does
        shape = (1, self.channels, 1, 1)
        mean = torch.tensor(self.mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(self.std).view(shape).to(like.device, like.dtype)
        return mean, std

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw VAE latents `(B, C, h, w)` -> what the DiT reads, `(z - mean) / std`."""
        mean, std = self._stats(raw)
        return (raw - mean) / std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """DiT-space latents `(B, C, h, w)` -> raw VAE latents, `latents * std + mean`."""
        mean, std = self._stats(latents)
        return latents * std + mean


RELEASED_LATENT_FORMAT = LatentFormat()


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
