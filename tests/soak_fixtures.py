"""The soak's traffic: a seeded random mix of API prompts over the tiny model set (tests/test_soak.py runs a short
one through the headless runner in CI; tests/test_comfyui_soak.py runs a long one against a real ComfyUI with four
concurrent clients), and what is checked afterwards (each completed prompt's latents against the same prompt run
alone, the RSS slope, the kept store against its ceiling).

Every prompt ends in core's SaveLatent (raw fp32 latents, compared to 1e-5, not 8-bit PNGs); some also decode to a
PreviewImage so decoding is in the mix (and is a point an interrupt can land on). Loaders ask for fp32, so the
server and the headless reference compute in the same dtype.
"""

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qi21.demo import tiny_checkpoints as tiny

BASE_DIT, TURBO_DIT = tiny.DIT_FILE, tiny.TURBO_DIT_FILE  # the "switch between two DiT files"
LORAS = (tiny.SPEED_LORA_FILE, tiny.TURBO_LORA_FILE)
LORA_STRENGTHS = (1.0, 0.8, 0.5, -0.3)
IMAGES = ("qi21_soak_rgb.png", "qi21_soak_rgba.png")  # written by `write_images` (the second has an alpha mask)
IMAGE_SIZE = (320, 256)
REFERENCE_RESOLUTION = 288  # 320x256 references (above the vision processor's 65,536-pixel minimum)
WORDS = ("a lighthouse at dawn", "a red bicycle against a wall", "two cats on a sofa", "the sea at night",
         "a bowl of lemons", "OPEN 24 HOURS in neon")
INSTRUCTIONS = ("Make <image1> a snowy winter evening.", "Turn <image1> into a watercolour.",
                "Put a small boat in <image1>.", "Make <image1> look like an old photograph.")
COMFY_SAMPLERS = ("euler", "dpmpp_2m", "res_multistep", "heun")
#: kind -> relative weight in the mix; "comfy_sampler" needs a real ComfyUI (KSamplerSelect)
KINDS = {"t2i": 3, "cfg": 2, "edit": 2, "edit_words": 2, "lora": 2, "controlnet": 1, "img2img": 1, "inpaint": 1,
         "comfy_sampler": 1}


@dataclass
class SoakPrompt:
    index: int
    kind: str
    prompt: dict
    interrupt_after: float | None = None  # seconds after it starts running, when it is to be interrupted
    free_after: dict | None = None  # a /free body to post once it is done
    save_id: str = "90"
    features: list = field(default_factory=list)


def write_images(folder: Path) -> None:
    """The two input images (an RGB and an RGBA one whose alpha is a soft disc: LoadImage's MASK)."""
    from PIL import Image

    width, height = IMAGE_SIZE
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = x / (width - 1), y / (height - 1)
    rgb = np.clip(np.rint(np.stack([u, v, 0.5 + 0.5 * np.sin(7 * (u + v))], -1) * 255), 0, 255).astype(np.uint8)
    alpha = np.clip(np.rint(255 * np.clip(1.5 - np.hypot(x - width / 2, y - height / 2) / (0.4 * height), 0, 1)),
                    0, 255).astype(np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb, "RGB").save(folder / IMAGES[0])
    Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(folder / IMAGES[1])


def _node(class_type: str, **inputs) -> dict:
    return {"class_type": class_type, "inputs": inputs}


