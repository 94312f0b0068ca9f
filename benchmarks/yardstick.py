"""The yardstick: the trained toy's pictures through every lossy option, against the exact path, in one run.

The same prompts, seeds and references (14 text-to-image prompts and 6 edits drawn from the toy's vocabulary,
40 Base steps, 256x256) run through the exact path (the committed weights in fp32, the prefix cache in fp32) and
through each option the pack offers that trades accuracy for memory or speed; each option's decoded RGBA images
are compared with the exact path's: PSNR and SSIM (mean and worst), and the share of images whose picture reads
the same (background, the shape's colour and position: demo/toy_eval.py `analyse`). The bf16 row (the whole DiT
computed in bf16) is the drift every bf16 user already accepts; an option far below it moves the picture.

A toy's numbers bound nothing about the real 7B model: its weights are small and its pictures flat shapes. They
rank the options and show which are near-lossless and which move the picture.

    python benchmarks/yardstick.py [--steps 40] [--only int8-cache,Q4_K] [--threads 2]
"""

import argparse
import contextlib
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from bench_gguf import comfy_tensors, write_gguf
from bench_quantized import quantized_file
from fp8_recipes import every_linear_fp8, scale_one
from qi21.demo.toy_data import random_edit, random_scene
from qi21.demo.toy_eval import ToyPipeline, analyse, psnr, ssim
from qi21.demo.toy_model import write_toy_checkpoints
from qi21.model.layers.fast_gemm import force_scaled_mm

T2I, EDITS = 14, 6


def cases(seed: int = 7) -> list[tuple[str, object, int]]:
    """(prompt, source scene or None, seed): not the training draws (another seed), the same every run."""
    rng = random.Random(seed)
    out = [(random_scene(rng).caption(0), None, 1000 + i) for i in range(T2I)]
    for i in range(EDITS):
        edit = random_edit(rng, ("recolour", "move", "background")[i % 3])
        out.append((edit.instruction, edit.source, 2000 + i))
    return out


def options(pipe: ToyPipeline, folder: Path) -> dict:
    """name -> (model, extra sample() options). Files are written from the committed toy as users get them."""
    exact = pipe.dit()
    tensors = comfy_tensors(exact)
    found = {"bf16 (whole DiT)": (lambda: pipe.dit(weight_dtype="bf16"), {}),
             "int8 cache": (lambda: exact, {"cache_dtype": "int8"}),
             "int4 cache": (lambda: exact, {"cache_dtype": "int4"})}
    for qtype in ("Q8_0", "Q4_K", "Q2_K"):
        path = folder / f"toy-{qtype}.gguf"
        found[f"GGUF {qtype}"] = (lambda path=path, q=qtype: pipe.load(write_gguf(path, tensors, q)), {})
    found["fp8 weights (loader fp8_e4m3fn)"] = (lambda: pipe.dit(weight_dtype="fp8_e4m3fn"), {})
    # fp8_e4m3fn_fast through torch._scaled_mm (forced: a CPU otherwise dequantizes, the next row), beside core's
    # scale-1 recipe (emulated) and the same with every Linear in fp8 (why the others stay bf16)
    plain = pipe.root / "diffusion_models" / pipe.dit_file
    found["fp8_e4m3fn_fast (_scaled_mm, per-row scales)"] = (lambda: pipe.dit(weight_dtype="fp8_e4m3fn_fast"),
                                                              {"context": force_scaled_mm})
    found["fp8_e4m3fn_fast weights computed in bf16"] = (lambda: pipe.dit(weight_dtype="fp8_e4m3fn_fast"), {})
    found["core's fp8_e4m3fn_fast (scale 1, emulated)"] = (lambda: scale_one(pipe.load(plain, "fp8_e4m3fn")), {})
    found["fp8_e4m3fn_fast, every Linear in fp8"] = (
        lambda: every_linear_fp8(pipe.load(plain, "fp8_e4m3fn_fast")), {"context": force_scaled_mm})
    for kind in ("int8_convrot", "fp8", "w4a8", "nvfp4", "mxfp8"):
        path = folder / f"toy_{kind}.safetensors"
        found[f"{kind} file"] = (lambda path=path, k=kind: pipe.load(quantized_file(tensors, k, path)), {})
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", default="", help="comma list of option names (substrings) to run")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_toy_checkpoints(root / "models")
        pipe = ToyPipeline(root / "models")
        runs = cases()
        references = {i: pipe.reference(source.render()) for i, (_, source, _) in enumerate(runs) if source}

        def images(model, extra):
            extra = dict(extra)
            out = []
            with extra.pop("context", contextlib.nullcontext)():  # a test seam the option runs under
                for i, (prompt, _, seed) in enumerate(runs):
                    refs = (references[i],) if i in references else ()
                    out.append(pipe.generate(prompt, seed, refs, steps=args.steps, model=model, **extra)[0][0])
            return out

        tick = time.perf_counter()
        exact = images(pipe.dit(), {})
        print(f"exact path: {len(runs)} images in {time.perf_counter() - tick:.1f} s ({args.steps} Base steps)")
        readings = [analyse(image) for image in exact]
        print("| option | PSNR mean (dB) | PSNR worst | SSIM mean | SSIM worst | reads the same |")
        print("|---|---|---|---|---|---|")
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        for name, (make, extra) in options(pipe, root).items():
            if wanted and not any(w in name for w in wanted):
                continue
            try:
                got = images(make(), extra)
            except Exception as error:  # an option this machine cannot run (a missing library) is reported
                print(f"| {name} | not run: {type(error).__name__}: {str(error)[:80]} | | | | |")
                continue
            p = [psnr(a, b) for a, b in zip(got, exact)]
            s = [ssim(a, b) for a, b in zip(got, exact)]
            same = sum(analyse(a).reading == r.reading for a, r in zip(got, readings))
            finite = [v for v in p if v != float("inf")] or [float("inf")]
            print(f"| {name} | {statistics.fmean(finite):.1f} | {min(p):.1f} | {statistics.fmean(s):.4f} | "
                  f"{min(s):.4f} | {same}/{len(runs)} |", flush=True)


if __name__ == "__main__":
    main()
