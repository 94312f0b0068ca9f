"""Quality against the exact path, on the trained toy: what each lossy variant does to its pictures, what each step
cache setting does (and saves), and whether the toy draws what it is asked. One script, one list of variants.

    python benchmarks/quality.py variants [--steps 40] [--only "int8 cache,Q4_K"] [--threads 2] [--cases 2,3]
                                          [--fp8-keep REGEX ...]   (fp8 with those layers in bf16: the sweep)
    python benchmarks/quality.py step-cache [--models DIR] [--settings t8 t8:0.04 extrapolate ...] [--steps 40] ...
    python benchmarks/quality.py accuracy [--steps 40] [--cfg 4] [--turbo] [--sheet FILE] [--toy DIR]
    python benchmarks/quality.py cases OUT   (the toy's models folder and the cases as a --prompts JSON)
    python benchmarks/quality.py fp8-lora [--rank 16] [--strength 1.0] [--count 6] [--steps 40] [--threads 2]
    python benchmarks/quality.py fp8-width [--blocks 2] [--text 32] [--grid 16] [--threads 2]
    python benchmarks/quality.py pad-crop [--seeds 4] [--steps 20] [--picture docs/images/pad_crop.png]

`variants` (the yardstick): the same prompts, seeds and references (`cases`: 14 text-to-image prompts and 6 edits
drawn from the toy's vocabulary, 40 Base steps, 256x256) run through the exact path (the committed weights in fp32,
the prefix cache in fp32) and through each entry of `VARIANTS`, an option the pack offers that trades accuracy for
memory or speed; each variant's decoded RGBA images are compared with the exact path's: PSNR and SSIM (mean and
worst) and the share of images whose picture reads the same (background, the shape's colour and position:
demo/toy_eval.py `analyse`). The bf16 row (the whole DiT computed in bf16) is the drift every bf16 user already
accepts; a variant far below it moves the picture. A new lossy option is one more `Variant` in the list.

`step-cache`: the exact run and each step cache setting, interleaved, same seed, through the pack's nodes (so any
models folder, real weights too); PSNR / SSIM against the exact image, the share of steps and of block work skipped,
wall and CPU time over the exact run's. Its options are in `step_cache_parser`.

`accuracy`: 40 text-to-image prompts and 20 edits (another seed than training's draws), each picture read by
`analyse`: the share with the asked colour and side (and background); an edit must keep what it was not asked to
change. `--sheet FILE` writes every picture with its prompt and what was read (docs/images/toy_accuracy.png).

`fp8-lora`: a LoRA on an `fp8_e4m3fn_fast` base, its branch beside the fp8 GEMM against the LoRA merged before
quantizing (`FP8_LORA_HELP`). `fp8-width`: the velocity at the released width with each fp8 recipe, random weights
(`FP8_WIDTH_HELP`; the recipes emulated there and in `VARIANTS` are parts/fp8_recipes.py). `pad-crop`: does an edit
lay over its input, fit = pad against today's resize (parts/pad_crop.py, the picture of docs/pad-and-crop.md).

A toy's numbers bound nothing about the real 7B model: its weights are small and its pictures flat shapes. They
rank the options and show which are near-lossless and which move the picture. PSNR, SSIM, the reading of a picture
and the vocabulary are demo/'s (toy_eval.py, toy_data.py), defined once.
"""

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from parts import pad_crop
from parts.fp8_recipes import every_linear_fp8, fp8_except, merged_lora_fp8, scale_one
from qi21.demo import tiny_checkpoints as tiny
from qi21.demo.toy_data import random_edit, random_scene
from qi21.demo.toy_eval import ToyPipeline, analyse, psnr, ssim
from qi21.demo.toy_model import TOY_DIR, write_toy_checkpoints
from qi21.model.features.lora import apply_lora
from qi21.model.layers.fast_gemm import force_scaled_mm
from qi21.model.loaders.dit import load_dit
from qi21.model.sampling.step_cache import StepCacheOptions
from qi21.model.sampling.step_presets import shipped_presets
from qi21.model.transformer.dit import DiTConfig, PrefixInputs
from qi21.model.transformer.layout import build_layout
from qi21.nodes import bridge
from qi21.nodes.conditioning import QI21Reference, QI21TextEncode
from qi21.nodes.controlnet import QI21ControlNetApply, QI21ControlNetLoader
from qi21.nodes.decode import QI21VAEDecode
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler
from qi21.nodes.step_cache import QI21StepCache, method_options
from variants import comfy_tensors, quantized_file, write_gguf

