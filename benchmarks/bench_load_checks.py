"""What the load-time checks of issue "Reliability III" cost, at real sizes, in one run.

1. The NaN/inf check (model/loaders/finite.py) on one 4096 x 12288 tensor (the released DiT's MLP weight) in
   bf16, as fp8_e4m3fn and as Q8_0 blocks (its block scales only), next to a plain copy of the same bytes (what
   reading the tensor costs anyway); medians of interleaved runs.
2. The GGUF metadata bombs (a 170-byte file declaring 2^40 array elements; a valid 10 MB file holding a
   10M-element array): each loaded through `load_dit` in a fresh process, its time and peak resident memory
   (ru_maxrss) against the same process before the load; and the gguf package's own reader on the same file
   (what the loader ran before the pre-scan), under a 4 GiB address-space limit and a 20 s timeout.

    python benchmarks/bench_load_checks.py [--threads 2]
"""

import argparse
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from qi21.model.layers.gguf import block_scales  # noqa: E402
from qi21.model.loaders.finite import nonfinite  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def median_ms(calls, repeats: int = 7) -> list[float]:
    """Interleaved medians (ms) of each zero-argument call."""
    for call in calls:
        call()
    times = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            started = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - started)
    return [1e3 * statistics.median(t) for t in times]


def reduction_costs() -> None:
    weight = torch.randn(4096, 12288).bfloat16()
    fp8 = weight.float().clamp_(-448, 448).to(torch.float8_e4m3fn)
    blocks = torch.randint(0, 256, (4096 * 12288 // 32, 34), dtype=torch.uint8)
    for name, tensor, check in (("bf16", weight, lambda: nonfinite(weight)),
                                ("fp8_e4m3fn", fp8, lambda: nonfinite(fp8)),
                                ("Q8_0 blocks (scales)", blocks, lambda: nonfinite(block_scales("Q8_0", blocks)))):
        checked, copied = median_ms([check, lambda t=tensor: t.clone()])
        print(f"4096x12288 {name:<21} {tensor.numel() * tensor.element_size() / 2**20:6.1f} MiB: check "
              f"{checked:6.1f} ms, copy {copied:6.1f} ms, check/copy {checked / copied:.2f}")


CHILD = r"""
import resource, sys, time
sys.path.insert(0, {benchmarks!r})
import bench_pack
from qi21.model.loaders.dit import load_dit
import gguf  # imported before the baseline, as in a server that loaded it once
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
try:
    load_dit({path!r})
    outcome = "loaded"
except Exception as error:
    outcome = type(error).__name__ + ": " + str(error)[:150]
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
grew = (peak - before) / 1024
print(f"{{seconds:.3f}} s, peak RSS {{peak / 1024:.0f}} MiB (+{{grew:.1f}} over the process after its imports) "
      f"-> {{outcome}}")
"""
PACKAGE_ONLY = r"""
import resource, time
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import gguf
started = time.perf_counter()
try:
    gguf.GGUFReader({path!r})
    outcome = "parsed"
except BaseException as error:
    outcome = type(error).__name__ + ": " + str(error)[:100]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{{time.perf_counter() - started:.3f}} s, peak RSS {{peak / 1024:.0f}} MiB -> {{outcome}}")
"""


def bombs(folder: Path) -> dict[str, Path]:
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    small = folder / "bomb_2e40.gguf"
    small.write_bytes((header + struct.pack("<Q", 12) + b"general.bomb" + struct.pack("<IIQ", 9, 0, 1 << 40))
                      .ljust(170, b"\0"))
    large = folder / "valid_10m_array.gguf"
    count = 10_000_000
    with open(large, "wb") as handle:
        handle.write(header + struct.pack("<Q", 15) + b"general.padding" + struct.pack("<IIQ", 9, 0, count))
        handle.write(bytes(count))
    return {"170-byte file, 2^40 elements": small, "10 MB file, 10M-element array": large}


def run(code: str, timeout: float) -> str:
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"still running after {timeout:.0f} s (killed)"
    return (done.stdout.strip() or done.stderr.strip().splitlines()[-1])[:300]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {args.threads}")
    reduction_costs()
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in bombs(Path(tmp)).items():
            print(f"{name} ({path.stat().st_size:,} bytes)")
            print("  load_dit (pre-scan):   " + run(CHILD.format(benchmarks=str(REPO / "benchmarks"), path=str(path)),
                                                     60))
            print("  gguf package's reader: " + run(PACKAGE_ONLY.format(path=str(path)), 20))


if __name__ == "__main__":
    main()
