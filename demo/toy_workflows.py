"""The main job on the trained toy: the shipped workflows with a prompt of the toy's vocabulary in place of theirs
(they were written for the real model), toy scenes as their input images, whether each picture shows what was
asked (`judge`, read by demo/toy_eval.py), and a contact sheet of every output.

Only the shipped workflows are rewritten (`toy_overrides`); a graph a user passes with `--workflows` runs as
written, on the toy's weights.
"""

import math
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .toy_data import BACKGROUNDS, COLOURS, POSITIONS, SIZE, WHERE, Item, Scene
from .toy_eval import analyse

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
    "edit_pixel_aligned": "make the circle green",
    "edit_three_references": "move it to the left",
    "official_background_removal": "remove the background",
    "official_image_edit": "make the circle blue",
    "official_t2i": "a large red square at the top, white background",
    "official_turbo_image_edit": "make the circle green",
    "official_turbo_t2i": "a large blue triangle at the bottom, black background",
}
#: Input images the shipped workflows load, as toy scenes (any other name gets `DEFAULT_INPUT`).
DEFAULT_INPUT = Scene((Item("circle", "red", "center", "large"),), "white")
INPAINT_SOURCE = "toy_inpaint_source.png"  # DEFAULT_INPUT with its centre erased: what the mask editor saves
TOY_INPUTS = {
    "example_1.png": Scene((Item("circle", "red", "right", "large"),), "white"),
    "example_2.png": Scene((Item("square", "green", "left", "small"),), "black"),
    "example_3.png": Scene((Item("triangle", "blue", "top", "large"),), "transparent"),
    INPAINT_SOURCE: DEFAULT_INPUT,
}
#: LoadImage's file for the toy where the workflow needs more than a picture: the inpainting ones read their mask
#: from the image's alpha (1 - alpha, as ComfyUI's LoadImage does), so their source has a transparent hole.
TOY_IMAGE_FOR = {"inpaint_with_a_mask": INPAINT_SOURCE, "controlnet_inpaint": INPAINT_SOURCE}
INPAINT_HOLE = (48, 208)  # the erased square, pixels (a multiple of the VAE's 16-pixel latent cells)
#: img2img's denoise on the toy: the workflow's 0.6 keeps the toy's source (its red circle stays red; 0.75 too), and
#: from 0.8 it repaints the colour the prompt asks for, keeping the circle where it was.
TOY_DENOISE = {"img2img": 0.85}
#: What the main job says about the toy's own inputs and settings (beside its prompts) before it runs them.
TOY_RUN_NOTES = (
    "img2img runs at denoise 0.85, not the workflow's 0.6: at 0.6 (and 0.75) the toy keeps its source, the red circle "
    "stays red",
    f"the inpainting workflows load {INPAINT_SOURCE}, whose centre is transparent: LoadImage's mask (1 - alpha) is "
    "the part repainted",
)


def toy_input(name: str) -> Image.Image:
    """The toy scene for a LoadImage file name, RGBA; the inpainting source with its hole erased."""
    picture = TOY_INPUTS.get(name, DEFAULT_INPUT).render()
    if name == INPAINT_SOURCE:
        pixels = np.array(picture)
        start, stop = INPAINT_HOLE
        pixels[start:stop, start:stop, 3] = 0  # alpha 0: LoadImage's MASK is 1 there, so that is what is repainted
        picture = Image.fromarray(pixels, "RGBA")
    return picture


def write_toy_inputs(input_dir: Path, names) -> list[Path]:
    """Every image the workflows load, and the toy's own inputs (TOY_IMAGE_FOR), as toy scenes (never overwrites)."""
    written = []
    for name in dict.fromkeys([*names, *TOY_IMAGE_FOR.values()]):
        path = Path(input_dir) / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            toy_input(name).save(path)
            written.append(path)
    return written


def toy_overrides(workflow: str, class_type: str, kwargs: dict) -> list[str]:
    """Rewrite one node of a shipped workflow for the toy; returns what changed. Sizes become the toy's 256x256
    (a latent input keeps its own), references 256 px, a written prompt the workflow's toy prompt, and the inputs and
    denoise above."""
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
    elif class_type in ("QI21Sampler", "QI21TurboSampler") and workflow in TOY_DENOISE:
        put("denoise", TOY_DENOISE[workflow])
    elif class_type == "QI21Reference":
        put("resolution", SIZE)
    elif class_type == "LoadImage" and workflow in TOY_IMAGE_FOR:
        put("image", TOY_IMAGE_FOR[workflow])
    elif class_type in ("QI21ModelLoader", "QI21TextEncoderLoader", "QI21VAELoader"):
        put("weight_dtype", "fp32")  # the toy was trained in fp32; bf16 on a CPU is slow
    return changed


