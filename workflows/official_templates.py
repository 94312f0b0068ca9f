"""The five official Qwen-Image 2.1 templates (comfyui-workflow-templates-json 0.1.123), rebuilt from this pack's
nodes with their files, settings and prompt-enhancer step; `build_workflows.py` writes them beside the examples."""

from pathlib import Path

from workflow_graph import (
    INT8_MODEL,
    INT8_TEXT_ENCODER,
    INT8_TURBO_MODEL,
    PE_I2I,
    PE_T2I,
    Graph,
    Node,
    add_decode,
    add_loaders,
    add_prompt,
    add_reference,
    add_sampler,
    add_save,
)

HERE = Path(__file__).resolve().parent
#: The official templates' prompt-enhancer system prompts (comfyui-workflow-templates-json 0.1.123, the settings of
#: the prompt enhancer's release), kept verbatim as data: the enhancer model was released to be run with them.
PE_SYSTEM_PROMPTS = {kind: (HERE / "prompt_enhancer" / f"system_prompt_{kind}.md").read_text(encoding="utf-8")
                     for kind in ("t2i", "i2i")}

# image_qwen_image_2_1_{t2i, image_edit, background_removal, turbo_t2i, turbo_image_edit}: the same files (int8
# ConvRot DiT and text encoder), sampler, steps, cfg and Turbo sigmas; the prompt enhancer as there: core CLIPLoader
# (the Qwen 3.5 PE file) -> TextGenerate with the release's system prompt, behind an on/off switch (off by default),
# its text shown by PreviewAny and fed to our Text Encode.
TURBO_SIGMAS_TEXT = "1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568, 0"
PE_SAMPLING = {"t2i": 1.5, "i2i": 0.0}  # presence_penalty; otherwise the same sampling settings in both


def _prompt_enhancer(g: Graph, kind: str, text: str, pos=(420, 120), images: Node = None) -> Node:
    """Prompt -> (switch off: as typed | on: rewritten by the PE model) -> PreviewAny, whose STRING is the prompt;
    framed as the templates frame it (an ImageBatch feeding it joins the frame)."""
    x, y = pos
    prompt = g.add("PrimitiveStringMultiline", (x, y), (420, 220), title="Prompt", value=text)
    system = g.add("PrimitiveStringMultiline", (x, y + 260), (420, 220), title="Text (System Prompt)",
                   value=PE_SYSTEM_PROMPTS[kind])
    clip = g.add("CLIPLoader", (x, y + 520), (420, 110), clip_name=PE_T2I if kind == "t2i" else PE_I2I,
                 type="stable_diffusion" if kind == "t2i" else "qwen_image")
    generate = g.add("TextGenerate", (x + 460, y + 260), (400, 460), max_length=4096, sampling_mode="on",
                     thinking=False, **{"sampling_mode.temperature": 1.0, "sampling_mode.top_k": 20,
                                        "sampling_mode.top_p": 0.95, "sampling_mode.min_p": 0.0,
                                        "sampling_mode.repetition_penalty": 1.0, "sampling_mode.seed": 0,
                                        "sampling_mode.presence_penalty": PE_SAMPLING[kind]})
    switch = g.add("ComfySwitchNode", (x + 460, y), (300, 90), title="Prompt enhancer (true = on)", switch=False)
    preview = g.add("PreviewAny", (x + 460, y + 120), (400, 100), title="Prompt used")
    g.link(clip, "CLIP", generate, "clip")
    g.link(system, "STRING", generate, "system_prompt")
    g.link(prompt, "STRING", generate, "prompt")
    if images is not None:
        g.link(images, "IMAGE", generate, "image")
    g.link(prompt, "STRING", switch, "on_false")
    g.link(generate, "generated_text", switch, "on_true")
    g.link(switch, "output", preview, "source")
    batch = (images,) if images is not None and images.spec.node_type == "ImageBatch" else ()
    g.group("Prompt Enhancer", prompt, system, clip, *batch, switch, preview, generate)
    return preview


def _enhanced_prompt(g: Graph, encoder: Node, enhancer: Node, text: str, references: Node = None) -> Node:
    node = add_prompt(g, encoder, text, pos=(1340, 120), references=references)
    g.link(enhancer, "STRING", node, "prompt")
    g.group("Conditioning", node)
    return node


def _frame_models(g: Graph, *loaders: Node) -> None:
    g.group("Models", *loaders)


def _select_sampler(g: Graph, sampler: Node, pos) -> Node:
    select = g.add("KSamplerSelect", pos, (320, 60), sampler_name="euler")
    g.link(select, "SAMPLER", sampler, "sampler")
    return select


