"""A LoRA on an `fp8_e4m3fn_fast` base, on the trained toy: its branch beside the fp8 GEMM (what the pack does) or
merged into the weights before they are quantized, each against the exact path (fp32 weights, the LoRA's branch).

The LoRA is the toy's Turbo minus its Base (ComfyUI's extraction, `--rank`), applied to the Base at `--strength`: a
LoRA that moves every block linear, as the Turbo extracts users run do. The pictures are the yardstick's first
`--count` cases (benchmarks/quality.py variants), 40 Base steps, 256x256; `_scaled_mm` forced (a CPU would dequantize).

    python benchmarks/fp8_lora.py [--rank 16] [--strength 1.0] [--count 6] [--threads 2]
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from fp8_recipes import merged_lora_fp8
from qi21.demo.tiny_checkpoints import extracted_lora_state_dict
from qi21.demo.toy_eval import ToyPipeline, psnr, ssim
from qi21.demo.toy_model import TOY_DIR, write_toy_checkpoints
from qi21.model.layers.fast_gemm import force_scaled_mm
from qi21.model.loaders.lora import apply_lora
from quality import cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--strength", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_toy_checkpoints(root / "models")
        pipe = ToyPipeline(root / "models")
        lora = root / "turbo_lora.safetensors"
        save_file(extracted_lora_state_dict(load_file(str(TOY_DIR / "transformer_base.safetensors")),
                                            load_file(str(TOY_DIR / "transformer_turbo.safetensors")), args.rank),
                  str(lora))
        runs = cases()[: args.count]
        references = {i: pipe.reference(source.render()) for i, (_, source, _) in enumerate(runs) if source}

        def images(model):
            out = []
            for i, (prompt, _, seed) in enumerate(runs):
                refs = (references[i],) if i in references else ()
                out.append(pipe.generate(prompt, seed, refs, steps=args.steps, model=model)[0][0])
            return out

        exact = images(apply_lora(pipe.dit(), lora, args.strength))
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
                got = images(make())
            p = [psnr(a, b) for a, b in zip(got, exact)]
            s = [ssim(a, b) for a, b in zip(got, exact)]
            print(f"| {name} | {statistics.fmean(p):.1f} | {min(p):.1f} | {statistics.fmean(s):.4f} |", flush=True)


if __name__ == "__main__":
    main()
