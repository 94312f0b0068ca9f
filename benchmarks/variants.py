"""A variant's cached step against the plain one, on speed.py's scaled shape (heads of 128, width 1024, SwiGLU x3,
~75 text tokens, a 1024-token target, 1024-token references; only the block count is cut), in one run each. One
question a variant: the plain model and the variant interleaved, medians, ratios printed.

    python benchmarks/variants.py lora [--layers 2] [--ranks 16 64] ... a LoRA applied as low-rank branches
    python benchmarks/variants.py gguf [--layers 2] [--references 1] ...  GGUF Q8_0 / Q4_K DiT files
    python benchmarks/variants.py quantized [--layers 1] ...              int8 ConvRot, fp8, W4A8, NVFP4, MXFP8 files
    python benchmarks/variants.py cache-quant [--layers 4] ...            the int8 / int4 prefix cache
    python benchmarks/variants.py compiled [--layers 2] ...               compiled blocks (the loader's `compile`)
    python benchmarks/variants.py controlnet [--layers 2] ...             a Fun ControlNet with the prefix cache

`python benchmarks/variants.py QUESTION --help` says what each prints (each question's text below). The files the
variants are written as (`comfy_tensors`, `write_gguf`, `quantized_file`, `write_lora`) are shared with
benchmarks/quality.py and benchmarks/parts/gpu_check_formats.py.
"""

import json
import os
import re
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from qi21.model.features.control import apply_controlnet
from qi21.model.features.lora import apply_lora
from qi21.model.layers.gguf import GGUFLinear
from qi21.model.layers.kitchen import gemm_summary
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.dit_keys import file_plan
from qi21.model.loaders.lora import clone_tree
from qi21.model.memory.planner import RunShape, run_estimate
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.prefix_cache.storage_formats import cache_storage
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import base_sigmas
from qi21.model.transformer.compiled import compile_blocks
from qi21.model.transformer.controlnet import ControlNetConfig, FunControlNet
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT
from speed import TARGET, build_inputs, build_models, cpu_bench_args, flops

# -- lora --------------------------------------------------------------------------------------------------------------
LORA_HELP = """\
What a LoRA branch costs: one DiT step with a LoRA applied vs the same model without it, in one run.

The scaled shape of speed.py (heads of 128, width 1024, SwiGLU x3, ~75 text tokens, a 1024-token target,
one reference of 1024 tokens; only the layer count is cut). The LoRA targets what LoRAs usually train: every
block's to_q, to_k, to_v, to_out.0, img_mlp.gate_layer, img_mlp.proj and img_mlp.out (kohya keys with alpha),
applied with model/loaders/lora.py as low-rank branches next to the frozen weights (no merge, no weight copy). Prefill
and cached step are timed interleaved (plain, LoRA, plain, ...); per rank it prints the ratio of the median
wall-clock times, of the median process CPU times (with `--threads 1` the CPU time is the work done, whatever
else the machine runs) and of the FLOPs. `--full-patches` adds what ComfyUI-extracted Turbo LoRAs hold besides
the pairs: `.diff` patches of every norm scale and of img_in, proj_out and the timestep embedder's linear_1 (dense
delta branches and patched norm copies, model/loaders/lora_patches.py).

    python benchmarks/variants.py lora [--layers 2] [--ranks 16 64] [--repeats 7] [--threads N] [--full-patches]
"""

MODULES = ("attn_to_q", "attn_to_k", "attn_to_v", "attn_to_out_0", "img_mlp_gate_layer", "img_mlp_proj",
           "img_mlp_out")


def build_model(layers: int) -> QwenImage21DiT:
    torch.manual_seed(0)
    model = QwenImage21DiT(DiTConfig(num_layers=layers, num_heads=8, head_dim=128, context_in_dim=1024, mlp_ratio=3))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model.eval()


