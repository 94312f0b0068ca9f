"""Stand-ins for the core ComfyUI nodes that the official templates' counterparts and the Canny ControlNet example
use, so the headless runner (workflow_runner.py) runs those graphs without ComfyUI. Each follows what ComfyUI's own
node does (its schema's inputs and outputs, and its result); none is imported from ComfyUI.

- KSamplerSelect: the SAMPLER `nodes/bridge.sampler_object` gives (ComfyUI's own when it is importable, else the
  stand-in Euler), so its combo lists only the samplers that can run here.
- Canny: kornia's Canny as ComfyUI calls it (grey levels, a 5x5 Gaussian of sigma 1, Sobel gradients, non-maximum
  suppression, two thresholds and hysteresis), in numpy.
- PrimitiveStringMultiline, PreviewAny, ImageBatch: as in ComfyUI.
- ComfySwitchNode: its inputs are lazy in ComfyUI, so the branch it does not take never runs; the runner follows
  only the taken branch (`untaken_inputs`).
- CLIPLoader and TextGenerate (the prompt enhancer, a language model): their schemas only, so a graph that holds
  them validates; with the switch off they never run. A graph whose switch is on needs the enhancer's model, which
  only ComfyUI loads: the runner reports such a workflow as skipped (`PROMPT_ENHANCER`), it never fakes its text.
"""

import json

import numpy as np
import torch
import torch.nn.functional as F

from ..nodes import bridge
from ..nodes.bridge import io

#: The nodes that make the prompt enhancer's text: a workflow that must run one is skipped, naming it.
PROMPT_ENHANCER = frozenset({"CLIPLoader", "TextGenerate"})
ANY = io.Custom("*")  # ComfyUI's wildcard type (MatchType / IO.ANY): links of any type fit


def sampler_names() -> tuple[str, ...]:
    """What KSamplerSelect offers: ComfyUI's list when it is importable, else the one sampler the stand-in has."""
    if bridge.HAVE_COMFY:
        import comfy.samplers

        return tuple(comfy.samplers.SAMPLER_NAMES)
    return ("euler",)


def schemas() -> dict:
    """The stand-ins' schemas: the inputs and outputs ComfyUI declares for them (what the shipped graphs use)."""
    threshold = {"min": 0.01, "max": 0.99, "step": 0.01}
    return {
        "KSamplerSelect": io.Schema(node_id="KSamplerSelect", category="sampling",
                                    inputs=[io.Combo.Input("sampler_name", options=list(sampler_names()))],
                                    outputs=[io.Sampler.Output(display_name="SAMPLER")]),
        "Canny": io.Schema(node_id="Canny", category="image/filters",
                           inputs=[io.Image.Input("image"),
                                   io.Float.Input("low_threshold", default=0.4, **threshold),
                                   io.Float.Input("high_threshold", default=0.8, **threshold)],
                           outputs=[io.Image.Output(display_name="IMAGE")]),
        "PrimitiveStringMultiline": io.Schema(node_id="PrimitiveStringMultiline", category="utilities",
                                              inputs=[io.String.Input("value", multiline=True)],
                                              outputs=[io.String.Output(display_name="STRING")]),
        "PreviewAny": io.Schema(node_id="PreviewAny", category="utilities", is_output_node=True,
                                inputs=[ANY.Input("source")], outputs=[io.String.Output(display_name="STRING")]),
        "ComfySwitchNode": io.Schema(node_id="ComfySwitchNode", category="utilities",
                                     inputs=[io.Boolean.Input("switch"), ANY.Input("on_false"), ANY.Input("on_true")],
                                     outputs=[ANY.Output(display_name="output")]),
        "ImageBatch": io.Schema(node_id="ImageBatch", category="image",
                                inputs=[io.Image.Input("image1"), io.Image.Input("image2")],
                                outputs=[io.Image.Output(display_name="IMAGE")]),
        "CLIPLoader": io.Schema(node_id="CLIPLoader", category="loaders",
                                inputs=[io.String.Input("clip_name"), io.String.Input("type"),
                                        io.String.Input("device", default="default", optional=True)],
                                outputs=[io.Custom("CLIP").Output(display_name="CLIP")]),
        "TextGenerate": io.Schema(node_id="TextGenerate", category="text",
                                  inputs=[io.Custom("CLIP").Input("clip"), io.String.Input("prompt", default=""),
                                          io.Image.Input("image", optional=True),
                                          io.Int.Input("max_length", default=512, min=1, max=32768),
                                          io.Combo.Input("sampling_mode", options=["on", "off"])],
                                  outputs=[io.String.Output(display_name="generated_text")]),
    }


# -- the nodes that run ----------------------------------------------------------------------------------------
def ksampler_select(sampler_name: str) -> tuple:
    return (bridge.sampler_object(sampler_name),)


def primitive_string(value: str) -> tuple[str]:
    return (value,)


def preview_any(source=None) -> tuple[str]:
    """The text PreviewAny shows and passes on: a string as it is, a number as text, anything else as JSON."""
    if isinstance(source, str):
        return (source,)
    if isinstance(source, (bool, int, float)):
        return (str(source),)
    if source is None:
        return ("None",)
    try:
        return (json.dumps(source, indent=4, ensure_ascii=False),)
    except (TypeError, ValueError):
        return (str(source),)


def switch(switch: bool, on_false=None, on_true=None) -> tuple:
    return (on_true if switch else on_false,)


