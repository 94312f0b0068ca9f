"""ComfyUI's core nodes that the example workflows use (LoadImage, SaveImage, PreviewImage, MaskPreview), in
the minimal form the headless runner (run_workflows.py) needs, with ComfyUI's conventions; plus the example
images the runner writes for every LoadImage name that is missing."""

import json
import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from PIL.PngImagePlugin import PngInfo

from ..nodes.bridge import io

EXAMPLE_IMAGES = ("qi21_example_rgb.png", "qi21_example_rgba.png")  # always provided in the input folder
ALPHA_HINTS = ("rgba", "alpha", "transparent", "cutout")


class WorkflowError(Exception):
    """A workflow that cannot run; the message says which node and why."""


def wants_alpha(name: str) -> bool:
    """Whether a generated example is RGBA: the name mentions alpha/rgba/transparent/cutout, or its stem ends in
    an odd number (`example_1.png`, `example_3.png`), so multi-reference workflows get both kinds."""
    stem = Path(name).stem.lower()
    digits = re.search(r"(\d+)$", stem)
    return any(hint in stem for hint in ALPHA_HINTS) or (digits is not None and int(digits.group(1)) % 2 == 1)


def example_image(name: str) -> Image.Image:
    """A deterministic example picture: 512x384 RGB, or 384x512 RGBA (transparent background, a soft-edged
    disc) when `wants_alpha(name)`. Both stay above the vision processor's 65536-pixel minimum at any
    `resolution` (0 keeps 512x384 / 384x512)."""
    rgba = wants_alpha(name)
    width, height = (384, 512) if rgba else (512, 384)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = x / (width - 1), y / (height - 1)
    rgb = np.stack([0.2 + 0.6 * u, 0.3 + 0.5 * v, 0.8 - 0.5 * u * v], axis=-1)
    radius = np.hypot(x - 0.55 * width, y - 0.45 * height) / (0.3 * min(width, height))
    rgb = np.where((radius < 1)[..., None], np.array([0.9, 0.35, 0.2], np.float32), rgb)
    rgb[(np.abs(u - 0.25) < 0.08) & (np.abs(v - 0.7) < 0.12)] = (0.15, 0.6, 0.25)
    pixels = np.clip(np.rint(rgb * 255), 0, 255).astype(np.uint8)
    if not rgba:
        return Image.fromarray(pixels, "RGB")
    alpha = np.clip(np.rint(255 * np.clip(1.5 - radius, 0, 1)), 0, 255).astype(np.uint8)  # opaque disc, soft rim
    return Image.fromarray(np.dstack([pixels, alpha]), "RGBA")


def input_file_name(value) -> str:
    """LoadImage's file name without ComfyUI's ` [input]` annotation, refused when it leaves the folder."""
    name = str(value).strip()
    for tag in (" [input]", " [output]", " [temp]"):
        name = name.removesuffix(tag)
    path = Path(name)
    if not name or path.is_absolute() or ".." in path.parts:
        raise WorkflowError(f"LoadImage image {value!r}: give a file name inside the input folder.")
    return name


def write_example_images(input_dir: Path, names) -> list[Path]:
    """Create the example images and every image the workflows name that is missing; never overwrites."""
    written = []
    for name in dict.fromkeys([*EXAMPLE_IMAGES, *names]):
        path = input_dir / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            example_image(name).save(path)
            written.append(path)
    return written