T2I, EDITS = 14, 6
EDIT_KINDS = ("recolour", "move", "background")


def cases(seed: int = 7, t2i: int = T2I, edits: int = EDITS) -> list[tuple[str, object, int]]:
    """(prompt, source scene or None, seed): not the training draws (another seed), the same every run."""
    rng = random.Random(seed)
    out = [(random_scene(rng).caption(0), None, 1000 + i) for i in range(t2i)]
    for i in range(edits):
        edit = random_edit(rng, EDIT_KINDS[i % 3])
        out.append((edit.instruction, edit.source, 2000 + i))
    return out


def toy_pipeline(root: Path, runs) -> tuple[ToyPipeline, dict]:
    """The trained toy's files written under `root/models` and its pipeline, with the reference of each edit of
    `runs` (by index)."""
    write_toy_checkpoints(root / "models")
    pipe = ToyPipeline(root / "models")
    return pipe, {i: pipe.reference(source.render()) for i, (_, source, _) in enumerate(runs) if source}


def toy_images(pipe: ToyPipeline, runs, references: dict, model, steps: int, **extra) -> list[torch.Tensor]:
    """Each case of `runs` through `model`: its decoded RGBA image, `extra` passed on to `generate`."""
    out = []
    for i, (prompt, _, seed) in enumerate(runs):
        refs = (references[i],) if i in references else ()
        out.append(pipe.generate(prompt, seed, refs, steps=steps, model=model, **extra)[0][0])
    return out


