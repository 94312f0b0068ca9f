"""The main job on the trained toy: the shipped workflows with a prompt of the toy's vocabulary in place of theirs
(they were written for the real model), toy scenes as their input images, and a contact sheet of every output.

Only the shipped workflows are rewritten (`toy_overrides`); a graph a user passes with `--workflows` runs as
written, on the toy's weights.
"""

import math
from pathlib import Path

from PIL import Image, ImageDraw

from .toy_data import SIZE, Item, Scene

#: The prompt each shipped workflow runs with on the toy (its own prompt is for the real model).
TOY_PROMPTS = {
    "text_to_image_base": "a large red circle on the left, white background",
    "text_to_image_turbo": "a large blue square on the right, black background",
    "transparent_rgba_png": "a large yellow triangle in the center, transparent background",
    "manual_schedule": "a small green circle at the top, white background",
    "base_speed_lora": "a large green square at the bottom, white background",
    "base_turbo_lora": "a small red triangle on the right, black background",
    "controlnet_canny": "a large blue circle in the center, white background",
    "controlnet_inpaint": "a large yellow square on the left, white background",
    "img2img": "a large blue circle in the center, white background",
    "inpaint_with_a_mask": "a large green circle in the center, white background",
    "edit_one_reference": "make the circle blue",
    "edit_three_references": "move it to the left",
    "official_background_removal": "remove the background",
    "official_image_edit": "make the circle blue",
    "official_t2i": "a large red square at the top, white background",
    "official_turbo_image_edit": "make the circle green",
    "official_turbo_t2i": "a large blue triangle at the bottom, black background",
}
#: Input images the shipped workflows load, as toy scenes (any other name gets `DEFAULT_INPUT`).
DEFAULT_INPUT = Scene((Item("circle", "red", "center", "large"),), "white")
TOY_INPUTS = {
    "example_1.png": Scene((Item("circle", "red", "right", "large"),), "white"),
    "example_2.png": Scene((Item("square", "green", "left", "small"),), "black"),
    "example_3.png": Scene((Item("triangle", "blue", "top", "large"),), "transparent"),
}


def write_toy_inputs(input_dir: Path, names) -> list[Path]:
    """Every image the workflows load, as a toy scene (never overwrites)."""
    written = []
    for name in dict.fromkeys(names):
        path = Path(input_dir) / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            TOY_INPUTS.get(name, DEFAULT_INPUT).render().save(path)
            written.append(path)
    return written


def toy_overrides(workflow: str, class_type: str, kwargs: dict) -> list[str]:
    """Rewrite one node of a shipped workflow for the toy; returns what changed. Sizes become the toy's 256x256
    (a latent input keeps its own), references 256 px, a written prompt the workflow's toy prompt."""
    changed = []

    def put(name, value):
        if kwargs.get(name) != value:
            changed.append(f"{name} {str(kwargs.get(name))[:40]!r} -> {value!r}")
            kwargs[name] = value

    if class_type == "QI21TextEncode" and isinstance(kwargs.get("prompt"), str) and kwargs["prompt"].strip():
        put("prompt", TOY_PROMPTS.get(workflow, TOY_PROMPTS["text_to_image_base"]))
    elif class_type in ("QI21Sampler", "QI21TurboSampler") and kwargs.get("latent_image") is None:
        has_references = bool(getattr(kwargs.get("positive"), "ref_shapes", ()))
        for name in ("width", "height"):
            put(name, 0 if has_references else SIZE)
    elif class_type == "QI21Reference":
        put("resolution", SIZE)
    elif class_type in ("QI21ModelLoader", "QI21TextEncoderLoader", "QI21VAELoader"):
        put("weight_dtype", "fp32")  # the toy was trained in fp32; bf16 on a CPU is slow
    return changed


def contact_sheet(entries: list[tuple[str, str, Path]], path: Path, columns: int = 4) -> Path:
    """One PNG of every output image (over a checkerboard, so transparency shows) with its workflow and prompt:
    `entries` are (workflow, prompt, image file)."""
    tile, caption = SIZE, 44
    rows = max(1, math.ceil(len(entries) / columns))
    sheet = Image.new("RGB", (columns * tile, rows * (tile + caption)), "white")
    draw = ImageDraw.Draw(sheet)
    checker = Image.new("RGB", (tile, tile), (205, 205, 205))
    for y in range(0, tile, 16):
        for x in range((y // 16 % 2) * 16, tile, 32):
            checker.paste((250, 250, 250), (x, y, x + 16, y + 16))
    for index, (workflow, prompt, image_path) in enumerate(entries):
        x, y = index % columns * tile, index // columns * (tile + caption)
        image = Image.open(image_path).convert("RGBA").resize((tile, tile))
        cell = checker.copy()
        cell.paste(image, (0, 0), image)
        sheet.paste(cell, (x, y))
        draw.text((x + 4, y + tile + 3), workflow[:40], fill=(0, 0, 0))
        for line, start in enumerate(range(0, len(prompt), 40)):
            if line < 2:
                draw.text((x + 4, y + tile + 16 + 12 * line), prompt[start : start + 40], fill=(60, 60, 60))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path