def _euler_to_image(g: Graph, vae: Node, sampler: Node, name: str, turbo: bool = False) -> None:
    """The templates' tail: euler (KSamplerSelect) into the sampler, Turbo's sigmas (ManualSigmas) for Turbo, then
    decode and save at the right columns."""
    tools = [_select_sampler(g, sampler, (1340, 900))]
    if turbo:
        tools.append(_turbo_sigmas(g, sampler, (1340, 1000)))
    g.group("Sampling", sampler, *tools)
    add_save(g, add_decode(g, vae, sampler, pos=(1720, 120)), "IMAGE", f"qwen-image-2.1/{name}", pos=(2020, 120))


def _turbo_sigmas(g: Graph, sampler: Node, pos) -> Node:
    sigmas = g.add("ManualSigmas", pos, (420, 90), sigmas=TURBO_SIGMAS_TEXT)
    g.link(sigmas, "SIGMAS", sampler, "sigmas")
    return sigmas


TEMPLATE_NOTE = """
## Qwen-Image 2.1 {title}: the official template, with this pack's nodes

The same job as core's `image_qwen_image_2_1_{template}` template, with the same files ({files}), {settings}.
**Prompt enhancer**: set the switch to true to rewrite the prompt with the Qwen 3.5 prompt enhancer
(`{pe}` in `models/text_encoders`, ComfyUI >= 0.37.2) before the image model sees it; *Prompt used* shows the text.

What ours does differently: {difference} The prompt and references are computed once and cached (`prefix_cache`);
the report on the sampler shows the cache and timings.
"""
BASE_DIFFERENCE = ("the Base schedule is the official one (dynamic shift from the image size, last sigma 0.02) where "
                   "the template's `simple` scheduler uses core's fixed shift; for the template's exact sigmas, feed "
                   "*Qwen-Image 2.1 Schedule* with scheduler `simple` into `sigmas`.")


def official_t2i(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, INT8_MODEL, INT8_TEXT_ENCODER)
    _frame_models(g, model, encoder, vae)
    enhancer = _prompt_enhancer(g, "t2i", "A greyscale fashion editorial portrait of a woman in profile wearing "
                                "oversized round black sunglasses, high-contrast studio light, against a vivid lime "
                                "green pop-art collage background.")
    positive = _enhanced_prompt(g, encoder, enhancer, "")
    sampler = add_sampler(g, "QI21Sampler", model, positive, pos=(1340, 400), steps=25, cfg=1.0, width=1024,
                       height=1024)
    _euler_to_image(g, vae, sampler, "official_t2i")
    g.note(TEMPLATE_NOTE.format(title="text to image", template="t2i", files=f"`{INT8_MODEL}`, `{INT8_TEXT_ENCODER}`",
                                settings="25 steps, cfg 1, euler (KSamplerSelect into `sampler`), 1024 x 1024",
                                pe=PE_T2I, difference=BASE_DIFFERENCE), (0, 660), (400, 420))


def official_image_edit(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, INT8_MODEL, INT8_TEXT_ENCODER)
    _frame_models(g, model, encoder, vae)
    first_image, first = add_reference(g, vae, "portrait_model_denim.png", 1, (420, 1200), resolution=0)
    second_image, second = add_reference(g, vae, "clothing_light_blue_denim_shirt.png", 2, (420, 1600),
                                         previous=first, resolution=0)
    images = g.add("ImageBatch", (420, 900), (260, 80))
    g.link(first_image, "IMAGE", images, "image1")
    g.link(second_image, "IMAGE", images, "image2")
    enhancer = _prompt_enhancer(g, "i2i", "Replace costumes for the character", images=images)
    positive = _enhanced_prompt(g, encoder, enhancer, "", references=second)
    sampler = add_sampler(g, "QI21Sampler", model, positive, pos=(1340, 400), steps=25, cfg=1.0, width=0, height=0)
    _euler_to_image(g, vae, sampler, "official_image_edit")
    g.note(TEMPLATE_NOTE.format(
        title="image edit", template="image_edit", files=f"`{INT8_MODEL}`, `{INT8_TEXT_ENCODER}`",
        settings="25 steps, cfg 1, euler, references at their own size (resolution 0)", pe=PE_I2I,
        difference=BASE_DIFFERENCE + " The output follows the last reference's size (width/height 0); the prompt "
                   "enhancer sees the images as one batch (core Batch Images, resized to the first). The toy trained "
                   "here (demo/) learnt one-reference edits only: on it this graph runs without following the "
                   "instruction; the real model composes both references."),
        (0, 660), (400, 460))


