"""Quantized DiT benchmark (CPU): a cached step of int8 ConvRot, fp8, W4A8, NVFP4 and MXFP8 DiTs against the bf16 file,
in one run.

The scaled shape of bench_gguf.py / bench_dit.py (heads of 128, width 1024, SwiGLU x3, text width 1024, a 1024-token
target, `--references` references; only the block count is cut). One random model, rounded to bf16, is written as
users get it: `qwen_image_2.1_bf16.safetensors`, and ComfyUI quantized files made by comfy-kitchen's own quantizers
for the layers the released int8 file quantizes (each block's q, k, v, out, gate_up, down): int8 ConvRot (rotation
blocks of 256, per-row scales), fp8 e4m3fn (per-tensor scales), W4A8 (groups of 16), NVFP4 and MXFP8. All load as
the nodes load them on a CPU (fp32 compute) and run interleaved; medians printed, in wall and process CPU time.

On a CPU every quantized layer is dequantized right before a plain fp32 GEMM (layers/formats.py `gemm_mode`; int8
and W4A8 with the ConvRot rotation applied to the activations instead of the weight). `--kernels` adds the int8 and
W4A8 models through comfy-kitchen's int8 GEMMs (`torch._int_mm` on a CPU: ~42x the bf16 step, so minutes more).

    python benchmarks/bench_quantized.py [--layers 1] [--references 1] [--repeats 3] [--threads N] [--kernels]
"""

import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import bench_dit  # a sibling (this folder is on sys.path when run as a script); imports the pack as `qi21`
from bench_gguf import comfy_tensors, random_model, resident_bytes
from qi21.model.layers.kitchen import gemm_summary
from qi21.model.loaders.dit import load_dit
from qi21.model.transformer.prefix_cache import PrefixKVCache

BLOCK_LINEAR = re.compile(r"transformer_blocks\.\d+\.(attn\.to_[qkv]|attn\.to_out\.0|img_mlp\.gate_up|img_mlp\.out)"
                          r"\.weight")


def quantized_file(tensors: dict[str, torch.Tensor], kind: str, path: Path) -> Path:
    """`tensors` with the block linears quantized as `kind` ("int8_convrot", "fp8", "w4a8", "nvfp4", "mxfp8"), the
    rest bf16."""
    from comfy_kitchen.tensor import (
        AsymW4A8Int8Layout,
        TensorCoreFP8Layout,
        TensorCoreMXFP8Layout,
        TensorCoreNVFP4Layout,
        TensorWiseINT8Layout,
    )

    out = {}
    for key, value in tensors.items():
        if not BLOCK_LINEAR.fullmatch(key):
            out[key] = value.bfloat16()
            continue
        layer, w = key[: -len(".weight")], value.float()
        if kind == "int8_convrot":
            q, p = TensorWiseINT8Layout.quantize(w, is_weight=True, per_channel=True, convrot=True,
                                                 convrot_groupsize=256)
            roles = {"weight": q, "weight_scale": p.scale}
            description = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
        elif kind == "fp8":
            q, p = TensorCoreFP8Layout.quantize(w)
            roles, description = {"weight": q, "weight_scale": p.scale}, {"format": "float8_e4m3fn"}
        elif kind == "nvfp4":
            q, p = TensorCoreNVFP4Layout.quantize(w)
            roles = {"weight": q, "weight_scale": p.block_scale, "weight_scale_2": p.scale}
            description = {"format": "nvfp4"}
        elif kind == "mxfp8":
            q, p = TensorCoreMXFP8Layout.quantize(w)
            roles, description = {"weight": q, "weight_scale": p.scale.view(torch.uint8)}, {"format": "mxfp8"}
        else:
            q, p = AsymW4A8Int8Layout.quantize(w, group_size=16, convrot_groupsize=256)
            roles = {"weight": q, "weight_s_rel": p.scale, "weight_s_channel": p.s_channel}
            if p.codebook is not None:
                roles["weight_codebook"] = p.codebook
            description = {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256}
        out.update({f"{layer}.{role}": t.contiguous() for role, t in roles.items()})
        out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(description).encode()), dtype=torch.uint8)
    save_file(out, str(path))
    return path


def main():
    def add(parser):
        parser.add_argument("--references", type=int, default=1)
        parser.add_argument("--kernels", action="store_true", help="also run int8 / W4A8 through the int8 GEMMs")

    args = bench_dit.cpu_bench_args(__doc__, layers=1, repeats=3, add=add)

    tensors = comfy_tensors(random_model(args.layers))
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        files = {"bf16": folder / "qwen_image_2.1_bf16.safetensors"}
        save_file({k: v.bfloat16() for k, v in tensors.items()}, str(files["bf16"]))
        for kind in ("int8_convrot", "w4a8", "nvfp4", "mxfp8", "fp8"):
            files[kind] = quantized_file(tensors, kind, folder / f"qwen_image_2.1_{kind}.safetensors")
        models = {name: load_dit(file, weight_dtype="fp32") for name, file in files.items()}
        file_bytes = {name: file.stat().st_size for name, file in files.items()}
        for kind in ("int8_convrot", "w4a8") if args.kernels else ():
            name = f"{kind} (int8 kernels)"
            models[name] = load_dit(files[kind], weight_dtype="fp32", quantized_gemm="kernel")
            file_bytes[name] = file_bytes[kind]

    prefix, target, _, _ = bench_dit.build_inputs(args.references)
    t = torch.tensor([0.8])
    steps, outputs = {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            cache = PrefixKVCache()
            model(target, 0.9, [prefix], cache=cache, mode="prefill")
            steps[name] = lambda model=model, cache=cache: model(target, t, [prefix], cache=cache, mode="cached")
            outputs[name] = steps[name]().float()  # also the warm-up
        times = {name: [] for name in models}
        cpu = {name: [] for name in models}
        for _ in range(args.repeats):  # interleaved, so drift hits all alike
            for name, step in steps.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                step()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)

    med = {name: statistics.median(values) for name, values in times.items()}
    med_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, fp32 compute, {args.layers} layers, "
          f"width 1024, target {target.shape[1]} tokens, prefix {prefix.layout.prefix_len} tokens, median of "
          f"{args.repeats}, interleaved")
    print("model | GEMM | cached step ms (wall) | / bf16 | CPU ms | / bf16 | resident weight MiB | file MiB | "
          "rel. diff of the velocity vs bf16")
    reference = outputs["bf16"]
    for name in models:
        diff = (outputs[name] - reference).norm() / reference.norm()
        gemm = ", ".join(f"{fmt} {mode}" for fmt, mode in gemm_summary(models[name], "cpu").items()) or "-"
        print(f"{name} | {gemm} | {1000 * med[name]:.1f} | {med[name] / med['bf16']:.3f} | "
              f"{1000 * med_cpu[name]:.1f} | "
              f"{med_cpu[name] / med_cpu['bf16']:.3f} | {resident_bytes(models[name]) / 2**20:.1f} | "
              f"{file_bytes[name] / 2**20:.1f} | {diff:.4f}")


if __name__ == "__main__":
    main()
