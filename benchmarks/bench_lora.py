"""What a LoRA branch costs: one DiT step with a LoRA applied vs the same model without it, in one run.

The scaled shape of bench_dit.py (heads of 128, width 1024, SwiGLU x3, ~75 text tokens, a 1024-token target,
one reference of 1024 tokens; only the layer count is cut). The LoRA targets what LoRAs usually train: every
block's to_q, to_k, to_v, to_out.0, img_mlp.gate_layer, img_mlp.proj and img_mlp.out (kohya keys with alpha),
applied with model/loaders/lora.py as low-rank branches next to the frozen weights (no merge, no weight copy). Prefill
and cached step are timed interleaved (plain, LoRA, plain, ...); per rank it prints the ratio of the median
wall-clock times, of the median process CPU times (with `--threads 1` the CPU time is the work done, whatever
else the machine runs) and of the FLOPs. `--full-patches` adds what ComfyUI-extracted Turbo LoRAs hold besides
the pairs: `.diff` patches of every norm scale and of img_in, proj_out and the timestep embedder's linear_1 (dense
delta branches and patched norm copies, model/loaders/lora_patches.py).

    python benchmarks/bench_lora.py [--layers 2] [--ranks 16 64] [--repeats 7] [--threads N] [--full-patches]
"""

import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

import bench_dit  # noqa: F401  (registers the repository as package `qi21`)
from bench_dit import build_inputs, cpu_bench_args, flops
from qi21.model.loaders.lora import apply_lora
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT
from qi21.model.transformer.prefix_cache import PrefixKVCache

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


def main():
    def add(parser):
        parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
        parser.add_argument("--full-patches", action="store_true")

    args = cpu_bench_args(__doc__, layers=2, repeats=7, add=add)
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


if __name__ == "__main__":
    main()
