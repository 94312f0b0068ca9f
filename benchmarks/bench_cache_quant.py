"""The int8 / int4 prefix cache (model/transformer/cache_storage.py): bytes, error and CPU speed, in one run.

1. Bytes, scales included, against the bf16 cache: the planner's figure for the full model (32 layers, 32 heads of
   128) at 1024x1024, t2i (75 tokens) and a 3-reference edit (3 x 4096 + 75 tokens); and the bytes a real cache
   allocates for the same prefixes on the scaled model (8 heads of 128: rows of 1024 values).
2. Error on the scaled CPU model (bench_dit.py's shape: width 1024, heads of 128, SwiGLU x3, a 512x512 target, one
   512x512 reference, 75 text tokens; weights drawn as bf16_drift.py draws them, norm scales around 1 and matrices
   N(0, 1/fan_in)): one cached velocity and a whole 40-step Base loop with an int8 / int4 cache against the model-dtype
   cache (bf16, and fp32 to isolate the quantization), each next to the bf16-vs-fp32 drift of the same velocity /
   loop (relative L2).
3. CPU speed of a cached step with an int8 / int4 cache against the plain one (the dequantization per layer),
   interleaved medians, fp32 and bf16 models, two references.

    python benchmarks/bench_cache_quant.py [--layers 4] [--repeats 5] [--threads N] [--steps 40]
"""

import statistics
import time

import torch

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from bench_dit import build_inputs, cpu_bench_args
from qi21.model.memory.planner import RunShape, run_estimate
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import base_sigmas
from qi21.model.transformer.cache_storage import cache_storage
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT
from qi21.model.transformer.prefix_cache import PrefixKVCache

DTYPES = ("default", "int8", "int4")
SIZE = 512  # the target (bench_dit.TARGET: 32 x 32 latent tokens)


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
    sigmas, noise = base_sigmas(steps, SIZE, SIZE), initial_noise(3, 1, SIZE, SIZE)

    def loop(model, dtype):
        return sample(model, cond, sigmas=sigmas, width=SIZE, height=SIZE, noise=noise, cache_dtype=dtype)

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


def speed(models, repeats: int):
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


def main():
    args = cpu_bench_args(__doc__, layers=4, repeats=5,
                          add=lambda p: p.add_argument("--steps", type=int, default=40))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    planner_bytes()
    models = errors(args.layers, args.steps)
    speed(models, args.repeats)


if __name__ == "__main__":
    main()
