"""Writes the example workflows: ComfyUI's UI format in `workflows/*.json` (what the template browser lists and
the canvas loads) and the same graphs in API format in `workflows/api/*.json` (what POST /prompt takes).

    python workflows/build_workflows.py           write every file
    python workflows/build_workflows.py --check   exit 1 when a file on disk differs from what this script writes

Our nodes' inputs, widget order and outputs come from their `define_schema()`, so a file can only disagree
with a schema when it is stale (`--check`, run by tests/test_workflows.py, catches that). Core nodes are
described by hand in CORE_NODES. Output is deterministic: same code, same bytes. The graph format and the shared
node chains are in `workflow_graph.py`, the official templates' counterparts in `official_templates.py`.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
API_FOLDER = "api"


def _sibling(name: str):
    """A module of this folder by its path (the tests load this file by path: workflows/ is not on sys.path then),
    registered under its own name so the siblings' imports of each other find it."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_sibling("workflow_layout")  # before workflow_graph, which imports it
graph = _sibling("workflow_graph")
official = _sibling("official_templates")
Graph, Node, NodeSpec, load_specs = graph.Graph, graph.Node, graph.NodeSpec, graph.load_specs
add_loaders, add_prompt, add_sampler = graph.add_loaders, graph.add_prompt, graph.add_sampler
add_decode, add_save, add_reference = graph.add_decode, graph.add_save, graph.add_reference
BASE_MODEL, TURBO_MODEL, SPEED_LORA, SPEED_LORA_SIGMAS = (graph.BASE_MODEL, graph.TURBO_MODEL, graph.SPEED_LORA,
                                                          graph.SPEED_LORA_SIGMAS)
TURBO_LORA, CONTROLNET = graph.TURBO_LORA, graph.CONTROLNET

#: The official wording for transparent output (the model's documentation): the description goes in the middle.
RGBA_PROMPT = ("This is an RGBA image with transparency. {}. The image has alpha channel and the background is "
               "transparent.")




# -- the examples ----------------------------------------------------------------------------------------------------
# Columns: loaders at x=0, images/references/prompts at x=420, sampler at x=900, decode at x=1280, outputs at 1600.


def text_to_image_base(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    positive = add_prompt(g, encoder, "A red fox sitting in a snowy birch forest at dawn, soft golden light, shallow "
                                   "depth of field, detailed wildlife photograph.")
    sampler = add_sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=1024, height=1024)
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/text_to_image_base")
    g.note("""
## Qwen-Image 2.1 Base: text to image

The official settings: **40 steps, cfg 1**, 1024 x 1024. The sampler computes the prompt once and caches its
keys/values after step 1 (`prefix_cache` on); its report on the node shows tokens, cache size and timings.

True CFG: connect a second *Text Encode* to `negative` and raise `cfg` above 1 (about twice the work).
Models go in `models/diffusion_models`, `models/text_encoders` and `models/vae`.
""", (0, 660), (420, 260))


def text_to_image_turbo(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, TURBO_MODEL)
    positive = add_prompt(g, encoder, "A cozy reading nook by a tall window, rain on the glass, warm lamp light, "
                                   "stacks of books, watercolor illustration.")
    sampler = add_sampler(g, "QI21TurboSampler", model, positive, width=1024, height=1024)
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/text_to_image_turbo")
    g.note("""
## Qwen-Image 2.1 Turbo: text to image

The Turbo model with its own sampler: the stored **8-step** schedule, no CFG, so there are no steps or cfg
to set. Use the Base sampler for the Base model and this one for Turbo; a mismatch is warned about.
""", (0, 660), (420, 200))


