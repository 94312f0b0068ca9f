"""Whole sampling loops: ours vs a diffusers loop (its transformer + scheduler) on the same weights, one run.

Same scaled shape as bench_dit.py (heads of 128, width 1024, 75 text tokens, a 1024-token target, references
of 1024 tokens; only the layer count is cut). Prints ratios measured side by side:
- Base loop (`--steps`, default 40) with 0, 1 and 2 references, and the Turbo loop (8 steps);
- a second run with `keep_cache` (another seed): it skips the prefill;
- a batch of 4 seeds vs 4 single runs, and the prefix-cache memory of each implementation for that batch.

    python benchmarks/bench_sampling.py [--layers 2] [--steps 40] [--batch-steps 8]
"""

import argparse
import time

import torch

import bench_dit  # a sibling (this folder is on sys.path when run as a script); imports the pack as `qi21`
from qi21.model.sampling.cache_store import PrefixCacheStore
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import TURBO_SIGMAS, base_sigmas, turbo_sigmas
from qi21.tests.oracle import BASE_SCHEDULER, TURBO_SCHEDULER, diffusers_loop, reference_cache_bytes

SIZE = (bench_dit.TARGET[1] * 16, bench_dit.TARGET[0] * 16)  # width, height in px


def clock(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-steps", type=int, default=8)
    args = parser.parse_args()
    reference, ours, _ = bench_dit.build_models(args.layers)
    width, height = SIZE
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, {args.layers} layers, width 1024, "
          f"heads 8x128, target {width}x{height} px ({bench_dit.TARGET[0] * bench_dit.TARGET[1]} tokens)")
    print("loop | ours s | diffusers s | ours/diffusers | max |ours - diffusers|")
    base_grid = [1.0 - i * (1.0 - 1.0 / args.steps) / max(args.steps - 1, 1) for i in range(args.steps)]
    with torch.inference_mode():
        for references in (0, 1, 2):
            cond = bench_dit.build_inputs(references)[3]
            noise = initial_noise(references, 1, height, width)
            sigmas = base_sigmas(args.steps, width, height)
            ours_s, mine = clock(sample, ours, cond, sigmas=sigmas, width=width, height=height, noise=noise)
            mine = mine.latents
            ref_s, theirs = clock(diffusers_loop, reference, cond, noise, base_grid, BASE_SCHEDULER)
            print(f"Base {args.steps} steps, {references} refs | {ours_s:.1f} | {ref_s:.1f} | {ours_s / ref_s:.3f} | "
                  f"{(mine - theirs).abs().max():.1e}")
        cond = bench_dit.build_inputs(2)[3]
        noise = initial_noise(0, 1, height, width)
        ours_s, mine = clock(lambda: sample(ours, cond, sigmas=turbo_sigmas(), width=width, height=height,
                                            noise=noise).latents)
        ref_s, theirs = clock(lambda: diffusers_loop(reference, cond, noise, list(TURBO_SIGMAS), TURBO_SCHEDULER))
        print(f"Turbo 8 steps, 2 refs | {ours_s:.1f} | {ref_s:.1f} | {ours_s / ref_s:.3f} | "
              f"{(mine - theirs).abs().max():.1e}")

        store = PrefixCacheStore()
        kwargs = dict(sigmas=turbo_sigmas(), width=width, height=height, keep_cache=True, store=store)
        first_s, first = clock(lambda: sample(ours, cond, seed=1, **kwargs))
        second_s, second = clock(lambda: sample(ours, cond, seed=2, **kwargs))
        # A hit replaces the prefill by one cached step, so the most a rerun can save is their difference.
        avoidable = first.report["prefill_seconds"] - first.report["step_seconds"]
        print(f"\nkept cache, Turbo 8 steps, 2 refs: first run {first_s:.2f} s ({first.report['cache']}, prefill "
              f"{first.report['prefill_seconds']:.2f} s vs {first.report['step_seconds']:.2f} s per cached step), "
              f"second run {second_s:.2f} s ({second.report['cache']}, no prefill): saved {first_s - second_s:.2f} s "
              f"= {(first_s - second_s) / avoidable:.2f}x what skipping the prefill can save; second/first "
              f"{second_s / first_s:.3f}")

        batch_sigmas = base_sigmas(args.batch_steps, width, height)
        noise4 = initial_noise(3, 4, height, width)
        batch_s, batch = clock(sample, ours, cond, sigmas=batch_sigmas, width=width, height=height, noise=noise4)
        singles_s, _ = clock(lambda: [sample(ours, cond, sigmas=batch_sigmas, width=width, height=height,
                                             noise=noise4[i : i + 1]) for i in range(4)])
        reference_caches = []
        ref_batch_s, _ = clock(lambda: diffusers_loop(reference, cond, noise4, batch_sigmas[:-1].tolist(),
                                                      BASE_SCHEDULER, caches=reference_caches))
        ref_bytes = sum(reference_cache_bytes(cache) for cache in reference_caches)
        single_bytes = sample(ours, cond, sigmas=batch_sigmas[-2:], width=width, height=height,
                              noise=noise4[:1]).report["cache_bytes"]
        print(f"batch of 4, Base {args.batch_steps} steps, 2 refs: ours {batch_s:.1f} s vs 4 single runs "
              f"{singles_s:.1f} s ({batch_s / singles_s:.3f}); diffusers batch of 4 {ref_batch_s:.1f} s "
              f"(ours/diffusers {batch_s / ref_batch_s:.3f})")
        print(f"prefix cache for the batch of 4: ours {batch.report['cache_bytes'] / 2**20:.1f} MiB "
              f"({batch.report['cache_bytes'] / single_bytes:.1f}x one prompt), diffusers {ref_bytes / 2**20:.1f} MiB "
              f"({ref_bytes / single_bytes:.1f}x)")


if __name__ == "__main__":
    main()