# -- variants: lossy options against the exact path ------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One lossy option: `make(pipe, tensors, folder)` -> (model, extra `sample()` options), where `tensors` are the
    exact DiT's weights in ComfyUI's layout (to write files from, as users get them) and `folder` a scratch folder."""

    name: str
    make: Callable


def _gguf(qtype: str) -> Variant:
    return Variant(f"GGUF {qtype}", lambda pipe, tensors, folder: (
        pipe.load(write_gguf(folder / f"toy-{qtype}.gguf", tensors, qtype)), {}))


def _quantized_file(kind: str) -> Variant:
    return Variant(f"{kind} file", lambda pipe, tensors, folder: (
        pipe.load(quantized_file(tensors, kind, folder / f"toy_{kind}.safetensors")), {}))


#: Every lossy option the yardstick measures, in its table's order. New ones (a compute mode, a format) go at the
#: end, as one more `Variant`.
VARIANTS = [
    Variant("bf16 (whole DiT)", lambda pipe, tensors, folder: (pipe.dit(weight_dtype="bf16"), {})),
    Variant("int8 cache", lambda pipe, tensors, folder: (pipe.dit(), {"cache_dtype": "int8"})),
    Variant("int4 cache", lambda pipe, tensors, folder: (pipe.dit(), {"cache_dtype": "int4"})),
    *(_gguf(qtype) for qtype in ("Q8_0", "Q4_K", "Q2_K")),
    Variant("fp8 weights (loader fp8_e4m3fn)", lambda pipe, tensors, folder: (pipe.dit(weight_dtype="fp8_e4m3fn"), {})),
    *(_quantized_file(kind) for kind in ("int8_convrot", "fp8", "w4a8", "nvfp4", "mxfp8")),
    # fp8_e4m3fn_fast through torch._scaled_mm (forced: a CPU otherwise dequantizes, the next row), beside core's
    # scale-1 recipe (emulated), the same with every Linear in fp8 (why the others stay bf16) and with the q and k rows
    # in fp8 too (why they stay bf16)
    Variant("fp8_e4m3fn_fast (_scaled_mm, per-row scales)", lambda pipe, tensors, folder: (
        pipe.dit(weight_dtype="fp8_e4m3fn_fast"), {"context": force_scaled_mm})),
    Variant("fp8_e4m3fn_fast weights computed in bf16", lambda pipe, tensors, folder: (
        pipe.dit(weight_dtype="fp8_e4m3fn_fast"), {})),
    Variant("core's fp8_e4m3fn_fast (scale 1, emulated)", lambda pipe, tensors, folder: (
        scale_one(pipe.load(_plain_file(pipe), "fp8_e4m3fn")), {})),
    Variant("fp8_e4m3fn_fast, every Linear in fp8", lambda pipe, tensors, folder: (
        every_linear_fp8(pipe.load(_plain_file(pipe), "fp8_e4m3fn_fast")), {"context": force_scaled_mm})),
    Variant("fp8_e4m3fn_fast with q and k in fp8 too", lambda pipe, tensors, folder: (
        fp8_except(pipe.load(_plain_file(pipe), "bf16")), {"context": force_scaled_mm})),
]


def _plain_file(pipe: ToyPipeline) -> Path:
    return pipe.root / "diffusion_models" / pipe.dit_file


def run_variants(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="quality.py variants", description="lossy options against the exact path")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", default="", help="comma list of variant names (substrings) to run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default="", help="comma list of case indices to run (default: all)")
    parser.add_argument("--fp8-keep", nargs="*", default=[], metavar="REGEX",
                        help="more variants: every block linear in fp8 rowwise (q and k too) but the weights whose "
                             "names match REGEX (in bf16), the sweep behind the recipe's one exception; e.g. "
                             "'\\.down\\.' 'blocks\\.0\\.'")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sweep = [Variant(f"fp8 but {keep} in bf16", lambda pipe, tensors, folder, keep=keep: (
        fp8_except(pipe.load(_plain_file(pipe), "bf16"), keep), {"context": force_scaled_mm}))
             for keep in args.fp8_keep]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = cases()
        if args.cases:
            runs = [runs[int(i)] for i in args.cases.split(",")]
        pipe, references = toy_pipeline(root, runs)

        def images(model, extra):
            extra = dict(extra)
            with extra.pop("context", contextlib.nullcontext)():  # a test seam the variant runs under
                return toy_images(pipe, runs, references, model, args.steps, **extra)

        tick = time.perf_counter()
        exact_model = pipe.dit()
        exact = images(exact_model, {})
        print(f"exact path: {len(runs)} images in {time.perf_counter() - tick:.1f} s ({args.steps} Base steps)")
        readings = [analyse(image) for image in exact]
        tensors = comfy_tensors(exact_model)
        print("| variant | PSNR mean (dB) | PSNR worst | SSIM mean | SSIM worst | reads the same |")
        print("|---|---|---|---|---|---|")
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        for variant in VARIANTS + sweep:
            if wanted and not any(w in variant.name for w in wanted):
                continue
            try:
                got = images(*variant.make(pipe, tensors, root))
            except Exception as error:  # a variant this machine cannot run (a missing library) is reported
                print(f"| {variant.name} | not run: {type(error).__name__}: {str(error)[:80]} | | | | |")
                continue
            p = [psnr(a, b) for a, b in zip(got, exact)]
            s = [ssim(a, b) for a, b in zip(got, exact)]
            same = sum(analyse(a).reading == r.reading for a, r in zip(got, readings))
            finite = [v for v in p if v != float("inf")] or [float("inf")]
            print(f"| {variant.name} | {statistics.fmean(finite):.1f} | {min(p):.1f} | {statistics.fmean(s):.4f} | "
                  f"{min(s):.4f} | {same}/{len(runs)} |", flush=True)


# -- accuracy: does the toy draw what it is asked? --------------------------------------------------------------
def asked(scene) -> tuple:
    item = scene.items[0]
    return scene.background, item.colour, item.position


def run_accuracy(argv=None) -> None:
    from qi21.demo.toy_workflows import contact_sheet

    parser = argparse.ArgumentParser(prog="quality.py accuracy", description="does the toy draw what it is asked?")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--turbo", action="store_true", help="the Turbo DiT and its 8 stored sigmas")
    parser.add_argument("--cfg", type=float, default=1.0, help="true CFG against the empty prompt (1: none)")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--edits", type=int, default=20)
    parser.add_argument("--sheet", type=Path, default=None)
    parser.add_argument("--toy", type=Path, default=TOY_DIR,
                        help="the toy's files (default demo/toy/; a fresh `train_toy.py --out DIR` to judge it)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(11)
    t2i = [random_scene(rng) for _ in range(args.prompts)]
    edits = [random_edit(rng, EDIT_KINDS[i % 3]) for i in range(args.edits)]
    with tempfile.TemporaryDirectory() as tmp:
        write_toy_checkpoints(Path(tmp), args.toy)
        pipe = ToyPipeline(Path(tmp))
        entries, tick = [], time.perf_counter()
        for kind, drawn in (("text-to-image", [(s.caption(0), None, s) for s in t2i]),
                            ("edit", [(e.instruction, e.source, e.target) for e in edits])):
            if not drawn:  # --prompts 0 or --edits 0
                continue
            sided = full = 0
            for i, (prompt, source, wanted) in enumerate(drawn):
                refs = (pipe.reference(source.render()),) if source else ()
                image = pipe.generate(prompt, 100 + i, refs, steps=args.steps, turbo=args.turbo, cfg=args.cfg,
                                      negative="" if args.cfg != 1 else None)[0][0]
                got, want = analyse(image).reading, asked(wanted)
                sided += got[1:] == want[1:]
                full += got == want
                path = Path(tmp) / f"{kind}_{i}.png"
                Image.fromarray((image * 255).round().byte().numpy(), "RGBA").save(path)
                label = f"{'ok' if got == want else 'MISS'}: {' '.join(str(g) for g in got)}"
                entries.append((label, (f"[{asked(source)[1]} {asked(source)[2]}] " if source else "") + prompt,
                                path))
            print(f"{kind}: {sided}/{len(drawn)} ({100 * sided / len(drawn):.0f}%) have the asked colour and side, "
                  f"{full}/{len(drawn)} also the asked background")
        print(f"{len(entries)} pictures in {time.perf_counter() - tick:.1f} s "
              f"({'Turbo, 8 sigmas' if args.turbo else f'{args.steps} Base steps'}, cfg {args.cfg:g})")
        if args.sheet:
            print(f"sheet: {contact_sheet(entries, args.sheet, columns=10)}")


# -- cases: the toy and the cases as files ----------------------------------------------------------------------
def write_cases(argv=None) -> None:
    """The toy's models folder and `cases()` as a `step-cache --prompts` JSON (the edits' pictures beside it): what
    the step cache was measured on (docs/measurements.md), for a run elsewhere."""
    parser = argparse.ArgumentParser(prog="quality.py cases", description=write_cases.__doc__)
    parser.add_argument("out", type=Path, help="the folder to write them to (made if missing)")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    write_toy_checkpoints(out / "models")
    found = {"t2i": [], "edit": []}
    for i, (prompt, source, seed) in enumerate(cases()):
        if source is None:
            found["t2i"].append({"prompt": prompt, "seed": seed})
        else:
            source.render().save(out / f"source_{i}.png")
            found["edit"].append({"instruction": prompt, "seed": seed, "reference": f"source_{i}.png"})
    (out / "cases.json").write_text(json.dumps(found, indent=1))
    print(f"{len(found['t2i'])} prompts, {len(found['edit'])} edits in {out}")


# -- fp8-lora: a LoRA on the fp8 base, as a branch or merged -----------------------------------------------------
FP8_LORA_HELP = """A LoRA on an `fp8_e4m3fn_fast` base, on the trained toy: its branch beside the fp8 GEMM (what the
pack does) or merged into the weights before they are quantized, each against the exact path (fp32 weights, the
LoRA's branch).

The LoRA is the toy's Turbo minus its Base (ComfyUI's extraction, `--rank`), applied to the Base at `--strength`: a
LoRA that moves every block linear, as the Turbo extracts users run do. The pictures are the yardstick's first
`--count` cases (`variants`), 40 Base steps, 256x256; `_scaled_mm` forced (a CPU would dequantize).

    python benchmarks/quality.py fp8-lora [--rank 16] [--strength 1.0] [--count 6] [--steps 40] [--threads 2]
