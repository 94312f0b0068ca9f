"""A Fun ControlNet loop with our prefix cache vs the same loop with the cache off (what ComfyUI core and VideoX-Fun
do whenever the control is attached), in one run.

The scaled shape of bench_dit.py (heads of 128, width 1024, SwiGLU x3, ~75 text tokens, a 1024-token target, one
reference of 1024 tokens; only the layer count is cut) with a control stream of half as many blocks, as the release
pairs 16 with 32. 8 steps; runs alternate (cache on, cache off, ...) and the medians are compared. Also printed: the
same with the window [0.2, 0.8] (steps outside it read a plain cache of their own) and the cache bytes per stream.

    python benchmarks/bench_controlnet.py [--layers 2] [--repeats 3] [--threads N]
"""

import statistics
import time

import torch

import bench_dit  # a sibling (this folder is on sys.path when run as a script); imports the pack as `qi21`
from qi21.model.loaders.controlnet import apply_controlnet
from qi21.model.sampling.loop import sample
from qi21.model.transformer.controlnet import ControlNetConfig, FunControlNet

STEPS = 8
SIGMAS = torch.linspace(1.0, 0.0, STEPS + 1)
SIZE = (bench_dit.TARGET[1] * 16, bench_dit.TARGET[0] * 16)  # width, height in px


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
    width, height = SIZE
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


def main():
    args = bench_dit.cpu_bench_args(__doc__, layers=2, repeats=3)
    _, model, _ = bench_dit.build_models(args.layers)
    net = build_net(args.layers // 2)
    cond = bench_dit.build_inputs(1)[3]
    grid = bench_dit.TARGET
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


if __name__ == "__main__":
    main()
