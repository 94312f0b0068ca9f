"""Looking at the toy's pictures: what a generated image shows (background, the shape's colour and side), and a
small pipeline that makes images from prompts through the pack's own loaders, encoders and sampler.

The tests (tests/test_toy_model.py), the yardstick (benchmarks/quality.py variants) and the main job's contact sheet use
these; the picture checks are deliberately plain (a background from the corners, the shape's pixels as those far
from it, the nearest palette colour of their mean, the nearest position of their centroid), so a reader can verify
them by eye on the contact sheet.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..model.encoders.pipeline import decode_images, encode_prepared, encode_prompt
from ..model.encoders.references import prepare_reference
from ..model.loaders.dit import load_dit
from ..model.loaders.text_encoder import load_text_encoder
from ..model.loaders.vae import load_vae
from ..model.sampling.loop import sample
from ..model.sampling.schedule import base_sigmas, turbo_sigmas
from .toy_data import COLOURS, POSITIONS, SIZE

# -- what a picture shows --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    background: str  # "white", "black" or "transparent"
    colour: str | None  # the nearest palette colour of the shape's pixels (None: no shape found)
    position: str | None  # the nearest named position of their centroid
    centroid: tuple[float, float] | None  # (x, y) in pixels
    coverage: float  # the share of the image the shape covers

    @property
    def reading(self) -> tuple:
        """What a viewer would say: (background, colour, position)."""
        return self.background, self.colour, self.position


def analyse(rgba) -> Finding:
    """What an `(H, W, 4)` RGBA image in [0, 1] (tensor or array) shows."""
    image = np.asarray(torch.as_tensor(rgba).float().cpu())
    height, width = image.shape[:2]
    corners = np.concatenate([image[:8, :8], image[:8, -8:], image[-8:, :8], image[-8:, -8:]]).reshape(-1, 4)
    corner = np.median(corners, axis=0)
    if corner[3] < 0.5:
        background, shape = "transparent", image[..., 3] > 0.5
    else:
        background = "white" if corner[:3].mean() > 0.5 else "black"
        shape = (np.abs(image[..., :3] - corner[:3]).max(axis=-1) > 0.35) & (image[..., 3] > 0.5)
    coverage = float(shape.mean())
    if shape.sum() < 0.002 * height * width:
        return Finding(background, None, None, None, coverage)
    mean_rgb = image[..., :3][shape].mean(axis=0) * 255
    colour = min(COLOURS, key=lambda name: float(np.linalg.norm(mean_rgb - np.array(COLOURS[name]))))
    ys, xs = np.nonzero(shape)
    centroid = (float(xs.mean()) * SIZE / width, float(ys.mean()) * SIZE / height)
    position = min(POSITIONS, key=lambda name: math.dist(centroid, POSITIONS[name]))
    return Finding(background, colour, position, centroid, coverage)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two images in [0, 1] (inf when equal)."""
    mse = float((a.float() - b.float()).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean SSIM of two `(H, W, C)` images in [0, 1]: 11x11 Gaussian windows (sigma 1.5), per channel, the
    standard constants (Wang et al. 2004)."""
    x, y = (t.float().movedim(-1, 0)[:, None] for t in (a, b))  # (C, 1, H, W)
    coords = torch.arange(11, dtype=torch.float32) - 5
    g = torch.exp(-coords**2 / (2 * 1.5**2))
    g = (g / g.sum())
    window = (g[:, None] * g[None, :])[None, None]

    def blur(t):
        return torch.nn.functional.conv2d(t, window)

    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    c1, c2 = 0.01**2, 0.03**2
    value = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(value.mean())


# -- making pictures -------------------------------------------------------------------------------------------
class ToyPipeline:
    """The toy's text encoder, VAE and DiTs loaded from a models folder (`write_toy_checkpoints`), the way the
    loader nodes load them; `generate` runs the pack's sampler and decoder."""

    def __init__(self, root: Path, weight_dtype: str = "fp32", dit_file: str | None = None):
        root = Path(root)
        self.root = root
        self.text_encoder = load_text_encoder(root / "text_encoders" / "qwen3vl_8b_bf16.safetensors",
                                              weight_dtype="fp32")
        self.vae = load_vae(root / "vae" / "qwen_image_2.1_vae_bf16.safetensors", weight_dtype="fp32")
        self.models = {}
        self.weight_dtype = weight_dtype
        self.dit_file = dit_file or "qwen_image_2.1_bf16.safetensors"

    def dit(self, file: str | None = None, weight_dtype: str | None = None):
        key = (file or self.dit_file, weight_dtype or self.weight_dtype)
        if key not in self.models:
            self.models[key] = load_dit(self.root / "diffusion_models" / key[0], weight_dtype=key[1])
        return self.models[key]

    def load(self, path: Path, weight_dtype: str | None = None):
        """Another DiT file (GGUF, a quantized file) of the same model, as the loader node loads it."""
        return load_dit(path, weight_dtype=weight_dtype or self.weight_dtype)

    def reference(self, image):
        """A PIL scene (or ComfyUI IMAGE) as the reference node prepares it at the toy's size."""
        return encode_prepared(self.vae, prepare_reference(image, resolution=SIZE))

    def condition(self, prompt: str, references=()):
        return encode_prompt(self.text_encoder, prompt, references)

    @torch.no_grad()
    def generate(self, prompt, seed: int = 0, references=(), steps: int = 40, turbo: bool = False, model=None,
                 negative: str | None = None, cfg: float = 1.0, batch_size: int = 1, **options):
        """RGBA images `(B, H, W, 4)` in [0, 1] and the sampler's report. `prompt` may be a Conditioning;
        `options` go to `sampling.loop.sample` (cache_dtype, keep_cache, store, ...)."""
        positive = prompt if not isinstance(prompt, str) else self.condition(prompt, references)
        negative = None if negative is None else self.condition(negative, references)
        sigmas = turbo_sigmas() if turbo else base_sigmas(steps, SIZE, SIZE)
        result = sample(model or self.dit("qwen_image_2.1_turbo_bf16.safetensors" if turbo else None), positive,
                        sigmas=sigmas, width=SIZE, height=SIZE, seed=seed, batch_size=batch_size,
                        negative=negative, cfg=cfg, **options)
        raw = positive.latent_format.denormalize(result.latents.float())
        return decode_images(self.vae, raw)[2], result.report