def load_image(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's LoadImage for one frame: IMAGE `[1, H, W, 3]` float in [0, 1] (alpha dropped) and MASK
    `[1, H, W]` = 1 - alpha, or a `[1, 64, 64]` zero mask when the file has no alpha."""
    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened)
        if image.mode == "I":
            image = image.point(lambda value: value * (1 / 255))
        rgb = torch.from_numpy(np.array(image.convert("RGB")).astype(np.float32) / 255.0)[None]
        if "A" in image.getbands():
            mask = 1.0 - torch.from_numpy(np.array(image.getchannel("A")).astype(np.float32) / 255.0)
        elif image.mode == "P" and "transparency" in image.info:
            mask = 1.0 - torch.from_numpy(np.array(image.convert("RGBA").getchannel("A")).astype(np.float32) / 255.0)
        else:
            mask = torch.zeros((64, 64), dtype=torch.float32)
    return rgb, mask[None]


def save_images(images: torch.Tensor, folder: Path, prefix: str, prompt: dict) -> list[Path]:
    """Write `[B, H, W, C]` images (C = 3: RGB, C = 4: RGBA) as `{prefix}_{counter:05}_.png`, as ComfyUI does."""
    if images.ndim != 4 or images.shape[-1] not in (3, 4):
        raise WorkflowError(f"SaveImage needs IMAGE [B, H, W, 3 or 4], got {list(images.shape)}.")
    relative = Path(prefix or "ComfyUI")
    if relative.is_absolute() or ".." in relative.parts:
        raise WorkflowError(f"filename_prefix {prefix!r} must stay inside the output folder.")
    target = folder / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    counter = 1 + max((int(p.name[len(target.name) + 1: -5]) for p in target.parent.glob(f"{target.name}_*_.png")
                       if p.name[len(target.name) + 1: -5].isdigit()), default=0)
    metadata = PngInfo()
    metadata.add_text("prompt", json.dumps(prompt))
    written = []
    for image in images.detach().float().cpu().numpy():
        pixels = np.clip(255.0 * image, 0, 255).astype(np.uint8)  # ComfyUI truncates, it does not round
        path = target.parent / f"{target.name}_{counter:05}_.png"
        mode = "RGBA" if pixels.shape[-1] == 4 else "RGB"
        Image.fromarray(pixels, mode).save(path, pnginfo=metadata, compress_level=4)
        written.append(path)
        counter += 1
    return written


def save_latent(samples: dict, folder: Path, prefix: str) -> list[Path]:
    """Core SaveLatent: the LATENT's raw `samples` as `{prefix}_{counter:05}_.latent`, a safetensors file holding
    `latent_tensor` (what ComfyUI writes), so two runs can be compared exactly rather than through 8-bit PNGs."""
    from safetensors.torch import save_file

    relative = Path(prefix or "latents/ComfyUI")
    if relative.is_absolute() or ".." in relative.parts:
        raise WorkflowError(f"filename_prefix {prefix!r} must stay inside the output folder.")
    target = folder / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    counter = 1 + sum(1 for _ in target.parent.glob(f"{target.name}_*_.latent"))
    path = target.parent / f"{target.name}_{counter:05}_.latent"
    save_file({"latent_tensor": samples["samples"].detach().float().contiguous().cpu()}, str(path))
    return [path]


def core_schemas() -> dict:
    """Schemas of the core nodes this runner implements (the inputs and outputs the workflows use)."""
    return {
        "LoadImage": io.Schema(node_id="LoadImage", category="image", inputs=[io.String.Input("image")],
                               outputs=[io.Image.Output(display_name="IMAGE"), io.Mask.Output(display_name="MASK")]),
        "SaveImage": io.Schema(node_id="SaveImage", category="image", is_output_node=True,
                               inputs=[io.Image.Input("images"),
                                       io.String.Input("filename_prefix", default="ComfyUI", optional=True)]),
        "SaveLatent": io.Schema(node_id="SaveLatent", category="latent", is_output_node=True,
                                inputs=[io.Latent.Input("samples"),
                                        io.String.Input("filename_prefix", default="latents/ComfyUI", optional=True)]),
        "PreviewImage": io.Schema(node_id="PreviewImage", category="image", is_output_node=True,
                                  inputs=[io.Image.Input("images")]),
        "MaskPreview": io.Schema(node_id="MaskPreview", category="mask", is_output_node=True,
                                 inputs=[io.Mask.Input("mask")]),
        "SetLatentNoiseMask": io.Schema(node_id="SetLatentNoiseMask", category="latent",
                                        inputs=[io.Latent.Input("samples"), io.Mask.Input("mask")],
                                        outputs=[io.Latent.Output(display_name="LATENT")]),
        "ManualSigmas": io.Schema(node_id="ManualSigmas", category="sampling", inputs=[io.String.Input("sigmas")],
                                  outputs=[io.Sigmas.Output(display_name="SIGMAS")]),
    }


def set_latent_noise_mask(samples: dict, mask: torch.Tensor) -> tuple[dict]:
    """Core SetLatentNoiseMask: the LATENT with the mask as `(B, 1, H, W)` `noise_mask` (resized later)."""
    return ({**samples, "noise_mask": mask.reshape(-1, 1, *mask.shape[-2:])},)


def manual_sigmas(sigmas: str) -> tuple[torch.Tensor]:
    """Core ManualSigmas: every number in the text, in order, as a float tensor."""
    return (torch.tensor([float(v) for v in re.findall(r"[-+]?(?:\d*\.*\d+)", sigmas)], dtype=torch.float32),)