def build_prompt(rng: random.Random, kind: str, index: int, edit: tuple[str, bool]) -> tuple[dict, list[str]]:
    """One API prompt of `kind` (see KINDS), its random choices drawn from `rng`; returns (prompt, features).
    `edit`: the (image, Turbo?) of the last edit, which an instruction-only change keeps."""
    edit_image, edit_turbo = edit
    turbo = edit_turbo if kind in ("edit", "edit_words") else kind in ("t2i", "lora") and rng.random() < 0.5
    features = ["turbo" if turbo else "base"]
    p = {"1": _node("QI21ModelLoader", model_name=TURBO_DIT if turbo else BASE_DIT, weight_dtype="fp32"),
         "2": _node("QI21TextEncoderLoader", text_encoder_name=tiny.TEXT_ENCODER_FILE, weight_dtype="fp32"),
         "3": _node("QI21VAELoader", vae_name=tiny.VAE_FILE, weight_dtype="fp32")}
    model = ["1", 0]
    sampler = {"seed": rng.randrange(2**32), "batch_size": rng.randint(1, 4), "prefix_cache": "on",
               "keep_cache": rng.random() < 0.7, "width": rng.choice((64, 128, 160)), "height": rng.choice((64, 128))}
    text = rng.choice(WORDS)
    if kind in ("edit", "edit_words", "controlnet", "img2img", "inpaint"):
        image = edit_image if kind != "inpaint" else IMAGES[1]
        p["4"] = _node("LoadImage", image=image)
    if kind in ("edit", "edit_words"):
        p["5"] = _node("QI21Reference", vae=["3", 0], image=["4", 0], resolution=REFERENCE_RESOLUTION)
        text = INSTRUCTIONS[0] if kind == "edit" else rng.choice(INSTRUCTIONS[1:])
        sampler.update(width=0, height=0, keep_cache=True, batch_size=rng.randint(1, 2))
        p["6"] = _node("QI21TextEncode", text_encoder=["2", 0], prompt=text, references=["5", 0])
    else:
        p["6"] = _node("QI21TextEncode", text_encoder=["2", 0], prompt=text)
    if kind == "lora":
        for i in range(rng.randint(1, 2)):  # a chain of one or two, strengths from a small set
            node_id = str(20 + i)
            p[node_id] = _node("QI21LoraLoader", model=model, lora_name=rng.choice(LORAS),
                               strength=rng.choice(LORA_STRENGTHS))
            model = [node_id, 0]
        features.append(f"{i + 1} lora")
    if kind == "controlnet":
        p["30"] = _node("QI21ControlNetLoader", control_net_name=tiny.CONTROLNET_FILE, weight_dtype="fp32")
        p["31"] = _node("QI21ControlNetApply", model=model, control_net=["30", 0], vae=["3", 0],
                        strength=rng.choice((1.0, 0.7)), start_percent=0.0, end_percent=rng.choice((1.0, 0.5)),
                        control_image=["4", 0])
        model = ["31", 0]
        sampler.update(width=128, height=128)
    if kind in ("img2img", "inpaint"):
        p["40"] = _node("QI21VAEEncode", vae=["3", 0], image=["4", 0])
        latent = ["40", 0]
        if kind == "inpaint":
            p["41"] = _node("SetLatentNoiseMask", samples=latent, mask=["4", 1])
            latent = ["41", 0]
        sampler.update(latent_image=latent, denoise=rng.choice((0.5, 0.75, 1.0)), width=0, height=0)
    if kind == "comfy_sampler":
        name = rng.choice(COMFY_SAMPLERS)
        p["50"] = _node("KSamplerSelect", sampler_name=name)
        sampler["sampler"] = ["50", 0]
        features.append(name)
    if turbo:
        p["10"] = _node("QI21TurboSampler", model=model, positive=["6", 0], **sampler)
    else:
        cfg = kind == "cfg"
        sampler.update(steps=rng.randint(2, 3), cfg=rng.choice((2.0, 3.5)) if cfg else 1.0)
        if cfg:
            p["7"] = _node("QI21TextEncode", text_encoder=["2", 0], prompt="blurry, low quality")
            sampler["negative"] = ["7", 0]
        p["10"] = _node("QI21Sampler", model=model, positive=["6", 0], **sampler)
    features += [f"batch {sampler['batch_size']}"] + (["keep_cache"] if sampler["keep_cache"] else [])
    p["90"] = _node("SaveLatent", samples=["10", 0], filename_prefix=f"soak/p{index:04}")
    if rng.random() < 0.25:  # decoding is in the mix too (and a point where an interrupt may land)
        p["91"] = _node("QI21VAEDecode", vae=["3", 0], samples=["10", 0])
        p["92"] = _node("PreviewImage", images=["91", 0])
        features.append("decode")
    return p, features