def write_lora(path: Path, config: DiTConfig, rank: int, full_patches: bool = False) -> Path:
    width, hidden = config.width, config.mlp_hidden
    shapes = dict(zip(MODULES, [(width, width)] * 4 + [(width, hidden)] * 2 + [(hidden, width)]))
    tensors = {}
    for i in range(config.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            stem = f"lora_unet_transformer_blocks_{i}_{module}"
            tensors[stem + ".lora_down.weight"] = torch.randn(rank, fan_in) / fan_in**0.5
            tensors[stem + ".lora_up.weight"] = 0.01 * torch.randn(fan_out, rank)
            tensors[stem + ".alpha"] = torch.tensor(float(rank))
    if full_patches:
        shapes = {"img_in": (width, config.in_channels), "proj_out": (config.out_channels, width),
                  "time_text_embed.timestep_embedder.linear_1": (width, 256),
                  "txt_in.text_norm": (config.context_in_dim,),
                  **{f"transformer_blocks.{i}.attn.norm_{x}": (config.head_dim,) for i in range(config.num_layers)
                     for x in "qk"}}
        for module, shape in shapes.items():
            tensors[f"diffusion_model.{module}.diff"] = 0.01 * torch.randn(shape)
    save_file(tensors, str(path))
    return path


def run_lora():
    def add(parser):
        parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
        parser.add_argument("--full-patches", action="store_true")

    args = cpu_bench_args(LORA_HELP, layers=2, repeats=7, add=add)
    plain = build_model(args.layers)
    prefix, target, _, _ = build_inputs(1)
    t = torch.tensor([0.8])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, {args.layers} layers, width 1024, "
          f"heads 8x128, target {target.shape[1]} tokens, prefix {prefix.layout.prefix_len} tokens (1 reference), "
          f"median of {args.repeats}")
    print("rank | prefill LoRA/plain: wall, CPU time | cached step LoRA/plain: wall, CPU time | FLOP ratio "
          "(prefill, cached)")
    with tempfile.TemporaryDirectory() as folder:
        for rank in args.ranks:
            path = write_lora(Path(folder) / f"r{rank}.safetensors", plain.config, rank, args.full_patches)
            with_lora = apply_lora(plain, path, 1.0)
            calls = {}
            with torch.inference_mode():
                for name, model in (("plain", plain), ("lora", with_lora)):
                    cache = PrefixKVCache()
                    calls[name, "prefill"] = partial(model, target, t, [prefix], cache=cache, mode="prefill")
                    calls[name, "prefill"]()  # warm-up, and fills the cache the cached step reads
                    calls[name, "cached"] = partial(model, target, t, [prefix], cache=cache, mode="cached")
                    calls[name, "cached"]()
                times = {key: [] for key in calls}
                cpu_times = {key: [] for key in calls}
                for _ in range(args.repeats):  # interleaved, so drift hits both alike
                    for key, fn in calls.items():
                        start, cpu_start = time.perf_counter(), time.process_time()
                        fn()
                        times[key].append(time.perf_counter() - start)
                        cpu_times[key].append(time.process_time() - cpu_start)
                med = {key: statistics.median(values) for key, values in times.items()}
                cpu = {key: statistics.median(values) for key, values in cpu_times.items()}
                flop_ratio = {step: flops(calls["lora", step]) / flops(calls["plain", step])
                              for step in ("prefill", "cached")}
            cells = []
            for step in ("prefill", "cached"):
                cells.append(f"{med['lora', step] / med['plain', step]:.3f} ({med['lora', step] * 1e3:.0f} vs "
                             f"{med['plain', step] * 1e3:.0f} ms), {cpu['lora', step] / cpu['plain', step]:.3f}")
            print(f"{rank} | {cells[0]} | {cells[1]} | {flop_ratio['prefill']:.3f}, {flop_ratio['cached']:.3f}")


# -- gguf --------------------------------------------------------------------------------------------------------------
GGUF_HELP = """\
GGUF DiT benchmark: a cached step of a Q8_0 and a Q4_K DiT against the bf16 file, in one run, ratios printed.

The scaled shape of speed.py (heads of 128, width 1024, SwiGLU x3, text width 1024, ~75 text tokens, a
1024-token target, `--references` references of 1024 tokens; only the block count is cut). One random model,
rounded to bf16, is written three ways, as users get it:
- `qwen_image_2.1_bf16.safetensors` (ComfyUI layout), loaded as the nodes load it on a CPU (fp32 compute: bf16 is
  converted once at load);
- `qwen_image_2.1-Q8_0.gguf`, quantized by the gguf package's own Q8_0 quantizer;
- `qwen_image_2.1-Q4_K.gguf`, quantized by the small Q4_K quantizer below (the gguf package only dequantizes
  K-quants; this one is plain min/max per 32-element sub-block, not llama.cpp's search, so its error is an upper
  bound of a real Q4_K file's).
As in real converters, 1-D tensors are F32 and `img_in` (64 inputs: no whole 256-element block) stays BF16 in
Q4_K. The GGUF DiTs keep their blocks resident and dequantize each layer right before its matmul, in the same
compute dtype. Each cached step follows one prefill; the three models are timed interleaved, medians printed, in
wall time and in process CPU time (steadier on a shared machine: time spent waiting for a core is not counted).

    python benchmarks/variants.py gguf [--layers 2] [--references 1] [--repeats 7] [--threads N] [--dtype fp32]
"""

