"""The step cache's quality and speed (model/sampling/step_cache.py): decoded images against the exact path, the
share of steps and of block work skipped, and the wall time with and without, in one run through the pack's nodes.

For every prompt (t2i) and every edit (a reference image: the exact t2i image of another prompt, and an instruction)
the exact run and each setting run interleaved, same seed; each image is decoded through the pack's VAE and compared
with the exact one (PSNR over RGBA in [0, 1], SSIM with an 11x11 Gaussian window of sigma 1.5 as skimage's
`gaussian_weights=True`, mean over channels).

    python benchmarks/bench_step_cache.py --models DIR [--settings t8 t8:0.04 extrapolate ...] [--steps 40]
        [--size 256] [--prompts 20 | --prompts FILE.json] [--edits 20] [--dit NAME --text-encoder NAME --vae NAME]
        [--turbo]   (the Turbo sampler and DiT: its stored 8 steps)
        [--control [--control-blocks N]]   (every run, the exact one too, through the Fun ControlNet)
        [--json FILE]   (every case's row: PSNR, SSIM, seconds and CPU seconds with the exact run's, skips)

A setting is `mode` (T8's thresholds: 0.08 t2i, 0.03 edits) or `mode:threshold[:max_skips[:start-end]]` (that
threshold for both, e.g. `t8:0.12:3:0.1-0.9`). `--control` writes a random
Fun ControlNet for the DiT's config into DIR/model_patches (`CONTROLNET_FILE`; `--control-blocks` blocks, default
one per 2 base blocks as the released 16 per 32, seed 5 as bench_step_cache_comfyui.py's) and applies it through
QI21ControlNetApply at strength 1 over the whole schedule, a toy scene as the map (`control_image`). `--prompts
FILE.json`: {"t2i": [prompt or {"prompt", "seed"}], "edit": [instruction or {"instruction", "seed", "reference":
a picture file beside the JSON}]} (an edit without a picture reads the exact image of t2i prompt i). The built-in
prompts are in the trained toy's vocabulary (shapes, colours, places, backgrounds; recolour, move, remove the
background). A random model (demo/tiny_checkpoints.py's, the default file
names) runs the script but its numbers mean nothing: only a trained model has denoising dynamics to skip.

What the time predicts: a skipped step still runs block 0, the output layer and the loop around them, so on a model of
N blocks a share s of skipped steps saves at most s * (N - 1) / N of the DiT's block work; the last column gives the
same skips at the released 32 blocks. With a Fun ControlNet of K blocks a skipped step also runs control block 0:
s * (N - 1 + K - 1) / (N + K), at 32 + 16 blocks in the last column. `CPU time / exact` is the process's CPU seconds
(all its threads) over the exact run's: with `--threads 1` the work done, whatever else the machine runs, where the
wall time is not.
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from qi21.model.sampling.step_cache import StepCacheOptions
from qi21.nodes import bridge
from qi21.nodes.conditioning import QI21Reference, QI21TextEncode
from qi21.nodes.controlnet import QI21ControlNetApply, QI21ControlNetLoader
from qi21.nodes.decode import QI21VAEDecode
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler
from qi21.nodes.step_cache import QI21StepCache

RELEASED_BLOCKS, RELEASED_CONTROL_BLOCKS = 32, 16
CONTROLNET_FILE = "qi21_bench_step_cache_fun_controlnet.safetensors"
#: The trained toy's vocabulary (demo/toy_data.py in the lead's branch: its caption form 0 and edit phrasings), so the
#: built-in prompts are ones it can draw: (size, colour, shape, where, background) and what the edit of each asks.
SCENES = [(size, colour, shape, where, background)
          for size, colour, shape, where, background in zip(
              ("small", "large") * 10, ("red", "green", "blue", "yellow", "green") * 4,
              ("circle", "square", "triangle") * 7, ("on the left", "on the right", "at the top", "at the bottom",
                                                     "in the center", "on the right", "on the left") * 3,
              ("white", "black", "white", "white") * 5)]
OTHER_COLOUR = {"red": "blue", "green": "yellow", "blue": "red", "yellow": "green"}
OTHER_PLACE = {"on the left": "the right", "on the right": "the left", "at the top": "the bottom",
               "at the bottom": "the top", "in the center": "the left"}


def caption(scene) -> str:
    size, colour, shape, where, background = scene
    return f"a {size} {colour} {shape} {where}, {background} background"


def edit_instruction(scene, index: int) -> str:
    """Recolour, move, or remove the background, in turn (the toy's three kinds of edit)."""
    _, colour, shape, where, _ = scene
    return (f"make the {shape} {OTHER_COLOUR[colour]}", f"move it to {OTHER_PLACE[where]}",
            "remove the background")[index % 3]


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = F.mse_loss(a.double(), b.double()).item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """`[H, W, C]` in [0, 1]: mean SSIM, 11x11 Gaussian window (sigma 1.5), data range 1."""
    x, y = (t.double().permute(2, 0, 1)[:, None] for t in (a, b))  # (C, 1, H, W)
    g = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5) ** 2) / (2 * 1.5**2))
    window = (g[:, None] * g[None]) / g.sum() ** 2

    def blur(t):
        return F.conv2d(t, window[None, None])

    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    c1, c2 = 0.01**2, 0.03**2
    value = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return value.mean().item()