def image_batch(image1: torch.Tensor, image2: torch.Tensor) -> tuple[torch.Tensor]:
    """ComfyUI's ImageBatch: a missing alpha channel padded with 1 (opaque), the second image centre-cropped to the
    first's aspect and resized (bilinear) to its size, then both in one batch."""
    if image1.shape[-1] != image2.shape[-1]:
        if image1.shape[-1] > image2.shape[-1]:
            image2 = F.pad(image2, (0, 1), value=1.0)
        else:
            image1 = F.pad(image1, (0, 1), value=1.0)
    if image1.shape[1:] != image2.shape[1:]:
        height, width = image1.shape[1:3]
        source_h, source_w = image2.shape[1:3]
        if source_w * height > width * source_h:  # wider than the target: crop the sides
            keep = round(source_h * width / height)
            image2 = image2[:, :, (source_w - keep) // 2:(source_w - keep) // 2 + keep]
        elif source_w * height < width * source_h:
            keep = round(source_w * height / width)
            image2 = image2[:, (source_h - keep) // 2:(source_h - keep) // 2 + keep]
        image2 = F.interpolate(image2.movedim(-1, 1), size=(height, width), mode="bilinear",
                               align_corners=False).movedim(1, -1)
    return (torch.cat((image1, image2), dim=0),)


def canny(image: torch.Tensor, low_threshold: float, high_threshold: float) -> tuple[torch.Tensor]:
    """ComfyUI's Canny node: `[B, H, W, C]` in, the edges (0 or 1) as a 3-channel IMAGE of the same size out."""
    if low_threshold > high_threshold:
        raise ValueError(f"Canny: low_threshold {low_threshold} is above high_threshold {high_threshold}; the low "
                         "one must be the smaller.")
    pixels = image.detach().float().cpu().numpy()
    edges = np.stack([canny_edges(picture, low_threshold, high_threshold) for picture in pixels])
    return (torch.from_numpy(edges)[..., None].expand(-1, -1, -1, 3).contiguous(),)


def canny_edges(picture: np.ndarray, low: float, high: float) -> np.ndarray:
    """One `(H, W, C)` picture's Canny edges as `(H, W)` 0/1 floats, with kornia's choices: ITU-R 601 grey levels
    (three channels; one is used as it is), a 5x5 Gaussian of sigma 1 with mirrored borders, unnormalised Sobel
    gradients with repeated borders, a pixel kept where its magnitude exceeds both neighbours along its gradient
    (the angle rounded to 45 degrees), weak edges above `low`, strong above `high`, and weak ones joined to strong
    ones through their eight neighbours until nothing changes."""
    grey = picture[..., :3] @ np.array([0.299, 0.587, 0.114], np.float32) if picture.shape[-1] >= 3 \
        else picture[..., 0]
    taps = np.exp(-(np.arange(5, dtype=np.float32) - 2) ** 2 / 2)
    taps /= taps.sum()
    height, width = grey.shape
    mirrored = np.pad(grey, 2, mode="reflect")
    across = sum(tap * mirrored[:, i:i + width] for i, tap in enumerate(taps))  # separable: rows, then columns
    blurred = sum(tap * across[i:i + height] for i, tap in enumerate(taps))
    padded = np.pad(blurred, 1, mode="edge")

    def at(dy, dx):  # the neighbour at (dy, dx) of every pixel
        return padded[1 + dy:1 + dy + height, 1 + dx:1 + dx + width]

    gx = (at(-1, 1) + 2 * at(0, 1) + at(1, 1)) - (at(-1, -1) + 2 * at(0, -1) + at(1, -1))
    gy = (at(1, -1) + 2 * at(1, 0) + at(1, 1)) - (at(-1, -1) + 2 * at(-1, 0) + at(-1, 1))
    magnitude = np.sqrt(gx * gx + gy * gy + 1e-6)
    direction = np.round(np.degrees(np.arctan2(gy, gx)) / 45).astype(np.int64) % 8  # 0..7, 45 degrees each
    steps = [(0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1), (-1, 0), (-1, 1)]  # (dy, dx) per direction
    around = np.pad(magnitude, 1, mode="constant")
    kept = np.ones_like(magnitude, dtype=bool)
    for index, (dy, dx) in enumerate(steps):
        for sign in (1, -1):  # both neighbours along the gradient
            neighbour = around[1 + sign * dy:1 + sign * dy + height, 1 + sign * dx:1 + sign * dx + width]
            kept &= ~((direction == index) & (magnitude <= neighbour))
    magnitude = magnitude * kept
    strong, weak = magnitude > high, (magnitude > low) & (magnitude <= high)
    while True:
        grown = np.pad(strong, 1)
        near = np.zeros_like(strong)
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                near |= grown[1 + dy:1 + dy + height, 1 + dx:1 + dx + width]
        joined = strong | (weak & near)
        if (joined == strong).all():
            return strong.astype(np.float32)
        strong = joined


#: class_type -> the function that runs it (CLIPLoader and TextGenerate are not here: see the module's docstring)
RUNS = {"KSamplerSelect": ksampler_select, "Canny": canny, "PrimitiveStringMultiline": primitive_string,
        "PreviewAny": preview_any, "ComfySwitchNode": switch, "ImageBatch": image_batch}


def untaken_inputs(nodes: dict) -> dict[str, str]:
    """`{switch node id: the input it does not take}` for every ComfySwitchNode whose `switch` is a value (not a
    link): ComfyUI evaluates only the taken one (lazy inputs)."""
    untaken = {}
    for node_id, node in nodes.items():
        value = node.get("inputs", {}).get("switch")
        if node.get("class_type") == "ComfySwitchNode" and isinstance(value, bool):
            untaken[node_id] = "on_false" if value else "on_true"
    return untaken