"""


def run_fp8_lora(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="quality.py fp8-lora", description=FP8_LORA_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--strength", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = cases()[: args.count]
        pipe, references = toy_pipeline(root, runs)
        lora = root / "turbo_lora.safetensors"
        save_file(tiny.extracted_lora_state_dict(load_file(str(TOY_DIR / "transformer_base.safetensors")),
                                                 load_file(str(TOY_DIR / "transformer_turbo.safetensors")), args.rank),
                  str(lora))

        exact = toy_images(pipe, runs, references, apply_lora(pipe.dit(), lora, args.strength), args.steps)
        variants = {"bf16 base + LoRA (the drift bf16 users accept)":
                    lambda: apply_lora(pipe.dit(weight_dtype="bf16"), lora, args.strength),
                    "fp8_e4m3fn_fast + LoRA branch beside the fp8 GEMM":
                    lambda: apply_lora(pipe.dit(weight_dtype="fp8_e4m3fn_fast"), lora, args.strength),
                    "LoRA merged, then quantized to fp8 rowwise":
                    lambda: merged_lora_fp8(pipe.dit(weight_dtype="bf16"), lora, args.strength)}
        print(f"LoRA: the toy's Turbo - Base, rank {args.rank}, strength {args.strength}; {len(runs)} pictures, "
              f"{args.steps} steps")
        print("| variant | PSNR mean (dB) | PSNR worst | SSIM mean |")
        print("|---|---|---|---|")
        for name, make in variants.items():
            with force_scaled_mm():
                got = toy_images(pipe, runs, references, make(), args.steps)
            p = [psnr(a, b) for a, b in zip(got, exact)]
            s = [ssim(a, b) for a, b in zip(got, exact)]
            print(f"| {name} | {statistics.fmean(p):.1f} | {min(p):.1f} | {statistics.fmean(s):.4f} |", flush=True)


# -- fp8-width: the velocity at the released width ---------------------------------------------------------------
FP8_WIDTH_HELP = """The velocity at the released width with fp8 compute: random weights, width 4096 (32 heads of 128,
MLP 12288), a few blocks, a short sequence, each recipe's velocity against the fp32 one, beside bf16's own drift.