def edit_one_reference(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    _, reference = add_reference(g, vae, "example.png", 1, (420, 660))
    positive = add_prompt(g, encoder, "Turn the sky in <image1> into a warm sunset with pink clouds; keep everything "
                                   "else unchanged.", references=reference)
    sampler = add_sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=0, height=0)
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/edit_one_reference")
    g.note("""
## Qwen-Image 2.1: edit one image

*Load Image* -> *Reference* -> *Text Encode* (`references`). The prompt calls the image `<image1>`.
Width and height 0 follow the reference's size (resized to about `resolution`^2, sides x32).
The image's alpha (LoadImage's MASK) is kept: transparent inputs stay transparent.
Replace `example.png` with your own image.
""", (0, 660), (380, 300))


def edit_pixel_aligned(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    _, reference = add_reference(g, vae, "example.png", 1, (420, 660), resolution=0, fit="pad")
    positive = add_prompt(g, encoder, "Make the car in <image1> red; keep everything else unchanged.",
                          references=reference)
    sampler = add_sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=0, height=0)
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/edit_pixel_aligned")
    g.note("""
## Qwen-Image 2.1: an edit that lays over its input

*Reference* with `fit` **pad** keeps the image's own pixels: it repeats the right and bottom edges to the next
multiple of 32 instead of resampling (`resolution` 0: never scaled). Width and height 0 generate that padded
size, and *VAE Decode* crops back to the image's own box: the output has exactly the input's width, height and
pixel grid, so it can be composited onto the original. The sampler's report shows the box (`crop`).
*VAE Encode* and *Apply Fun ControlNet* have the same `fit` choice. Replace `example.png` with your own image.
""", (0, 660), (380, 320))


def edit_three_references(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    _, first = add_reference(g, vae, "example_1.png", 1, (420, 660))
    _, second = add_reference(g, vae, "example_2.png", 2, (420, 1060), previous=first)
    _, third = add_reference(g, vae, "example_3.png", 3, (420, 1460), previous=second)
    positive = add_prompt(g, encoder, "The person from <image1> wears the jacket from <image2> and stands in the "
                                   "street scene of <image3>, natural evening light.", references=third)
    sampler = add_sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=0, height=0)
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/edit_three_references")
    g.note("""
## Qwen-Image 2.1: three references

Chain *Reference* nodes (`references` -> `references`): they become `<image1>`, `<image2>`, `<image3>`
in chain order (up to 10). Only the last one goes into *Text Encode*. Width and height 0 follow the last
reference. The prefix cache pays off most here: the references are computed once, not every step.
Replace `example_1.png`..`example_3.png` with your own images. The toy trained here (demo/) learnt
one-reference edits only, so on it this graph runs but does not follow the instruction (`drew: n/a`);
the real model composes the references.
""", (0, 660), (380, 360))


def transparent_rgba_png(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, TURBO_MODEL)
    positive = add_prompt(g, encoder, RGBA_PROMPT.format("A glass perfume bottle with a gold cap, product shot, soft "
                                                      "studio lighting"))
    sampler = add_sampler(g, "QI21TurboSampler", model, positive, width=1024, height=1024)
    decode = add_decode(g, vae, sampler)
    add_save(g, decode, "RGBA", "qwen-image-2.1/transparent_rgba")
    rgb = g.add("PreviewImage", (1600, 700), (400, 440))
    g.link(decode, "IMAGE", rgb, "images")
    mask = g.add("MaskPreview", (2040, 700), (400, 440))
    g.link(decode, "MASK", mask, "mask")
    g.note("""
## Qwen-Image 2.1: transparent PNG

The VAE decodes RGB **and alpha**. *VAE Decode* gives `IMAGE` (RGB), `MASK` (1 = transparent, ComfyUI's
convention) and `RGBA` (4 channels). *Save Image* writes the RGBA output as a PNG with an alpha channel.
Ask for transparency in the prompt. Works the same with the Base model and sampler.
""", (0, 660), (420, 260))