def asked(prompt: str, source: tuple | None = None) -> tuple[tuple | None, str]:
    """What a picture must show for `prompt`, as `analyse(...).reading` says it: (background, colour, position); or
    None and why it cannot be judged. Without `source` the prompt is a caption of one shape (demo/toy_data.py's
    phrasings); with it, the reading of the one reference, an edit instruction changes it (recolour, move, remove
    the background)."""
    words = " ".join(prompt.lower().replace(",", " , ").split())
    colours = [c for c in COLOURS if re.search(rf"\b{c}\b", words)]
    if source is None:
        backgrounds = [b for b in BACKGROUNDS if f"{b} background" in words]
        positions = [p for p, where in WHERE.items() if where in words]
        if len(colours) == len(positions) == len(backgrounds) == 1:
            return (backgrounds[0], colours[0], positions[0]), ""
        return None, "not a one-shape caption of the toy's vocabulary (colour, side, background: demo/toy_data.py)"
    background, colour, position = source
    recolour = re.fullmatch(r"make the (circle|square|triangle) (\w+)", words)
    move = re.fullmatch(r"move it to the (\w+)", words)
    if recolour and recolour.group(2) in COLOURS:
        return (background, recolour.group(2), position), ""
    if move and move.group(1) in POSITIONS:
        return (background, colour, move.group(1)), ""
    if words == "remove the background":
        return ("transparent", colour, position), ""
    return None, "not one of the toy's edits (make the circle blue, move it to the left, remove the background)"


def judge(result, input_dir: Path) -> tuple[str, str]:
    """("yes" | "no" | "n/a", what was asked and seen, or why not judged) for one workflow's run on the toy: every
    saved picture (not the previews) read by demo/toy_eval.py against `asked` for its prompt."""
    pictures = [p for p in result.images if p.suffix == ".png" and not p.name.startswith("preview_")]
    if not result.ok or not pictures or not result.prompts:
        return "n/a", "no picture" if result.ok else "did not run"
    seen = [analyse(_rgba(p)).reading for p in pictures]
    shown = "; ".join(" ".join(map(str, reading)) for reading in seen)
    if result.references > 1:
        return "n/a", (f"the toy learnt edits of one reference only and does not follow one over {result.references} "
                       f"(saw {shown}); the real model composes them")
    source = None
    if result.references == 1:
        source = analyse(_rgba(Path(input_dir) / result.loaded[0])).reading
    want, why = asked(result.prompts[0], source)
    if want is None:
        return "n/a", f"{why} (saw {shown})"
    return ("yes" if all(reading == want for reading in seen) else "no"), f"asked {' '.join(want)}, saw {shown}"


def _rgba(path: Path) -> np.ndarray:
    with Image.open(path) as picture:
        return np.asarray(picture.convert("RGBA"), dtype=np.float32) / 255


def contact_sheet(entries: list[tuple], path: Path, columns: int = 4) -> Path:
    """One PNG of every output image (over a checkerboard, so transparency shows) with its workflow, prompt and
    verdict: `entries` are (workflow, prompt, image file[, verdict line])."""
    tile, caption = SIZE, 56
    rows = max(1, math.ceil(len(entries) / columns))
    sheet = Image.new("RGB", (columns * tile, rows * (tile + caption)), "white")
    draw = ImageDraw.Draw(sheet)
    checker = Image.new("RGB", (tile, tile), (205, 205, 205))
    for y in range(0, tile, 16):
        for x in range((y // 16 % 2) * 16, tile, 32):
            checker.paste((250, 250, 250), (x, y, x + 16, y + 16))
    for index, (workflow, prompt, image_path, *verdict) in enumerate(entries):
        x, y = index % columns * tile, index // columns * (tile + caption)
        image = Image.open(image_path).convert("RGBA").resize((tile, tile))
        cell = checker.copy()
        cell.paste(image, (0, 0), image)
        sheet.paste(cell, (x, y))
        draw.text((x + 4, y + tile + 3), workflow[:40], fill=(0, 0, 0))
        for line, start in enumerate(range(0, len(prompt), 40)):
            if line < 2:
                draw.text((x + 4, y + tile + 16 + 12 * line), prompt[start : start + 40], fill=(60, 60, 60))
        if verdict:
            shade = {"drew: yes": (0, 110, 0), "drew: no": (170, 0, 0)}.get(verdict[0], (110, 110, 110))
            draw.text((x + 4, y + tile + 42), verdict[0][:40], fill=shade)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path