def parse_setting(text: str) -> tuple[str, StepCacheOptions]:
    """`mode[:threshold[:max_skips[:start-end]]]`; without a threshold T8's pair (0.08 t2i, 0.03 edits)."""
    mode, *rest = text.split(":")
    options = {"mode": mode}
    if rest and rest[0]:
        options["threshold"] = options["edit_threshold"] = float(rest[0])
    if len(rest) > 1 and rest[1]:
        options["max_skips"] = int(rest[1])
    if len(rest) > 2 and rest[2]:
        start, end = rest[2].split("-")
        options["start_percent"], options["end_percent"] = float(start), float(end)
    return text, StepCacheOptions(**options)


def cases_from(arg: str, edits: int) -> list[dict]:
    """Each case: `task` ("t2i" / "edit"), `text`, `seed` and, for an edit, `reference`: a picture file, or the index
    of the t2i case whose exact image it edits."""
    if not Path(arg).is_file():
        count = int(arg)
        scenes = [SCENES[i % len(SCENES)] for i in range(count)]
        return ([{"task": "t2i", "text": caption(scene), "seed": i} for i, scene in enumerate(scenes)]
                + [{"task": "edit", "text": edit_instruction(scenes[i % count], i), "seed": 1000 + i,
                    "reference": i % count} for i in range(edits)])
    path = Path(arg)
    data = json.loads(path.read_text())
    t2i = [c if isinstance(c, dict) else {"prompt": c} for c in data["t2i"]]
    out = [{"task": "t2i", "text": c["prompt"], "seed": c.get("seed", i)} for i, c in enumerate(t2i)]
    for i, case in enumerate(data.get("edit", [])[:edits]):
        case = case if isinstance(case, dict) else {"instruction": case}
        file = case.get("reference")
        out.append({"task": "edit", "text": case["instruction"], "seed": case.get("seed", 1000 + i),
                    "reference": path.parent / file if file else i % len(t2i)})
    return out


def block_work_saved(skipped: float, base: int, control: int) -> float:
    """The share of all block runs (the DiT's `base` and a Fun ControlNet's `control`) that a share `skipped` of
    skipped calls saves: a skipped call still runs base block 0 and control block 0."""
    saved = (base - 1) + (control - 1 if control else 0)
    return skipped * saved / (base + control)


def attach_control(model, vae, models: Path, blocks: int | None, size: int):
    """`model` through QI21ControlNetApply with a random Fun ControlNet for its config (written into the models
    folder), strength 1 over the whole schedule, a toy scene as the control map."""
    from qi21.demo import tiny_checkpoints as tiny, toy_data

    blocks = blocks or max(1, model.config.num_layers // 2)
    path = Path(models) / "model_patches" / CONTROLNET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    state = tiny.controlnet_state_dict(model.config, seed=5, blocks=blocks)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(path))
    net = QI21ControlNetLoader.execute(CONTROLNET_FILE, "default")[0]
    scene = toy_data.random_scene(random.Random(3), two_shapes=True).render().convert("RGB").resize((size, size))
    pixels = torch.frombuffer(bytearray(scene.tobytes()), dtype=torch.uint8)
    image = pixels.view(1, size, size, 3).float() / 255.0
    return QI21ControlNetApply.execute(model, net, vae, 1.0, 0.0, 1.0, control_image=image)[0]