def base_speed_lora(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    lora = g.add("QI21LoraLoader", (420, 380), (420, 110), lora_name=SPEED_LORA, strength=1.0)
    g.link(model, "model", lora, "model")
    positive = add_prompt(g, encoder, "A lighthouse on a rocky coast under a stormy sky, waves breaking, dramatic "
                                   "light, detailed photograph.")
    sigmas = g.add("ManualSigmas", (420, 540), (420, 90), sigmas=SPEED_LORA_SIGMAS)
    sampler = add_sampler(g, "QI21Sampler", lora, positive, steps=8, cfg=1.0, width=1024, height=1024)
    g.link(sigmas, "SIGMAS", sampler, "sigmas")
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/base_speed_lora")
    g.note("""
## Qwen-Image 2.1 Base + speed LoRA

*LoRA* sits between the model loader and the sampler: it returns the model with the LoRA, and leaves the
loaded model as it was (no second copy of the weights). Pruna's 8-step LoRA
(`p_q_image_2.1_8_steps_v0.1_comfyui_bf16.safetensors`, Comfy-Org's repackage, in `models/loras`) runs Base in
**8 steps, cfg 1, strength 1**, on the 8 sigmas published with it (*ManualSigmas*: a shift of 2 over 8 even
steps). Its 5- and 6-step siblings work the same way with their own sigmas. Chain more *LoRA* nodes to stack
LoRAs; the sampler's report lists each with its strength.
""", (0, 660), (420, 300))


def base_turbo_lora(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    lora = g.add("QI21LoraLoader", (420, 380), (420, 110), lora_name=TURBO_LORA, strength=1.0)
    g.link(model, "model", lora, "model")
    positive = add_prompt(g, encoder, "A street market at dusk, paper lanterns, steam rising from food stalls, "
                                   "cinematic photograph.")
    sigmas = g.add("QI21Sigmas", (420, 540), (420, 170), schedule="turbo", steps=8, width=1024, height=1024)
    sampler = add_sampler(g, "QI21Sampler", lora, positive, steps=8, cfg=1.0, width=1024, height=1024)
    g.link(sigmas, "SIGMAS", sampler, "sigmas")
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/base_turbo_lora")
    g.note("""
## Qwen-Image 2.1 Base + official Turbo LoRA

Comfy-Org's `qwen_image_2.1_turbo_lora_avg_rank_178_bf16.safetensors` (in `models/loras`) is the Turbo model
extracted as a LoRA of Base: low-rank pairs plus full patches (`.diff`) of the norms, applied as ComfyUI applies
them. Base + this LoRA samples on Turbo's **8 stored sigmas** (*Schedule* set to turbo), cfg 1, so one Base file
serves both. The Turbo file itself is exact; the LoRA is its rank-reduced copy.
""", (0, 660), (420, 280))


def add_encode(g: Graph, vae: Node, image_file: str, pos=(420, 660)) -> tuple[Node, Node]:
    image = g.add("LoadImage", pos, (320, 360), image=image_file)
    encode = g.add("QI21VAEEncode", (pos[0] + 360, pos[1]), (300, 120))
    g.link(vae, "vae", encode, "vae")
    g.link(image, "IMAGE", encode, "image")
    return image, encode


def img2img(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    _, encode = add_encode(g, vae, "example.png")
    positive = add_prompt(g, encoder, "An oil painting of the same scene, thick brush strokes, warm colours.")
    sampler = add_sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=0, height=0, denoise=0.6)
    g.link(encode, "LATENT", sampler, "latent_image")
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/img2img")
    g.note("""
## Qwen-Image 2.1: image to image

*Load Image* -> *VAE Encode* -> the sampler's `latent_image`. `denoise` 0.6 keeps the layout and redoes
the rest: the sampler runs the last 40 steps of a 40 / 0.6 = 66-step schedule, starting from the image noised
to that point. 1.0 ignores the image; lower keeps more of it. Width and height (0) follow the image, whose
sides are centre-cropped to multiples of 32. Replace `example.png` with your own image.
""", (0, 660), (400, 300))


def inpaint_with_a_mask(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    image, encode = add_encode(g, vae, "example.png")
    mask = g.add("SetLatentNoiseMask", (780, 820), (260, 80))
    g.link(encode, "LATENT", mask, "samples")
    g.link(image, "MASK", mask, "mask")
    positive = add_prompt(g, encoder, "A small red boat on the water.")
    sampler = add_sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=0, height=0, denoise=1.0)
    g.link(mask, "LATENT", sampler, "latent_image")
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/inpaint")
    g.note("""
## Qwen-Image 2.1: inpaint with a mask

Paint the area to redo in *Load Image*'s mask editor (right click -> Open in MaskEditor): its MASK goes
through core *Set Latent Noise Mask* onto the encoded image. The sampler repaints where the mask is 1 and
keeps the rest: after every step the kept part is reset to the input noised to the next sigma, so it ends
exactly as encoded. Lower `denoise` to keep more of the masked area's original content.
""", (0, 660), (400, 300))


def manual_schedule(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    positive = add_prompt(g, encoder, "A paper boat on a puddle after the rain, city reflections, macro photograph.")
    sigmas = g.add("ManualSigmas", (420, 380), (420, 90), sigmas="1.0, 0.94, 0.85, 0.72, 0.55, 0.35, 0.15, 0.0")
    sampler = add_sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=1024, height=1024)
    g.link(sigmas, "SIGMAS", sampler, "sigmas")
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/manual_schedule")
    g.note("""
## Qwen-Image 2.1: a schedule typed by hand

Core *ManualSigmas* -> the sampler's `sigmas`: the values are used exactly as typed (decreasing, from 1 for
pure noise to 0), and `steps` is ignored. Use the schedule a speed LoRA's card gives, or split a schedule
with *SplitSigmas* between two samplers (the second with `add_noise` off). *Qwen-Image 2.1 Schedule* gives
the official sigmas as a starting point.
""", (0, 660), (420, 280))


def add_controlnet(g: Graph, model: Node, vae: Node, pos=(420, 380), **values) -> tuple[Node, Node]:
    loader = g.add("QI21ControlNetLoader", (0, 660), (340, 110), control_net_name=CONTROLNET)
    apply = g.add("QI21ControlNetApply", pos, (420, 230), **values)
    g.link(model, "model", apply, "model")
    g.link(loader, "control_net", apply, "control_net")
    g.link(vae, "vae", apply, "vae")
    return loader, apply


def controlnet_canny(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    image = g.add("LoadImage", (420, 680), (320, 360), image="example.png")
    edges = g.add("Canny", (780, 680), (300, 110), low_threshold=0.4, high_threshold=0.8)
    g.link(image, "IMAGE", edges, "image")
    preview = g.add("PreviewImage", (780, 840), (300, 260))
    g.link(edges, "IMAGE", preview, "images")
    _, apply = add_controlnet(g, model, vae, strength=1.0)
    g.link(edges, "IMAGE", apply, "control_image")
    positive = add_prompt(g, encoder, "A glass greenhouse full of tropical plants at sunset, warm light through the "
                                   "panes, detailed photograph.")
    sampler = add_sampler(g, "QI21Sampler", apply, positive, steps=40, cfg=1.0, width=1024, height=1024)
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/controlnet_canny")
    g.note("""
## Qwen-Image 2.1 Fun ControlNet: canny edges

*Load Image* -> core *Detect Edges (Canny)* -> *Apply Fun ControlNet*'s `control_image`; the model it returns
goes to the sampler. The same net takes depth, pose (DWPose), HED, lineart, MLSD, scribble or grayscale maps:
feed any such RGB map instead. The map is stretched to the sampler's size, so set width and height to your
image's aspect. `strength` 1 is what the net was trained for (lower loosens the structure); the official
settings are 40 steps, cfg 1. The sampler keeps its prefix cache on (about +50% cache memory for the control's
own keys and values); its report lists the control and the cache bytes of each stream. The control net file
goes in `models/model_patches` (the int8 ConvRot file works too).
""", (0, 800), (400, 360))


def controlnet_inpaint(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, BASE_MODEL)
    image = g.add("LoadImage", (420, 680), (320, 360), image="example.png")
    _, apply = add_controlnet(g, model, vae, strength=1.0)
    g.link(image, "IMAGE", apply, "inpaint_image")
    g.link(image, "MASK", apply, "mask")
    positive = add_prompt(g, encoder, "A small wooden cabin with a lit window, in the same style as the rest of the "
                                   "picture.")
    sampler = add_sampler(g, "QI21Sampler", apply, positive, steps=40, cfg=1.0, width=1024, height=1024)
    add_save(g, add_decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/controlnet_inpaint")
    g.note("""
## Qwen-Image 2.1 Fun ControlNet: inpainting with a mask

Paint the area to regenerate in *Load Image*'s mask editor (right click -> Open in MaskEditor): its MASK (1 =
regenerate) and the image go to *Apply Fun ControlNet*'s `mask` and `inpaint_image`. The net repaints the masked
area to fit the rest, from the prompt. Set width and height to your image's size (the image and the mask are
stretched to it). Connect a `control_image` as well (e.g. canny of the original) to steer the new content.
""", (0, 800), (400, 300))
WORKFLOWS = {
    "text_to_image_base": text_to_image_base,
    "text_to_image_turbo": text_to_image_turbo,
    "edit_one_reference": edit_one_reference,
    "edit_three_references": edit_three_references,
    "edit_pixel_aligned": edit_pixel_aligned,
    "transparent_rgba_png": transparent_rgba_png,
    "base_speed_lora": base_speed_lora,
    "base_turbo_lora": base_turbo_lora,
    "img2img": img2img,
    "inpaint_with_a_mask": inpaint_with_a_mask,
    "manual_schedule": manual_schedule,
    "controlnet_canny": controlnet_canny,
    "controlnet_inpaint": controlnet_inpaint,
    **official.WORKFLOWS,
}




# -- files ----------------------------------------------------------------------------------------------------

def _dumps(data) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def build_graphs(specs: dict[str, NodeSpec] = None) -> dict[str, Graph]:
    specs = specs or load_specs()
    graphs = {}
    for name, build in WORKFLOWS.items():
        graphs[name] = Graph(name, specs)
        build(graphs[name])
        graphs[name].arrange()
    return graphs


def expected_files() -> dict[str, str]:
    """Relative path (under workflows/) -> file text, UI form and API form of every example."""
    files = {}
    for name, graph in build_graphs().items():
        files[f"{name}.json"] = _dumps(graph.ui())
        files[f"{API_FOLDER}/{name}.json"] = _dumps(graph.api())
    return files


def stale(folder: Path = HERE) -> list[str]:
    """What in `folder` differs from the builder's output: changed, missing and unknown workflow files."""
    expected = expected_files()
    problems = []
    for relative, text in expected.items():
        path = folder / relative
        if not path.is_file():
            problems.append(f"{relative}: missing")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"{relative}: differs from the builder's output")
    on_disk = [*folder.glob("*.json"), *(folder / API_FOLDER).glob("*.json")]
    problems += [f"{p.relative_to(folder).as_posix()}: not written by the builder"
                 for p in sorted(on_disk) if p.relative_to(folder).as_posix() not in expected]
    return problems


def write(folder: Path = HERE) -> list[str]:
    written = []
    for relative, text in expected_files().items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(relative)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the files on disk are not up to date")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for problem in problems:
            print(f"stale: {problem}", file=sys.stderr)
        if problems:
            print("run: python workflows/build_workflows.py", file=sys.stderr)
        return 1 if problems else 0
    written = write()
    print("\n".join(f"wrote workflows/{r}" for r in written) or "workflows are up to date")
    leftovers = [p for p in stale() if p.endswith("not written by the builder")]
    for problem in leftovers:
        print(f"warning: {problem} (delete it or add it to WORKFLOWS)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
