"""The velocity at the released width with fp8 compute: random weights, width 4096 (32 heads of 128, MLP 12288),
a few blocks, a short sequence, each recipe's velocity against the fp32 one, beside bf16's own drift.

Rows: bf16 (the whole DiT in bf16), fp8_e4m3fn_fast through `torch._scaled_mm` (forced on a CPU), the same weights
computed in bf16 (what a CPU or a GPU before Ada runs), the loader's fp8_e4m3fn (weights cast with scale 1, bf16
compute) and core's scale-1 fp8 GEMM (emulated: benchmarks/fp8_recipes.py). Random weights have no outlier channels:
real activations have, which is where the scale-1 recipe loses most; this bounds the per-row recipe's own rounding.

    python benchmarks/fp8_width.py [--blocks 2] [--text 32] [--grid 16] [--threads 2]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from fp8_recipes import scale_one
from qi21.demo import tiny_checkpoints as tiny
from qi21.model.layers.fast_gemm import force_scaled_mm
from qi21.model.loaders.dit import load_dit
from qi21.model.transformer.dit import DiTConfig, PrefixInputs
from qi21.model.transformer.layout import build_layout


def inputs(config: DiTConfig, text: int, grid: int, seed: int = 1):
    """One prompt of `text` tokens (no reference) and a `grid` x `grid` target: the DiT's inputs."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.zeros(text, dtype=torch.bool)
    prefixes = [PrefixInputs(layout=build_layout(slots, (), (grid, grid)),
                             text=torch.randn(text, config.context_in_dim, generator=g), references=None)]
    target = torch.randn(1, grid * grid, config.in_channels, generator=g)
    return target, prefixes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--text", type=int, default=32)
    parser.add_argument("--grid", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = DiTConfig(num_layers=args.blocks)
    target, prefixes = inputs(config, args.text, args.grid)
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


if __name__ == "__main__":
    main()
