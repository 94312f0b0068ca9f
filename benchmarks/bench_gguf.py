"""GGUF DiT benchmark: a cached step of a Q8_0 and a Q4_K DiT against the bf16 file, in one run, ratios printed.

The scaled shape of bench_dit.py (heads of 128, width 1024, SwiGLU x3, text width 1024, ~75 text tokens, a
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

    python benchmarks/bench_gguf.py [--layers 2] [--references 1] [--repeats 7] [--threads N] [--dtype fp32]
"""

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

import bench_dit  # a sibling (this folder is on sys.path when run as a script); imports the pack as `qi21`
from qi21.model.layers.gguf import GGUFLinear
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.dit_keys import file_plan
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT
from qi21.model.transformer.prefix_cache import PrefixKVCache


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


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """`(rows, cols)` fp32, cols a multiple of 256 -> Q4_K blocks `(rows, cols / 256 * 144)` uint8: per 32-element
    sub-block a 6-bit scale and min (of the block's fp16 d and dmin), 4-bit quants (llama.cpp's block layout)."""
    rows = x.shape[0]
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(-1), 0)
    step = (sub.max(-1) - low) / 15
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (-low.min(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(step / d32), 0, 63), 0).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.clip(np.rint(-low / dmin32), 0, 63), 0).astype(np.uint8)
        scale, offset = (d32 * sc)[..., None], (dmin32 * mn)[..., None]
        q = np.where(scale > 0, np.clip(np.rint((sub + offset) / scale), 0, 15), 0).astype(np.uint8)
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
    low = np.minimum(sub.min(-1), 0)
    step = (sub.max(-1) - low) / 3
    d = (step.max(-1) / 15).astype(np.float16)
    dmin = (-low.min(-1) / 15).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(step / d32), 0, 15), 0).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.clip(np.rint(-low / dmin32), 0, 15), 0).astype(np.uint8)
        scale, offset = (d32 * sc)[..., None], (dmin32 * mn)[..., None]
        q = np.where(scale > 0, np.clip(np.rint((sub + offset) / scale), 0, 3), 0).astype(np.uint8)
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


def main():
    def add(parser):
        parser.add_argument("--references", type=int, default=1)
        parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype of all three")

    args = bench_dit.cpu_bench_args(__doc__, layers=2, repeats=7, add=add)
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

    prefix, target, _, _ = bench_dit.build_inputs(args.references)
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


if __name__ == "__main__":
    main()