def soak_mix(count: int, seed: int = 0, comfy_samplers: bool = True, interrupts: float = 0.08,
             frees: float = 0.04, quiet_start: int = 10) -> list[SoakPrompt]:
    """`count` prompts, the same for the same arguments. A share `interrupts` is to be interrupted at a random
    point, a share `frees` is followed by a /free (a third of them unloading the models too, a third unloading
    only); none of either among the first `quiet_start` prompts. Those set the memory baseline, so they hold every
    kind once first (in random order) at the largest batch: later prompts meet no code path and no activation size
    the baseline has not seen."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS if comfy_samplers or k != "comfy_sampler"]
    weights = [KINDS[k] for k in kinds]
    warm_up = rng.sample(kinds, len(kinds)) if quiet_start >= len(kinds) else []
    edit = (IMAGES[0], False)
    prompts = []
    for index in range(count):
        kind = warm_up[index] if index < len(warm_up) else rng.choices(kinds, weights)[0]
        if kind == "edit_words" and index < len(warm_up) and "edit" in warm_up[index:]:
            kind = "edit"  # an instruction-only change needs an edit before it
            warm_up[warm_up.index("edit", index + 1)] = "edit_words"
        own = random.Random(rng.getrandbits(64))  # a prompt's own draws: the mix stays when a kind changes
        if kind == "edit":  # a new edit picks its image and DiT; instruction-only changes keep the last ones
            edit = (own.choice(IMAGES), own.random() < 0.5)
        prompt, features = build_prompt(own, kind, index, edit)
        if index < len(warm_up):
            largest = 2 if kind in ("edit", "edit_words") else 4
            prompt["10"]["inputs"]["batch_size"] = largest
            features = [f for f in features if not f.startswith("batch")] + [f"batch {largest}"]
        item = SoakPrompt(index, kind, prompt, features=features)
        interrupt, delay, free, how = rng.random(), rng.choice((0.0, 0.05, 0.2, 0.5, 1.0, 2.0)), rng.random(), \
            rng.choice(({"free_memory": True}, {"unload_models": True, "free_memory": True}, {"unload_models": True}))
        if index >= quiet_start and interrupt < interrupts:
            item.interrupt_after = delay
        if index >= quiet_start and free < frees:
            item.free_after = how
        prompts.append(item)
    return prompts


def reference_prompt(prompt: dict) -> dict:
    """The same prompt to run alone: keep_cache off (nothing is taken from or left in a kept store), no decode."""
    alone = json.loads(json.dumps(prompt))
    for node in alone.values():
        if node["class_type"] in ("QI21Sampler", "QI21TurboSampler"):
            node["inputs"]["keep_cache"] = False
    for node_id in ("91", "92"):
        alone.pop(node_id, None)
    return alone


#: The equality bar: the largest difference over the largest magnitude of the latents. Raw VAE latents of the tiny
#: set reach 20-40, so 1e-5 of their scale is a few 1e-4 absolute; a cached run and an uncached one (CFG's shared
#: rows, a kept cache's rows) differ by float rounding only, observed <= 1e-6 of the scale.
TOLERANCE = 1e-5


def relative_difference(got, expected) -> float:
    """max |got - expected| / max |expected| (shapes must agree)."""
    if tuple(got.shape) != tuple(expected.shape):
        return float("inf")
    scale = max(float(expected.abs().max()), 1e-12)
    return float((got.float() - expected.float()).abs().max()) / scale


def slope_per_prompt(points) -> float:
    """Least-squares slope (bytes per prompt) of `(completed prompts, RSS bytes)` points."""
    xs = np.array([x for x, _ in points], dtype=np.float64)
    ys = np.array([y for _, y in points], dtype=np.float64)
    if len(xs) < 2 or np.ptp(xs) == 0:
        return 0.0
    return float(np.polyfit(xs, ys, 1)[0])


def summary(prompts, outcomes: dict) -> dict:
    """Counts for the measurements table: prompts by kind, completed / interrupted / failed."""
    by_kind, states = {}, {}
    for item in prompts:
        by_kind[item.kind] = by_kind.get(item.kind, 0) + 1
        state = outcomes.get(item.index, {}).get("state", "not run")
        states[state] = states.get(state, 0) + 1
    return {"by_kind": dict(sorted(by_kind.items())), "states": states}