def official_background_removal(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, INT8_MODEL, INT8_TEXT_ENCODER)
    _frame_models(g, model, encoder, vae)
    _, reference = add_reference(g, vae, "angry_broccoli.png", 1, (420, 660), resolution=0)
    positive = add_prompt(g, encoder, "Remove the background, and output a PNG image", references=reference)
    g.group("Conditioning", positive)
    sampler = add_sampler(g, "QI21Sampler", model, positive, steps=25, cfg=1.0, width=0, height=0)
    g.group("Sampling", sampler, _select_sampler(g, sampler, (900, 700)))
    decode = add_decode(g, vae, sampler)
    add_save(g, decode, "RGBA", "qwen-image-2.1/official_background_removal")
    g.note(f"""
## Qwen-Image 2.1 background removal: the official template, with this pack's nodes

The same job as core's `image_qwen_image_2_1_background_removal` template, with the same files (`{INT8_MODEL}`,
`{INT8_TEXT_ENCODER}`), prompt and settings (25 steps, cfg 1, euler, the image at its own size). *VAE Decode*'s
`RGBA` output goes to *Save Image*: a PNG with the alpha channel the model generates.

What ours does differently: {BASE_DIFFERENCE} The image is computed once and cached (`prefix_cache`).
""", (0, 660), (400, 360))


def official_turbo_t2i(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, INT8_TURBO_MODEL, INT8_TEXT_ENCODER)
    _frame_models(g, model, encoder, vae)
    enhancer = _prompt_enhancer(g, "t2i", "An underground techno event poster: black background, the two-line "
                                "headline \"QWEN IMAGE\" / \"2.1 TURBO\" in heavy white capitals, black-and-white "
                                "halftone portraits, fluorescent orange accents, risograph texture.")
    positive = _enhanced_prompt(g, encoder, enhancer, "")
    sampler = add_sampler(g, "QI21TurboSampler", model, positive, pos=(1340, 400), width=1024, height=1024)
    _euler_to_image(g, vae, sampler, "official_turbo_t2i", turbo=True)
    g.note(TEMPLATE_NOTE.format(
        title="Turbo text to image", template="turbo_t2i", files=f"`{INT8_TURBO_MODEL}`, `{INT8_TEXT_ENCODER}`",
        settings="the stored 8 sigmas (ManualSigmas), euler, no CFG, 1024 x 1024", pe=PE_T2I,
        difference="the Turbo sampler replaces SamplerCustomAdvanced + RandomNoise + CFGGuider (cfg 1: no guidance)."),
        (0, 660), (400, 420))


def official_turbo_image_edit(g: Graph) -> None:
    model, encoder, vae = add_loaders(g, INT8_TURBO_MODEL, INT8_TEXT_ENCODER)
    _frame_models(g, model, encoder, vae)
    image, reference = add_reference(g, vae, "ballet_dancer_photography_minimalist_architecture.png", 1,
                                     (420, 1200), resolution=0)
    enhancer = _prompt_enhancer(g, "i2i", "Relight the scene as a clear moonlit night with a full moon in the sky "
                                "seen through the oculus; soft blue-silver moonlight on the stone platform and a long "
                                "soft shadow of the dancer. Keep her pose, the architecture and the framing.",
                                images=image)
    positive = _enhanced_prompt(g, encoder, enhancer, "", references=reference)
    sampler = add_sampler(g, "QI21TurboSampler", model, positive, pos=(1340, 400), width=0, height=0)
    _euler_to_image(g, vae, sampler, "official_turbo_image_edit", turbo=True)
    g.note(TEMPLATE_NOTE.format(
        title="Turbo image edit", template="turbo_image_edit", files=f"`{INT8_TURBO_MODEL}`, `{INT8_TEXT_ENCODER}`",
        settings="the stored 8 sigmas, euler, cfg 1, the image at its own size", pe=PE_I2I,
        difference="the Turbo sampler replaces SamplerCustomAdvanced + RandomNoise + CFGGuider (cfg 1: no guidance); "
                   "the output follows the reference's size."),
        (0, 660), (400, 420))


WORKFLOWS = {
    "official_t2i": official_t2i,
    "official_image_edit": official_image_edit,
    "official_background_removal": official_background_removal,
    "official_turbo_t2i": official_turbo_t2i,
    "official_turbo_image_edit": official_turbo_image_edit,
}