Rows: bf16 (the whole DiT in bf16), fp8_e4m3fn_fast through `torch._scaled_mm` (forced on a CPU), the same weights
computed in bf16 (what a CPU or a GPU before Ada runs), the loader's fp8_e4m3fn (weights cast with scale 1, bf16
compute) and core's scale-1 fp8 GEMM (emulated: benchmarks/parts/fp8_recipes.py). Random weights have no outlier
channels: real activations have, which is where the scale-1 recipe loses most; this bounds the per-row recipe's own
rounding.

    python benchmarks/quality.py fp8-width [--blocks 2] [--text 32] [--grid 16] [--threads 2]
"""


def width_inputs(config: DiTConfig, text: int, grid: int, seed: int = 1):
    """One prompt of `text` tokens (no reference) and a `grid` x `grid` target: the DiT's inputs."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.zeros(text, dtype=torch.bool)
    prefixes = [PrefixInputs(layout=build_layout(slots, (), (grid, grid)),
                             text=torch.randn(text, config.context_in_dim, generator=g), references=None)]
    target = torch.randn(1, grid * grid, config.in_channels, generator=g)
    return target, prefixes


def run_fp8_width(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="quality.py fp8-width", description=FP8_WIDTH_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--text", type=int, default=32)
    parser.add_argument("--grid", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = DiTConfig(num_layers=args.blocks)
    target, prefixes = width_inputs(config, args.text, args.grid)
    rows = {"bf16": ("bf16", None, False),
            "fp8_e4m3fn_fast (_scaled_mm, per-row scales)": ("fp8_e4m3fn_fast", None, True),
            "fp8_e4m3fn_fast weights computed in bf16": ("fp8_e4m3fn_fast", None, False),
            "fp8_e4m3fn (weights cast, scale 1; bf16 compute)": ("fp8_e4m3fn", None, False),
            "core's fp8_e4m3fn_fast (scale 1, emulated)": ("fp8_e4m3fn", scale_one, False)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen_image_2.1_bf16.safetensors"
        state = tiny.comfy_dit_state_dict(tiny.dit_state_dict(config, seed=0))
        save_file({k: v.bfloat16() for k, v in state.items()}, str(path))
        del state

        def velocity(weight_dtype, change=None, forced=False):
            model = load_dit(path, weight_dtype=weight_dtype)
            if change is not None:
                model = change(model)
            with torch.no_grad(), force_scaled_mm(forced):
                return model(target.to(model.compute_dtype), torch.tensor([0.6]), prefixes).float()

        tick = time.perf_counter()
        exact = velocity("fp32")
        print(f"width {config.width}, {args.blocks} blocks, {args.text} text + {args.grid ** 2} target tokens "
              f"(fp32: {time.perf_counter() - tick:.1f} s)")
        print("| recipe | rel. L2 vs fp32 | rel. L2 vs bf16 | max abs vs fp32 / max abs |")
        print("|---|---|---|---|")
        bf16 = None
        for name, (dtype, change, forced) in rows.items():
            got = velocity(dtype, change, forced)
            bf16 = got if bf16 is None else bf16
            to_exact = ((got - exact).norm() / exact.norm()).item()
            to_bf16 = ((got - bf16).norm() / bf16.norm()).item()
            peak = ((got - exact).abs().max() / exact.abs().max()).item()
            print(f"| {name} | {to_exact:.4f} | {to_bf16:.4f} | {peak:.4f} |", flush=True)


# -- step-cache: each setting against the exact path, through the nodes ------------------------------------------
STEP_CACHE_HELP = """The step cache's quality and speed (model/sampling/step_cache.py): decoded images against the
exact path, the share of steps and of block work skipped, and the wall time with and without, in one run through
the pack's nodes.

For every prompt (t2i) and every edit (a reference image and an instruction)
the exact run and each setting run interleaved, same seed; each image is decoded through the pack's VAE and compared
with the exact one (PSNR over RGBA in [0, 1], SSIM with an 11x11 Gaussian window of sigma 1.5 as skimage's
`gaussian_weights=True`, mean over channels).

    python benchmarks/quality.py step-cache [--models DIR] [--settings t8 t8:0.04 extrapolate ...] [--steps 40]
        [--size 256] [--prompts 14 | --prompts FILE.json] [--edits 6] [--dit NAME --text-encoder NAME --vae NAME]
        [--turbo]   (the Turbo sampler and DiT: its stored 8 steps)
        [--control [--control-blocks N]]   (every run, the exact one too, through the Fun ControlNet)
        [--json FILE]   (every case's row: PSNR, SSIM, seconds and CPU seconds with the exact run's, skips)

A setting is `mode` (T8's thresholds: 0.08 t2i, 0.03 edits) or `mode:threshold[:max_skips[:start-end]]` (that
threshold for both, e.g. `t8:0.12:3:0.1-0.9`), then any of the step methods' inputs of the node as `name=value`
(order, probe_blocks, back_blocks, full_first, full_every, full_last, edit_threshold; schedule as shares joined by
`/`), e.g. `taylor:0.3:3:order=1:back_blocks=1` or `taylor:1e9:order=1:probe_blocks=0:schedule=0/0.075/0.175`; or a
preset's name (`balanced`, model/sampling/step_cache_presets.json). `--control` writes a random
Fun ControlNet for the DiT's config into DIR/model_patches (`CONTROLNET_FILE`; `--control-blocks` blocks, default
one per 2 base blocks as the released 16 per 32, seed 5 as comfyui.py step-cache's) and applies it through
QI21ControlNetApply at strength 1 over the whole schedule, a toy scene as the map (`control_image`). `--prompts
FILE.json`: {"t2i": [prompt or {"prompt", "seed"}], "edit": [instruction or {"instruction", "seed", "reference":
a picture file beside the JSON}]} (an edit without a picture reads the exact image of t2i prompt i). Without
`--prompts FILE`, the first cases of `cases` (the yardstick's draws from the toy's vocabulary; the defaults are its 14
prompts and 6 edits), and without `--models` the trained toy, written to a temporary folder. A random model
(demo/tiny_checkpoints.py's, the default file names) runs the script but its numbers mean nothing: only a trained
model has denoising dynamics to skip.

What the time predicts: a skipped step still runs block 0, the output layer and the loop around them, so on a model of
N blocks a share s of skipped steps saves at most s * (N - 1) / N of the DiT's block work; the last column gives the
same skips at the released 32 blocks. With a Fun ControlNet of K blocks a skipped step also runs control block 0:
s * (N - 1 + K - 1) / (N + K), at 32 + 16 blocks in the last column. `CPU time / exact` is the process's CPU seconds
(all its threads) over the exact run's: with `--threads 1` the work done, whatever else the machine runs, where the
wall time is not.
"""
RELEASED_BLOCKS, RELEASED_CONTROL_BLOCKS = 32, 16
#: the node's widget defaults (T8's), under a setting's own inputs when it is checked
NODE_DEFAULTS = {name: getattr(StepCacheOptions(), name)
                 for name in ("threshold", "edit_threshold", "start_percent", "end_percent", "max_skips")}
CONTROLNET_FILE = "qi21_bench_step_cache_fun_controlnet.safetensors"

#: the node's inputs a setting may give as `name=value` (quality.py step-cache, STEP_CACHE_HELP)
METHOD_INPUTS = {"order": int, "probe_blocks": int, "back_blocks": int, "full_first": int, "full_every": int,
                 "full_last": int, "edit_threshold": float, "schedule": lambda v: v.replace("/", ",")}


def parse_setting(text: str) -> tuple[str, dict]:
    """`mode[:threshold[:max_skips[:start-end]]][:name=value ...]` (without a threshold T8's pair, 0.08 t2i, 0.03
    edits), or a preset's name: the Step Cache node's inputs (its `execute` keywords), checked by building them."""
    if text in shipped_presets():
        return text, {"preset": text}
    positional = [part for part in text.split(":") if "=" not in part]
    named = [part.split("=", 1) for part in text.split(":") if "=" in part]
    mode, *rest = positional
    inputs = {"mode": mode}
    if rest and rest[0]:
        inputs["threshold"] = inputs["edit_threshold"] = float(rest[0])
    if len(rest) > 1 and rest[1]:
        inputs["max_skips"] = int(rest[1])
    if len(rest) > 2 and rest[2]:
        start, end = rest[2].split("-")
        inputs["start_percent"], inputs["end_percent"] = float(start), float(end)
    for name, value in named:
        if name not in METHOD_INPUTS:
            raise SystemExit(f"setting {text!r}: {name!r} is not one of {', '.join(METHOD_INPUTS)}")
        inputs[name] = METHOD_INPUTS[name](value)
    node_inputs = {k: v for k, v in inputs.items() if k != "mode"}
    method_options(mode, **{**NODE_DEFAULTS, **node_inputs})  # a bad value is refused here, naming the input
    return text, inputs


def released_share_run(step_cache: dict, blocks: int) -> float:
    """The share of block runs a run's skips would leave at `blocks` blocks (the released 32), from its report: a
    skipped call runs the probe (and, where it resumed, the back blocks)."""
    calls = step_cache["run"] + step_cache["skipped"]
    probe, back = step_cache.get("probe_blocks", 1), step_cache.get("back_blocks", 0)
    resumed = step_cache.get("back_blocks_ran", 0)
    saved = resumed * (blocks - probe - back) + (step_cache["skipped"] - resumed) * (blocks - probe)
    return 1 - saved / (calls * blocks)


def cases_from(arg: str, edits: int) -> list[dict]:
    """Each case: `task` ("t2i" / "edit"), `text`, `seed` and, for an edit, `reference`: a picture (a file or a PIL
    image), or the index of the t2i case whose exact image it edits."""
    if not Path(arg).is_file():  # `cases`: an edit's reference is its source scene, drawn
        return [{"task": "t2i", "text": text, "seed": seed} if source is None else
                {"task": "edit", "text": text, "seed": seed, "reference": source.render()}
                for text, source, seed in cases(t2i=int(arg), edits=edits)]
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


def picture(source) -> torch.Tensor:
    """A picture (a file or a PIL image) as a ComfyUI IMAGE `(1, H, W, 4)` in [0, 1] (RGBA, as LoadImage gives with
    its mask)."""
    if isinstance(source, Image.Image):
        rgba = source.convert("RGBA")
    else:
        with Image.open(source) as image:
            rgba = image.convert("RGBA")
    data = torch.frombuffer(bytearray(rgba.tobytes()), dtype=torch.uint8)
    return data.view(1, rgba.height, rgba.width, 4).float() / 255.0


def run_step_cache(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="quality.py step-cache", description=STEP_CACHE_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="a ComfyUI-style models folder (default: the trained toy)")
    parser.add_argument("--dit", default=None, help="default: the Base file, or the Turbo file with --turbo")
    parser.add_argument("--turbo", action="store_true", help="the Turbo sampler (8 stored steps; --steps ignored)")
    parser.add_argument("--text-encoder", default="qwen3vl_8b_bf16.safetensors")
    parser.add_argument("--vae", default="qwen_image_2.1_vae_bf16.safetensors")
    parser.add_argument("--weight-dtype", default="default")
    parser.add_argument("--settings", nargs="+", default=["t8", "extrapolate"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--prompts", default=str(T2I), help="a count of built-in prompts, or a JSON file")
    parser.add_argument("--edits", type=int, default=EDITS, help="edits (0: t2i only)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write every case's row here (to merge split runs)")
    parser.add_argument("--control", action="store_true", help="every run through a (random) Fun ControlNet")
    parser.add_argument("--control-blocks", type=int, default=None,
                        help="its blocks (default: one per 2 of the DiT's, as the release)")
    args = parser.parse_args(argv)
    if args.models is None:
        with tempfile.TemporaryDirectory() as tmp:
            write_toy_checkpoints(Path(tmp))
            args.models = tmp
            return measure_step_cache(args)
    return measure_step_cache(args)


def measure_step_cache(args) -> dict:
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
    copies = {name: QI21StepCache.execute(model, **inputs)[0] for name, inputs in settings}
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
            skipped_share = step_cache["skipped"] / calls
            if "decide" in step_cache:  # the step methods: their report counts the probe and back blocks
                done, released = step_cache["blocks_skipped_share"], released_share_run(step_cache, RELEASED_BLOCKS)
            else:
                done = block_work_saved(skipped_share, blocks, control_blocks)
                released = 1 - block_work_saved(skipped_share, RELEASED_BLOCKS,
                                                RELEASED_CONTROL_BLOCKS if control_blocks else 0)
            rows[(name, task)].append({"psnr": psnr(image, exact), "ssim": ssim(image, exact), "seconds": seconds[0],
                                       "cpu": seconds[1],
                                       "control": step_cache.get("control"),
                                       "skipped": skipped_share, "blocks": done, "released": released,
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
                 "predicted_32": statistics.mean(r["released"] for r in results),
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


QUESTIONS = {"variants": run_variants, "step-cache": run_step_cache, "accuracy": run_accuracy, "cases": write_cases,
             "fp8-lora": run_fp8_lora, "fp8-width": run_fp8_width, "pad-crop": pad_crop.run}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in QUESTIONS:
        raise SystemExit(f"usage: quality.py {{{','.join(QUESTIONS)}}} [options]\n\n{__doc__}")
    return QUESTIONS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