def picture(path: Path) -> torch.Tensor:
    """A picture file as a ComfyUI IMAGE `(1, H, W, 4)` in [0, 1] (RGBA, as LoadImage gives with its mask)."""
    from PIL import Image

    with Image.open(path) as image:
        rgba = image.convert("RGBA")
    data = torch.frombuffer(bytearray(rgba.tobytes()), dtype=torch.uint8)
    return data.view(1, rgba.height, rgba.width, 4).float() / 255.0


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="a ComfyUI-style models folder")
    parser.add_argument("--dit", default=None, help="default: the Base file, or the Turbo file with --turbo")
    parser.add_argument("--turbo", action="store_true", help="the Turbo sampler (8 stored steps; --steps ignored)")
    parser.add_argument("--text-encoder", default="qwen3vl_8b_bf16.safetensors")
    parser.add_argument("--vae", default="qwen_image_2.1_vae_bf16.safetensors")
    parser.add_argument("--weight-dtype", default="default")
    parser.add_argument("--settings", nargs="+", default=["t8", "extrapolate"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--prompts", default="20", help="a count of built-in prompts, or a JSON file")
    parser.add_argument("--edits", type=int, default=20, help="edits (0: t2i only)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write every case's row here (to merge split runs)")
    parser.add_argument("--control", action="store_true", help="every run through a (random) Fun ControlNet")
    parser.add_argument("--control-blocks", type=int, default=None,
                        help="its blocks (default: one per 2 of the DiT's, as the release)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bridge.set_models_root(args.models)
    if args.turbo:
        args.steps = 8
    dit = args.dit or ("qwen_image_2.1_turbo_bf16.safetensors" if args.turbo else "qwen_image_2.1_bf16.safetensors")
    model = QI21ModelLoader.execute(dit, args.weight_dtype)[0]
    encoder = QI21TextEncoderLoader.execute(args.text_encoder, "default")[0]
    vae = QI21VAELoader.execute(args.vae, "default")[0]
    if args.control:  # the exact runs too: every setting is compared with the controlled exact path
        model = attach_control(model, vae, args.models, args.control_blocks, args.size)
    settings = [parse_setting(s) for s in args.settings]
    copies = {name: QI21StepCache.execute(model, o.mode, o.threshold, o.edit_threshold, o.start_percent,
                                          o.end_percent, o.max_skips)[0] for name, o in settings}
    cases = cases_from(args.prompts, args.edits)
    t2i = [case["text"] for case in cases if case["task"] == "t2i"]
    edits = [case for case in cases if case["task"] == "edit"]

    def generate(which, positive, seed):
        started, cpu = time.perf_counter(), time.process_time()
        if args.turbo:
            out = QI21TurboSampler.execute(which, positive, seed, args.size, args.size, 1)
        else:
            out = QI21Sampler.execute(which, positive, seed, args.steps, 1.0, args.size, args.size, 1)
        seconds = (time.perf_counter() - started, time.process_time() - cpu)
        rgba = QI21VAEDecode.execute(vae, out[0])[2][0]  # RGBA, as the yardstick compares (the alpha is drawn too)
        return rgba, out.ui["qi21_report"][0], seconds

    warm = QI21TextEncode.execute(encoder, t2i[0], None)[0]
    for which in (model, *copies.values()):  # first calls allocate and fill caches: not part of any timing
        generate(which, warm, 0)
    rows = {(name, task): [] for name, _ in settings for task in ("t2i", "edit")}
    exact_seconds = {"t2i": [], "edit": []}
    blocks, kind = model.config.num_layers, "Turbo" if args.turbo else "Base"
    control = getattr(model, "control", None)
    control_blocks = 0 if control is None else control.net.config.num_blocks
    exact_images = []
    for case in cases:
        task, text, seed, source = case["task"], case["text"], case["seed"], case.get("reference")
        references = None
        if task == "edit":  # a picture file, or the exact t2i image of another case
            image = exact_images[source][None] if isinstance(source, int) else picture(source)
            references = QI21Reference.execute(vae, image, max(args.size, 256))[0]  # the VLM needs 256 px
        positive = QI21TextEncode.execute(encoder, text, references)[0]
        exact, _, seconds = generate(model, positive, seed)
        if task == "t2i":
            exact_images.append(exact)
        exact_seconds[task].append(seconds)
        for name, _ in settings:
            image, report, seconds = generate(copies[name], positive, seed)
            # threshold 0 (or mode off) runs no step cache at all, so the report has none
            step_cache = report.get("step_cache") or {"run": args.steps, "skipped": 0, "blocks_skipped_share": 0.0,
                                                      "pattern": "F" * args.steps}
            calls = step_cache["run"] + step_cache["skipped"]
            rows[(name, task)].append({"psnr": psnr(image, exact), "ssim": ssim(image, exact), "seconds": seconds[0],
                                       "cpu": seconds[1],
                                       "control": step_cache.get("control"),
                                       "skipped": step_cache["skipped"] / calls,
                                       "blocks": block_work_saved(step_cache["skipped"] / calls, blocks,
                                                                  control_blocks),
                                       "pattern": step_cache["pattern"]})

    with_control = "" if not control_blocks else f", with a Fun ControlNet of {control_blocks} blocks"
    print(f"\n## step cache vs exact: {len(t2i)} t2i prompts, {len(edits)} edits, {args.steps} {kind} steps, "
          f"{args.size}x{args.size}, {blocks} blocks{with_control}, {torch.get_num_threads()} threads ({args.models})")
    print("| setting | task | PSNR dB mean (min) | SSIM mean (min) | steps skipped | block work skipped | "
          f"time / exact (median) | CPU time / exact (median) | blocks' share predicts ({blocks} blocks) | "
          "predicted at 32 blocks |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for (name, task), results in rows.items():
        if not results:
            continue
        finite = [r["psnr"] for r in results if r["psnr"] != float("inf")]
        psnr_mean = statistics.mean(finite) if finite else float("inf")
        ratios = [r["seconds"] / e for r, (e, _) in zip(results, exact_seconds[task])]
        cpu_ratios = [r["cpu"] / c for r, (_, c) in zip(results, exact_seconds[task])]
        skipped = statistics.mean(r["skipped"] for r in results)
        entry = {"psnr_mean": psnr_mean, "psnr_min": min(r["psnr"] for r in results),
                 "ssim_mean": statistics.mean(r["ssim"] for r in results), "ssim_min": min(r["ssim"] for r in results),
                 "skipped": skipped, "blocks_skipped": statistics.mean(r["blocks"] for r in results),
                 "time_ratio": statistics.median(ratios), "cpu_ratio": statistics.median(cpu_ratios),
                 "predicted_32": 1 - block_work_saved(skipped, RELEASED_BLOCKS,
                                                      RELEASED_CONTROL_BLOCKS if control_blocks else 0),
                 "patterns": [r["pattern"] for r in results], "control": results[0]["control"]}
        summary[(name, task)] = entry
        print(f"| {name} | {task} | {entry['psnr_mean']:.2f} ({entry['psnr_min']:.2f}) | {entry['ssim_mean']:.4f} "
              f"({entry['ssim_min']:.4f}) | {skipped:.1%} | {entry['blocks_skipped']:.1%} | "
              f"{entry['time_ratio']:.3f} | {entry['cpu_ratio']:.3f} | {1 - entry['blocks_skipped']:.3f} | "
              f"{entry['predicted_32']:.3f} |")
    for (name, task), entry in summary.items():
        print(f"{name} {task} first pattern: {entry['patterns'][0]}")
    if args.json:
        Path(args.json).write_text(json.dumps([{"setting": name, "task": task, **row, "exact_seconds": exact}
                                               for (name, task), results in rows.items()
                                               for row, exact in zip(results, exact_seconds[task])], indent=1))
    return summary


if __name__ == "__main__":
    main()