def random_model(layers: int) -> QwenImage21DiT:
    torch.manual_seed(0)
    config = DiTConfig(num_layers=layers, num_heads=8, head_dim=128, context_in_dim=1024, mlp_ratio=3)
    model = QwenImage21DiT(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_(0.1 * torch.randn_like(param) + (0.0 if "text_norm" in name else 1.0))
            else:
                param.normal_(0, 0.02)
            param.copy_(param.bfloat16().float())  # the release is bf16
    return model.eval()


def comfy_tensors(model: QwenImage21DiT) -> dict[str, torch.Tensor]:
    """ComfyUI's single-file keys: q/k/v split, [gate; up] fused."""
    state = model.state_dict()
    return {key: part.contiguous() for name, keys in file_plan(model.config, fused_mlp=True).items()
            for key, part in zip(keys, state[name].chunk(len(keys)))}


def _min_max_sub_blocks(sub: np.ndarray, levels: int, scale_levels: int):
    """Plain min/max k-quant of sub-blocks `(blocks, n, size)`: each sub-block's step and minimum as integer
    multiples (0..`scale_levels`) of the block's fp16 `d` and `dmin`, its values as codes 0..`levels`.
    Returns d, dmin (fp16, per block), sc, mn (uint8, per sub-block) and q (uint8 codes)."""
    low = np.minimum(sub.min(-1), 0)
    step = (sub.max(-1) - low) / levels
    d = (step.max(-1) / scale_levels).astype(np.float16)
    dmin = (-low.min(-1) / scale_levels).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(step / d32), 0, scale_levels), 0).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.clip(np.rint(-low / dmin32), 0, scale_levels), 0).astype(np.uint8)
        scale, offset = (d32 * sc)[..., None], (dmin32 * mn)[..., None]
        q = np.where(scale > 0, np.clip(np.rint((sub + offset) / scale), 0, levels), 0).astype(np.uint8)
    return d, dmin, sc, mn, q


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """`(rows, cols)` fp32, cols a multiple of 256 -> Q4_K blocks `(rows, cols / 256 * 144)` uint8: per 32-element
    sub-block a 6-bit scale and min (of the block's fp16 d and dmin), 4-bit quants (llama.cpp's block layout)."""
    rows = x.shape[0]
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _min_max_sub_blocks(sub, 15, 63)
    scales = np.empty((sub.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c (low nibbles) and 2c + 1 (high)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], 1)
    return blocks.reshape(rows, -1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """`(rows, cols)` fp32, cols a multiple of 256 -> Q2_K blocks `(rows, cols / 256 * 84)` uint8 (llama.cpp's
    layout: 16 bytes of 4-bit scale | 4-bit min per 16-element sub-block, 64 bytes of 2-bit quants, fp16 d and
    dmin). Plain min/max per sub-block, not llama.cpp's search: an upper bound of a real Q2_K file's error.
    Sub-block k holds elements 16k..16k+15; element l of it sits in byte 32 (k // 8) + 16 (k % 2) + l of the
    quants, at bit 2 ((k % 8) // 2), as llama.cpp's dequantizer reads them."""
    rows = x.shape[0]
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    d, dmin, sc, mn, q = _min_max_sub_blocks(sub, 3, 15)
    qs = np.zeros((sub.shape[0], 64), np.uint8)
    for k in range(16):
        at = 32 * (k // 8) + 16 * (k % 2)
        qs[:, at : at + 16] |= q[:, k] << (2 * ((k % 8) // 2))
    blocks = np.concatenate([sc | (mn << 4), qs, d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)],
                            1)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, tensors: dict[str, torch.Tensor], qtype: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, arch="qwen_image")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, tensor in tensors.items():
        array = tensor.float().numpy()
        if array.ndim == 1:
            data, kind = array, gguf.GGMLQuantizationType.F32
        elif qtype == "Q4_K" and array.shape[1] % 256 == 0:
            data, kind = quantize_q4_k(array), gguf.GGMLQuantizationType.Q4_K
        elif qtype == "Q2_K" and array.shape[1] % 256 == 0:
            data, kind = quantize_q2_k(array), gguf.GGMLQuantizationType.Q2_K
        elif qtype == "Q8_0" and array.shape[1] % 32 == 0:
            kind = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(array, kind)
        else:
            kind = gguf.GGMLQuantizationType.BF16
            data = gguf.quants.quantize(array, kind)
        writer.add_tensor(key, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def resident_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def dequant_seconds(model, dtype, repeats: int) -> float:
    """Median time to dequantize every GGUF layer once (what a step adds to the GEMMs)."""
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in layers:
            layer.weight_rows(0, layer.out_features, dtype)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_gguf():
    def add(parser):
        parser.add_argument("--references", type=int, default=1)
        parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype of all three")

    args = cpu_bench_args(GGUF_HELP, layers=2, repeats=7, add=add)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    source = random_model(args.layers)
    tensors = comfy_tensors(source)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        save_file({k: v.bfloat16() for k, v in tensors.items()}, folder / "qwen_image_2.1_bf16.safetensors")
        write_gguf(folder / "qwen_image_2.1-Q8_0.gguf", tensors, "Q8_0")
        write_gguf(folder / "qwen_image_2.1-Q4_K.gguf", tensors, "Q4_K")
        models = {name: load_dit(folder / file, weight_dtype=args.dtype) for name, file in (
            ("bf16", "qwen_image_2.1_bf16.safetensors"), ("Q8_0", "qwen_image_2.1-Q8_0.gguf"),
            ("Q4_K", "qwen_image_2.1-Q4_K.gguf"))}
        file_bytes = {name: (folder / model.source.path.name).stat().st_size for name, model in models.items()}
    del source

    prefix, target, _, _ = build_inputs(args.references)
    target = target.to(dtype)
    t = torch.tensor([0.8])
    caches, steps, outputs = {}, {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = PrefixKVCache()
            model(target, 0.9, [prefix], cache=caches[name], mode="prefill")
            steps[name] = lambda model=model, cache=caches[name]: model(target, t, [prefix], cache=cache, mode="cached")
            outputs[name] = steps[name]().float()  # also the warm-up
        times = {name: [] for name in models}
        cpu = {name: [] for name in models}
        for _ in range(args.repeats):  # interleaved, so drift hits all three alike
            for name, step in steps.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                step()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
        dequant = {name: dequant_seconds(models[name], dtype, args.repeats) for name in ("Q8_0", "Q4_K")}

    med = {name: statistics.median(values) for name, values in times.items()}
    med_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, {args.dtype} compute, {args.layers} "
          f"layers, width 1024, heads 8x128, target {target.shape[1]} tokens, prefix {prefix.layout.prefix_len} "
          f"tokens ({args.references} references), median of {args.repeats}, interleaved")
    print("model | cached step ms (wall) | / bf16 | CPU ms (process time) | / bf16 | dequant all layers ms | "
          "resident weight MiB | file MiB | rel. diff of the velocity vs bf16")
    reference = outputs["bf16"]
    for name in models:
        diff = (outputs[name] - reference).norm() / reference.norm()
        deq = f"{1000 * dequant[name]:.1f}" if name in dequant else "-"
        print(f"{name} | {1000 * med[name]:.1f} | {med[name] / med['bf16']:.3f} | {1000 * med_cpu[name]:.1f} | "
              f"{med_cpu[name] / med_cpu['bf16']:.3f} | {deq} | {resident_bytes(models[name]) / 2**20:.1f} | "
              f"{file_bytes[name] / 2**20:.1f} | {diff:.4f}")


# -- quantized ---------------------------------------------------------------------------------------------------------
QUANTIZED_HELP = """\
Quantized DiT benchmark (CPU): a cached step of int8 ConvRot, fp8, W4A8, NVFP4 and MXFP8 DiTs against the bf16 file,
in one run.

The scaled shape of speed.py's questions (heads of 128, width 1024, SwiGLU x3, text width 1024, a 1024-token
target, `--references` references; only the block count is cut). One random model, rounded to bf16, is written as
users get it: `qwen_image_2.1_bf16.safetensors`, and ComfyUI quantized files made by comfy-kitchen's own quantizers
for the layers the released int8 file quantizes (each block's q, k, v, out, gate_up, down): int8 ConvRot (rotation
blocks of 256, per-row scales), fp8 e4m3fn (per-tensor scales), W4A8 (groups of 16), NVFP4 and MXFP8. All load as
the nodes load them on a CPU (fp32 compute) and run interleaved; medians printed, in wall and process CPU time.

On a CPU every quantized layer is dequantized right before a plain fp32 GEMM (layers/format_table.py `gemm_mode`; int8
and W4A8 with the ConvRot rotation applied to the activations instead of the weight). `--kernels` adds the int8 and
W4A8 models through comfy-kitchen's int8 GEMMs (`torch._int_mm` on a CPU: ~42x the bf16 step, so minutes more).

    python benchmarks/variants.py quantized [--layers 1] [--references 1] [--repeats 3] [--threads N] [--kernels]
"""

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


def run_quantized():
    def add(parser):
        parser.add_argument("--references", type=int, default=1)
        parser.add_argument("--kernels", action="store_true", help="also run int8 / W4A8 through the int8 GEMMs")

    args = cpu_bench_args(QUANTIZED_HELP, layers=1, repeats=3, add=add)

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

    prefix, target, _, _ = build_inputs(args.references)
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


# -- cache-quant -------------------------------------------------------------------------------------------------------
CACHE_QUANT_HELP = """\
The int8 / int4 prefix cache (model/prefix_cache/storage_formats.py): bytes, error and CPU speed, in one run.

1. Bytes, scales included, against the bf16 cache: the planner's figure for the full model (32 layers, 32 heads of
   128) at 1024x1024, t2i (75 tokens) and a 3-reference edit (3 x 4096 + 75 tokens); and the bytes a real cache
   allocates for the same prefixes on the scaled model (8 heads of 128: rows of 1024 values).
2. Error on the scaled CPU model (speed.py's scaled shape: width 1024, heads of 128, SwiGLU x3, a 512x512 target, one
   512x512 reference, 75 text tokens; weights drawn as speed.py bf16-drift draws them, norm scales around 1 and matrices
   N(0, 1/fan_in)): one cached velocity and a whole 40-step Base loop with an int8 / int4 cache against the model-dtype
   cache (bf16, and fp32 to isolate the quantization), each next to the bf16-vs-fp32 drift of the same velocity /
   loop (relative L2).
3. CPU speed of a cached step with an int8 / int4 cache against the plain one (the dequantization per layer),
   interleaved medians, fp32 and bf16 models, two references.

    python benchmarks/variants.py cache-quant [--layers 4] [--repeats 5] [--threads N] [--steps 40]
"""

DTYPES = ("default", "int8", "int4")
CACHE_SIZE = 512  # the target (speed.TARGET: 32 x 32 latent tokens)


def relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def planner_bytes():
    print("\n## bytes, scales included (ratio to the bf16 cache)")
    print("| prefix | source | bf16 | int8 | int4 |")
    print("|---|---|---|---|---|")
    full = DiTConfig()
    scaled = DiTConfig(num_layers=4, num_heads=8, head_dim=128, context_in_dim=1024, mlp_ratio=3)
    for label, references in (("t2i, 75 tokens", 0), ("edit, 3 refs of 1024x1024, 12,363 tokens", 3)):
        shape = RunShape.released(1024, references)
        planned = [run_estimate(full, RunShape(**{**vars(shape), "cache_dtype": d}), 2).cache for d in DTYPES]
        measured = []
        for dtype in DTYPES:
            cache = PrefixKVCache()
            cache.storage = cache_storage(dtype)
            cache.allocate(shape.prefix_tokens, scaled.num_layers, scaled.num_heads, scaled.head_dim, torch.bfloat16,
                           "cpu")
            measured.append(cache.nbytes)
            cache.free()
        sources = (("planner, full model", planned), ("allocated, scaled model (4 layers, width 1024)", measured))
        for source, row in sources:
            cells = [f"{row[0]:,}"] + [f"{b:,} ({b / row[0]:.4f}x)" for b in row[1:]]
            print(f"| {label} | {source} | " + " | ".join(cells) + " |")


def scaled_models(layers: int) -> tuple[QwenImage21DiT, QwenImage21DiT]:
    """(fp32, bf16) scaled models with the same weights."""
    torch.manual_seed(0)
    config = DiTConfig(num_layers=layers, num_heads=8, head_dim=128, context_in_dim=1024, mlp_ratio=3)
    fp32 = QwenImage21DiT(config)
    with torch.no_grad():
        for param in fp32.parameters():
            if param.ndim == 1:
                param.copy_(0.1 * torch.randn_like(param) + 1.0)
            else:
                param.normal_(0, param.shape[1] ** -0.5)
    bf16 = QwenImage21DiT(config, dtype=torch.bfloat16)
    bf16.load_state_dict(fp32.state_dict())
    return fp32.eval(), bf16.eval()


def velocity(model, prefix, target, dtype: str):
    """One cached step's velocity at t = 0.5 after a prefill at t = 1 (the same target rows)."""
    cache = PrefixKVCache()
    cache.storage = cache_storage(dtype)
    x = target.to(model.compute_dtype)
    model(x, torch.tensor([1.0]), [prefix], cache=cache, mode="prefill")
    out = model(x, torch.tensor([0.5]), [prefix], cache=cache, mode="cached")
    cache.free()
    return out


def errors(layers: int, steps: int):
    fp32, bf16 = scaled_models(layers)
    torch.manual_seed(1)
    prefix, target, _, cond = build_inputs(1)
    print(f"\n## error (relative L2), scaled model: {layers} layers, prefix {prefix.layout.prefix_len} tokens, "
          f"target {target.shape[1]} tokens, {steps}-step Base loop")
    sigmas, noise = base_sigmas(steps, CACHE_SIZE, CACHE_SIZE), initial_noise(3, 1, CACHE_SIZE, CACHE_SIZE)

    def loop(model, dtype):
        return sample(model, cond, sigmas=sigmas, width=CACHE_SIZE, height=CACHE_SIZE, noise=noise, cache_dtype=dtype)

    with torch.inference_mode():
        v32 = {d: velocity(fp32, prefix, target, d) for d in DTYPES}
        v = {d: velocity(bf16, prefix, target, d) for d in DTYPES}
        runs32 = {d: loop(fp32, d) for d in DTYPES}
        runs = {d: loop(bf16, d) for d in DTYPES}
    drift_v, drift_l = relative(v["default"], v32["default"]), relative(runs["default"].latents,
                                                                      runs32["default"].latents)
    print(f"| cache | one cached velocity vs the model-dtype cache | (÷ bf16-vs-fp32 drift) | {steps}-step latents "
          "vs the model-dtype cache | (÷ drift) | cache bytes (report) |")
    print("|---|---|---|---|---|---|")
    print(f"| bf16 model vs fp32 model, default caches (the drift) | {drift_v:.2e} | 1 | {drift_l:.2e} | 1 | "
          f"{runs['default'].report['cache_bytes']:,} |")
    # in the bf16 model a quantized cache's difference includes bf16 rounding along another code path; the fp32
    # model's rows isolate what the quantization itself changes
    for model_dtype, vs, loops in (("bf16", v, runs), ("fp32", v32, runs32)):
        for d in DTYPES[1:]:
            ev, el = relative(vs[d], vs["default"]), relative(loops[d].latents, loops["default"].latents)
            held, plain = loops[d].report["cache_bytes"], loops["default"].report["cache_bytes"]
            print(f"| {d} ({model_dtype} model, vs its {model_dtype} cache) | {ev:.2e} | {ev / drift_v:.2f} | "
                  f"{el:.2e} | {el / drift_l:.2f} | {held:,} ({held / plain:.4f}x) |")
    return fp32, bf16


def cache_speed(models, repeats: int):
    torch.manual_seed(2)
    prefix, target, _, _ = build_inputs(2)
    print(f"\n## CPU speed of a cached step (prefix {prefix.layout.prefix_len} tokens, target {target.shape[1]}; "
          f"{torch.get_num_threads()} threads, interleaved medians of {repeats})")
    print("| model | default | int8 | int4 | int8 / default | int4 / default |")
    print("|---|---|---|---|---|---|")
    for model in models:
        caches, calls = {}, {}
        x = target.to(model.compute_dtype)
        with torch.inference_mode():
            for dtype in DTYPES:
                cache = PrefixKVCache()
                cache.storage = cache_storage(dtype)
                model(x, torch.tensor([1.0]), [prefix], cache=cache, mode="prefill")
                caches[dtype] = cache
                calls[dtype] = (lambda c=cache, m=model, x=x: m(x, torch.tensor([0.5]), [prefix], cache=c,
                                                               mode="cached"))
            times = {d: [] for d in DTYPES}
            for call in calls.values():
                call()  # warm-up
            for _ in range(repeats):
                for dtype, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[dtype].append(time.perf_counter() - start)
        m = {d: statistics.median(t) for d, t in times.items()}
        print(f"| {str(model.compute_dtype).removeprefix('torch.')} | {m['default']:.3f} s | {m['int8']:.3f} s | "
              f"{m['int4']:.3f} s | {m['int8'] / m['default']:.3f}x | {m['int4'] / m['default']:.3f}x |")
        for cache in caches.values():
            cache.free()


def run_cache_quant():
    args = cpu_bench_args(CACHE_QUANT_HELP, layers=4, repeats=5,
                          add=lambda p: p.add_argument("--steps", type=int, default=40))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    planner_bytes()
    models = errors(args.layers, args.steps)
    cache_speed(models, args.repeats)


# -- compiled ----------------------------------------------------------------------------------------------------------
COMPILED_HELP = """\
Compiled blocks (the loader's `compile` option, model/transformer/compiled.py) on this machine: the cached step
compiled against eager, what the first compiled calls cost cold and warm, and what compiling changes numerically.

speed.py's scaled shape (heads of 128, width 1024 = 8 heads, SwiGLU x3, 75 text tokens, one 512x512 reference, a
512x512 target), `--layers` blocks, inductor. It prints:
- the median cached step eager and compiled (fp32, calls interleaved) and their ratio;
- the first compiled calls: the cached step's (one graph) and the prefill's (two: its blocks and its last block),
  cold (inductor's caches in a fresh folder: what the first run after an install pays) and warm (dynamo reset in the
  same process, inductor's caches filled: about what a restarted ComfyUI pays);
- the cached velocity compiled vs eager in fp32 and in bf16, next to bf16 eager vs fp32 eager (bf16's own drift) and
  bf16 compiled vs fp32 eager, as max abs and relative L2 differences.

    python benchmarks/variants.py compiled [--layers 2] [--repeats 5] [--threads N] [--device cpu|cuda]
"""

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


class Run:
    """One model's prefill and cached step on the benchmark's inputs, with a cache of its own."""

    def __init__(self, model, prefix, target, device):
        self.model, self.prefix, self.target, self.device = model, prefix, target, device
        self.t = torch.tensor([0.8], device=device)
        self.cache = PrefixKVCache()

    def prefill(self):
        self.cache = PrefixKVCache()
        return self.model(self.target, self.t, [self.prefix], cache=self.cache, mode="prefill")

    def step(self):
        return self.model(self.target, self.t / 2, [self.prefix], cache=self.cache, mode="cached")


def in_dtype(model: QwenImage21DiT, dtype: torch.dtype, device) -> QwenImage21DiT:
    """The same weights as a model computing in `dtype` (rounded once)."""
    copy = QwenImage21DiT(model.config, device=device, dtype=dtype)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def first_calls(model, prefix, target, device) -> tuple[float, float]:
    """(seconds of the first compiled cached step, of the first compiled prefill) on a compiled copy of `model`."""
    compiled = clone_tree(model)
    compile_blocks(compiled, "blocks")
    run = Run(compiled, prefix, target, device)
    run.prefill()  # each block's first call runs eagerly (compiled.py)
    cached = seconds(run.step, device)
    prefill = seconds(run.prefill, device)
    return cached, prefill


def diff(got: torch.Tensor, expected: torch.Tensor) -> str:
    got, expected = got.float(), expected.float()
    relative = ((got - expected).norm() / expected.norm()).item()
    return f"max abs {(got - expected).abs().max().item():.2e}, rel L2 {relative:.2e}"


def run_compiled() -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    args = cpu_bench_args(COMPILED_HELP, layers=2, repeats=5,
                          add=lambda parser: parser.add_argument("--device", default=default_device))
    device = torch.device(args.device)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="qi21_inductor_")  # cold: nothing compiled yet
    _, base, _ = build_models(args.layers)
    base = base.to(device)
    prefix, target, _, _ = build_inputs(1)
    prefix = type(prefix)(layout=prefix.layout, text=prefix.text.to(device), references=prefix.references.to(device))
    target = target.to(device)
    print(f"# variants.py compiled: {args.layers} blocks of width 1024, 1 reference, 512x512, {device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")

    with torch.no_grad():
        cold = first_calls(base, prefix, target, device)
        torch._dynamo.reset()
        warm = first_calls(base, prefix, target, device)
        for name, (cached, prefill) in (("cold (empty inductor cache)", cold), ("warm (caches filled)", warm)):
            print(f"first compiled call, {name}: cached step {cached:.1f} s, prefill {prefill:.1f} s")

        eager, compiled = Run(base, prefix, target, device), Run(clone_tree(base), prefix, target, device)
        compile_blocks(compiled.model, "blocks")
        for run in (eager, compiled):
            run.prefill()
            run.prefill()  # the compiled model's second prefill is compiled; its steps are measured below
            run.step()
        times = {"eager": [], "compiled": []}
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            times["eager"].append(seconds(eager.step, device))
            times["compiled"].append(seconds(compiled.step, device))
        eager_ms, compiled_ms = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
        print(f"cached step, fp32: eager {eager_ms:.1f} ms, compiled {compiled_ms:.1f} ms, "
              f"compiled / eager {compiled_ms / eager_ms:.3f}")

        reference = eager.step()
        print(f"fp32 compiled vs eager: {diff(compiled.step(), reference)}")
        low = in_dtype(base, torch.bfloat16, device)
        low_eager, low_compiled = Run(low, prefix, target, device), Run(clone_tree(low), prefix, target, device)
        compile_blocks(low_compiled.model, "blocks")
        for run in (low_eager, low_compiled):
            run.prefill()
        bf16_eager = low_eager.step()
        low_compiled.step()  # the first cached call compiles; the second is compared
        bf16_compiled = low_compiled.step()
        print(f"bf16 compiled vs bf16 eager: {diff(bf16_compiled, bf16_eager)}")
        print(f"bf16 eager vs fp32 eager (bf16's drift): {diff(bf16_eager, reference)}")
        print(f"bf16 compiled vs fp32 eager: {diff(bf16_compiled, reference)}")


# -- controlnet --------------------------------------------------------------------------------------------------------
CONTROLNET_HELP = """\
A Fun ControlNet loop with our prefix cache vs the same loop with the cache off (what ComfyUI core and VideoX-Fun
do whenever the control is attached), in one run.

The scaled shape of speed.py (heads of 128, width 1024, SwiGLU x3, ~75 text tokens, a 1024-token target, one
reference of 1024 tokens; only the layer count is cut) with a control stream of half as many blocks, as the release
pairs 16 with 32. 8 steps; runs alternate (cache on, cache off, ...) and the medians are compared. Also printed: the
same with the window [0.2, 0.8] (steps outside it read a plain cache of their own) and the cache bytes per stream.

    python benchmarks/variants.py controlnet [--layers 2] [--repeats 3] [--threads N]
"""

STEPS = 8
SIGMAS = torch.linspace(1.0, 0.0, STEPS + 1)
CONTROL_SIZE = (TARGET[1] * 16, TARGET[0] * 16)  # width, height in px


def build_net(blocks: int) -> FunControlNet:
    torch.manual_seed(1)
    net = FunControlNet(ControlNetConfig(num_blocks=blocks, num_heads=8, head_dim=128, mlp_ratio=3))
    with torch.no_grad():
        for param in net.parameters():
            param.normal_(0, 0.02)
    return net.eval()


def timed_runs(model, cond, repeats: int) -> dict:
    """{cache on?: (median wall seconds, median process CPU seconds, result)} from alternating runs. With
    `--threads 1` the CPU time is the work done, whatever else the machine runs."""
    times, results = {True: [], False: []}, {}
    width, height = CONTROL_SIZE
    for _ in range(repeats):
        for cache in (True, False):
            wall, cpu = time.perf_counter(), time.process_time()
            result = sample(model, cond, sigmas=SIGMAS, width=width, height=height, seed=0, prefix_cache=cache)
            times[cache].append((time.perf_counter() - wall, time.process_time() - cpu))
            results[cache] = result
    return {cache: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values), results[cache])
            for cache, values in times.items()}


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def run_controlnet():
    args = cpu_bench_args(CONTROLNET_HELP, layers=2, repeats=3)
    _, model, _ = build_models(args.layers)
    net = build_net(args.layers // 2)
    cond = build_inputs(1)[3]
    grid = TARGET
    hint = torch.randn(grid[0] * grid[1], 129, generator=torch.Generator().manual_seed(2))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, {args.layers} base + "
          f"{args.layers // 2} control blocks, width 1024, heads 8x128, target {grid[0] * grid[1]} tokens, prefix "
          f"{cond.layout(grid).prefix_len} tokens (1 reference), {STEPS} steps, median of {args.repeats}")
    print("loop | cache on s | cache off s (core) | on/off wall | on/off CPU time | cache bytes (per stream) | "
          "max |on - off|")
    with torch.inference_mode():
        for label, window in (("control, window [0, 1]", (0.0, 1.0)), ("control, window [0.2, 0.8]", (0.2, 0.8)),
                              ("no control", None)):
            patched = model if window is None else apply_controlnet(model, net, lambda g: hint, 1.0, *window)
            runs = timed_runs(patched, cond, args.repeats)
            (on_s, on_cpu, on), (off_s, off_cpu, off) = runs[True], runs[False]
            streams = on.report.get("control", {}).get("cache_bytes", {"base": on.report["cache_bytes"]})
            diff = (on.latents - off.latents).abs().max()
            shown = ", ".join(f"{name} {mib(n)}" for name, n in streams.items())
            print(f"{label} | {on_s:.2f} | {off_s:.2f} | {on_s / off_s:.3f} | {on_cpu / off_cpu:.3f} | {shown} | "
                  f"{diff:.1e}")


QUESTIONS = {"lora": run_lora,
             "gguf": run_gguf,
             "quantized": run_quantized,
             "cache-quant": run_cache_quant,
             "compiled": run_compiled,
             "controlnet": run_controlnet}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in QUESTIONS:
        raise SystemExit(f"usage: variants.py {{{','.join(QUESTIONS)}}} [options]\n\n{__doc__}")
    # each question reads its own options from sys.argv, as the script it was
    sys.argv = [f"variants.py {argv[0]}", *argv[1:]]
    QUESTIONS[argv[0]]()


if __name__ == "__main__":
    main()
