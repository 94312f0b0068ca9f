"""bf16 or fp32 on this CPU: what the loaders' `default` picks here (model/loaders/checkpoint.py
`default_weight_dtype`: the file's bf16 where the CPU has native bf16, fp32 elsewhere), and what each costs.

1. One GEMM of the released DiT's shapes (1024 image tokens x width 3072, the attention projection) in fp32 and in
   bf16, interleaved, the median of `--repeats`.
2. The trained toy (demo/toy_model.py): one 256x256 text-to-image of `--steps` Base steps with the DiT loaded as fp32
   and as bf16 (the toy's files are bf16; text encoder and VAE fp32 in both), interleaved over `--rounds` (the order
   alternates each round), and how far apart the two pictures are (PSNR, what `analyse` reads in each).

    python benchmarks/speed.py cpu-dtype [--rounds 3] [--steps 20] [--repeats 5] [--threads 2]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from qi21.demo.toy_eval import ToyPipeline, analyse, psnr
from qi21.demo.toy_model import write_toy_checkpoints
from qi21.model.loaders.checkpoint import cpu_has_native_bf16, default_weight_dtype

PROMPT = "a large red circle on the left, white background"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def gemm_seconds(dtype: torch.dtype, tokens: int, width: int, repeats: int) -> float:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=generator).to(dtype)
    w = torch.randn(width, width, generator=generator).to(dtype)
    torch.nn.functional.linear(x, w)  # oneDNN builds its primitive on the first call
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="speed.py cpu-dtype", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="toy pictures per dtype, interleaved (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="Base steps per picture (default 20)")
    parser.add_argument("--repeats", type=int, default=5, help="GEMMs per dtype and round (default 5)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, CPU kernels {torch.backends.cpu.get_cpu_capability()}, "
          f"native bf16: {cpu_has_native_bf16()}; `default` on this CPU loads "
          f"{default_weight_dtype('default', torch.device('cpu'))} (\"default\" = the file's dtype)")

    tokens, width = 1024, 3072
    gemm = {name: [] for name in DTYPES}
    for _ in range(args.rounds):
        for name, dtype in DTYPES.items():
            gemm[name].append(gemm_seconds(dtype, tokens, width, args.repeats))
    fp32, bf16 = (statistics.median(gemm[name]) for name in DTYPES)
    flops = 2 * tokens * width * width
    print(f"GEMM {tokens}x{width} @ {width}x{width}: fp32 {fp32 * 1e3:.1f} ms ({flops / fp32 / 1e9:.0f} GFLOP/s), "
          f"bf16 {bf16 * 1e3:.1f} ms ({flops / bf16 / 1e9:.0f} GFLOP/s); bf16 / fp32 time {bf16 / fp32:.2f}x")

    with tempfile.TemporaryDirectory() as tmp:
        write_toy_checkpoints(Path(tmp))
        pipe = ToyPipeline(Path(tmp))
        positive = pipe.condition(PROMPT)
        seconds, dit_seconds, images = {name: [] for name in DTYPES}, {name: [] for name in DTYPES}, {}
        for round_ in range(args.rounds):
            order = list(DTYPES) if round_ % 2 == 0 else list(reversed(DTYPES))
            for name in order:
                model = pipe.dit(weight_dtype=name)
                started = time.perf_counter()
                images[name], report = pipe.generate(positive, 0, steps=args.steps, model=model)
                seconds[name].append(time.perf_counter() - started)
                # the DiT's own share (the steps, from the run's report); the VAE decode is fp32 in both
                dit_seconds[name].append(report["prefill_seconds"] + report["step_seconds"] * (args.steps - 1))
    print(f"toy 256x256, {args.steps} Base steps, seed 0, {args.rounds} rounds interleaved: seconds per picture "
          "(the DiT's steps / the whole picture with its fp32 decode)")
    for name in DTYPES:
        each = " ".join(f"{d:.2f}/{s:.2f}" for d, s in zip(dit_seconds[name], seconds[name]))
        print(f"  DiT {name}: {each}  median {statistics.median(dit_seconds[name]):.2f} / "
              f"{statistics.median(seconds[name]):.2f}")
    ratio = statistics.median(dit_seconds["bf16"]) / statistics.median(dit_seconds["fp32"])
    whole = statistics.median(seconds["bf16"]) / statistics.median(seconds["fp32"])
    print(f"  bf16 / fp32 time: the DiT's steps {ratio:.2f}x, the whole picture {whole:.2f}x; pictures "
          f"{psnr(images['bf16'], images['fp32']):.1f} dB apart; read fp32 {analyse(images['fp32'][0]).reading}, "
          f"bf16 {analyse(images['bf16'][0]).reading}")
