"""What a cached step costs besides arithmetic: kernels launched and host time per step, ours vs diffusers.

On a GPU every kernel is a launch the host has to issue, and a step whose host work (Python, dispatch, launches)
approaches the device's 100-150 ms stalls it. That cost does not shrink with the width, so it is measured here at a
width where the arithmetic is negligible: all 32 blocks, heads of 128 (one head, so RoPE's 16/56/56 axes hold), a
16-token target and a 26-token prefix (10 text tokens, one 16-token reference), fp32 on the CPU, one thread.
Printed, for ours and diffusers' transformer on the same weights, interleaved, medians of `--repeats`:
- kernels per cached step: aten ops that launch a kernel (views, reshapes, other metadata-only ops and allocations
  left out), counted by a dispatch mode, and per block;
- host ms per cached step (the whole forward at this width is host work).

    python benchmarks/bench_host_overhead.py [--repeats 30]
"""

import argparse
import collections
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from bench_dit import build_inputs, build_models
from qi21.model.transformer.prefix_cache import PrefixKVCache

LAYERS = 32
GRID = (4, 4)  # target and reference latent tokens
#: aten ops that launch no kernel on a GPU: new views of the same memory, and allocations (the caching allocator's)
NOT_KERNELS = {"view", "_unsafe_view", "reshape", "slice", "select", "unsqueeze", "squeeze", "transpose", "permute",
               "expand", "t", "alias", "as_strided", "unflatten", "flatten", "chunk", "split", "unbind", "view_as",
               "view_as_real", "view_as_complex", "detach", "narrow", "contiguous", "_reshape_alias", "to",
               "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided"}


class KernelCount(TorchDispatchMode):
    """Counts the aten ops that launch a kernel (`NOT_KERNELS` left out; `to` only counts when it really converts,
    which the dispatcher shows as `_to_copy`)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NOT_KERNELS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def build(layers: int = LAYERS):
    """{"ours": cached step, "diffusers": cached step}, both caches filled, on the same random weights."""
    reference, ours, KVCache = build_models(layers, heads=1, context_in_dim=64)
    prefix, target, kwargs, _ = build_inputs(1, text_tokens=10, context_dim=64, grid=GRID, lead=5)
    t = torch.tensor([0.8])
    cache, ref_cache = PrefixKVCache(), KVCache(layers)
    with torch.inference_mode():
        ours(target, t, [prefix], cache=cache, mode="prefill")
        reference(timestep=t, kv_cache=ref_cache, kv_cache_mode="extract", **kwargs)
    return {"ours": lambda: ours(target, t, [prefix], cache=cache, mode="cached"),
            "diffusers": lambda: reference(timestep=t, kv_cache=ref_cache, kv_cache_mode="cached", **kwargs)}


def measure(steps: dict, repeats: int) -> dict:
    """{side: (kernels per step, Counter of them, host ms per step)}."""
    results, times = {}, collections.defaultdict(list)
    with torch.inference_mode():
        for side, step in steps.items():
            step()
            with KernelCount() as count:
                step()
            results[side] = [sum(count.ops.values()), count.ops]
        for _ in range(repeats):  # interleaved
            for side, step in steps.items():
                started = time.perf_counter()
                step()
                times[side].append(time.perf_counter() - started)
    for side in steps:
        results[side].append(statistics.median(times[side]) * 1e3)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = measure(build(), args.repeats)
    print(f"torch {torch.__version__}, 1 thread, {LAYERS} blocks, heads 1x128, target 16 + prefix 26 tokens, "
          f"cached step, median of {args.repeats}")
    print("side | kernels per step | per block | host ms per step")
    for side, (kernels, _, ms) in results.items():
        print(f"{side} | {kernels} | {kernels / LAYERS:.1f} | {ms:.1f}")
    ours, theirs = results["ours"], results["diffusers"]
    print(f"ours / diffusers | {ours[0] / theirs[0]:.3f} | | {ours[2] / theirs[2]:.3f}")
    print("ours, kernels by op:", ", ".join(f"{name} {n}" for name, n in ours[1].most_common()))
    return results


if __name__ == "__main__":
    main()
