"""Where a cached step's CPU time goes, and how close its GEMMs come to this machine's GEMM roofline (speed.py dit
`--roofline`).

- The roofline: every GEMM a cached step runs (its `(M, K, N)` as the model calls it, recorded by a dispatch mode) is
  timed alone with torch, `F.linear` on fresh tensors of the same shapes, in the same process; the sum is what the
  step's GEMMs cost at the rate this machine reaches on them. The step's own GEMM time over that sum is the fraction
  of the roofline the step reaches. A large square GEMM gives the machine's best rate, for reference.
- The rest: the model's pieces are wrapped for one measurement (restored after) and timed in process CPU time with
  exclusive accounting (a piece's time excludes the pieces it calls): GEMMs (`Linear.project`), attention
  (`target_attention`), norms (`layer_norm`, the q/k RMSNorm), RoPE (`apply_rope`), modulation and gated residuals
  (`Rows.modulate` / `gated_add`), the q/k/v layout and casts (what `qkv_heads` does besides its GEMMs, norm and
  RoPE: copies), the MLP's SiLU and product, and the remainder of each block and of the forward (Python, views,
  buffers, the embeddings' elementwise work). Process CPU time counts the work done whatever else the machine runs;
  with `--threads 1` it is the wall time of a quiet machine.
"""

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from qi21.model.layers import linear as linear_module
from qi21.model.transformer import block as block_module, dit as dit_module

PIECES = ("GEMMs", "attention", "norms", "RoPE", "modulation and gated residuals", "q/k/v layout and casts",
          "SiLU x up", "block remainder (Python, views, buffers)", "forward remainder (embeddings, head, Python)")


class ExclusiveClock:
    """Process CPU seconds per label, each label's time excluding the labelled calls made inside it."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self._stack = []  # [label, start, time spent in labelled children]

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            self._stack.append([label, time.process_time(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                label_, start, children = self._stack.pop()
                spent = time.process_time() - start
                self.seconds[label_] += spent - children
                if self._stack:
                    self._stack[-1][2] += spent

        return timed


@contextmanager
def timed_pieces(clock: ExclusiveClock):
    """The model's pieces wrapped by `clock` while inside (module globals and class attributes, put back after)."""
    targets = [
        (linear_module.Linear, "project", "GEMMs"),
        (block_module, "target_attention", "attention"),
        (block_module, "layer_norm", "norms"),
        (dit_module, "layer_norm", "norms"),
        (block_module, "head_rms_norm", "norms"),
        (block_module, "apply_rope", "RoPE"),
        (block_module.Rows, "modulate", "modulation and gated residuals"),
        (block_module.Rows, "gated_add", "modulation and gated residuals"),
        (block_module.Block, "qkv_heads", "q/k/v layout and casts"),
        (block_module.Block, "mlp", "SiLU x up"),
        (block_module.Block, "forward", "block remainder (Python, views, buffers)"),
        (dit_module.QwenImage21DiT, "forward", "forward remainder (embeddings, head, Python)"),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in targets]
    try:
        for owner, name, label in targets:
            setattr(owner, name, clock.wrap(label, owner.__dict__[name]))
        yield clock
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


class GemmShapes(TorchDispatchMode):
    """Records `(M, K, N)` of every linear / mm / addmm while active (leading dimensions folded into M)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.linear.default:  # (..., K) x (N, K)
            x, w = args[0], args[1]
            self.shapes.append((x.numel() // x.shape[-1], x.shape[-1], w.shape[0]))
        elif func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = (args[0], args[1]) if func is torch.ops.aten.mm.default else (args[1], args[2])
            self.shapes.append((a.shape[0], a.shape[1], b.shape[1]))
        return func(*args, **(kwargs or {}))


def cpu_median(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def gemms_alone(shapes, repeats: int) -> float:
    """CPU seconds of `F.linear` on fresh `(M, K) x (N, K)` fp32 tensors, summed over `shapes` (one timing each)."""
    total, timed = 0.0, {}
    for shape in shapes:
        if shape not in timed:
            m, k, n = shape
            x, w = torch.randn(m, k), torch.randn(n, k)
            timed[shape] = cpu_median(lambda x=x, w=w: F.linear(x, w), repeats)
        total += timed[shape]
    return total


def machine_rate(repeats: int, size: int = 2048) -> float:
    """GFLOP/s of one large square fp32 GEMM: the best this machine does with these threads."""
    x, w = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / cpu_median(lambda: F.linear(x, w), repeats) / 1e9


def breakdown(step, repeats: int) -> dict:
    """One cached step `step()` measured three ways: its CPU time (median), its pieces (medians of per-step
    exclusive times), and its GEMM shapes timed alone."""
    with torch.inference_mode():
        total = cpu_median(step, repeats)
        per_step = defaultdict(list)
        with timed_pieces(ExclusiveClock()) as clock:
            step()  # warm-up through the wrappers
            for _ in range(repeats):
                clock.seconds.clear()
                step()
                for label in PIECES:
                    per_step[label].append(clock.seconds.get(label, 0.0))
        pieces = {label: statistics.median(values) for label, values in per_step.items()}
        recorder = GemmShapes()
        with recorder:
            step()
        alone = gemms_alone(recorder.shapes, repeats)
    flops = sum(2 * m * k * n for m, k, n in recorder.shapes)
    return {"total": total, "pieces": pieces, "gemm_alone": alone, "gemm_flops": flops, "gemms": len(recorder.shapes)}


@contextmanager
def timed_functional(clock: ExclusiveClock):
    """`F.linear` and `F.scaled_dot_product_attention` wrapped by `clock` (diffusers' transformer calls both through
    `torch.nn.functional`); put back after."""
    saved = {name: getattr(F, name) for name in ("linear", "scaled_dot_product_attention")}
    try:
        F.linear = clock.wrap("GEMMs", saved["linear"])
        F.scaled_dot_product_attention = clock.wrap("attention", saved["scaled_dot_product_attention"])
        yield clock
    finally:
        for name, original in saved.items():
            setattr(F, name, original)


def split_step(step, repeats: int, wrapped) -> dict:
    """{"total", "GEMMs", "attention", "rest"}: medians of one step's process CPU seconds, the GEMMs and attention
    as `wrapped(clock)` labels them, the rest what is left (elementwise work, copies, Python)."""
    with torch.inference_mode():
        total = cpu_median(step, repeats)
        samples = defaultdict(list)
        with wrapped(ExclusiveClock()) as clock:
            step()
            for _ in range(repeats):
                clock.seconds.clear()
                start = time.process_time()
                step()
                whole = time.process_time() - start
                for label in ("GEMMs", "attention"):
                    samples[label].append(clock.seconds.get(label, 0.0))
                samples["rest"].append(whole - clock.seconds.get("GEMMs", 0.0) - clock.seconds.get("attention", 0.0))
    return {"total": total, **{label: statistics.median(values) for label, values in samples.items()}}


def ours_wrapped(clock: ExclusiveClock):
    """Our pieces wrapped (timed_pieces), the GEMMs and attention under the labels `split_step` reads."""
    return timed_pieces(clock)


def print_split(results: dict[int, tuple[dict, dict]]) -> None:
    """`results[references] = (ours, diffusers)` from `split_step`: the cached step in three parts, side by side."""
    print("\nCached step, ours vs diffusers in the same run: process CPU ms per step (GEMMs: `Linear.project` / "
          "`F.linear`; attention: `target_attention` / SDPA; rest: everything else).\n")
    print("| refs | ours: total / GEMMs / attention / rest | diffusers: total / GEMMs / attention / rest | "
          "total ours / diffusers | GEMMs + attention ours / diffusers | rest ours / diffusers |")
    print("|---|---|---|---|---|---|")
    for refs, (ours, theirs) in sorted(results.items()):
        cells = [" / ".join(f"{side[k] * 1e3:.1f}" for k in ("total", "GEMMs", "attention", "rest"))
                 for side in (ours, theirs)]
        arithmetic = (ours["GEMMs"] + ours["attention"]) / (theirs["GEMMs"] + theirs["attention"])
        print(f"| {refs} | {cells[0]} | {cells[1]} | {ours['total'] / theirs['total']:.3f} | {arithmetic:.3f} | "
              f"{ours['rest'] / theirs['rest']:.3f} |")


def print_table(results: dict[int, dict], rate: float) -> None:
    """`results[references]` from `breakdown`, as one markdown table (ms per cached step, share of the step)."""
    refs = sorted(results)
    print(f"\nCached step, process CPU ms per step (share of the step). Machine: a 2048^3 fp32 GEMM alone runs at "
          f"{rate:.1f} GFLOP/s.\n")
    print("| | " + " | ".join(f"{r} refs" for r in refs) + " |")
    print("|---|" + "---|" * len(refs))

    def row(name, values):
        print(f"| {name} | " + " | ".join(values) + " |")

    row("whole step (unwrapped)", [f"{results[r]['total'] * 1e3:.1f}" for r in refs])
    for label in PIECES:
        row(label, [f"{results[r]['pieces'][label] * 1e3:.1f} ({results[r]['pieces'][label] / results[r]['total']:.1%})"
                    for r in refs])
    row("GEMMs: the same shapes alone", [f"{results[r]['gemm_alone'] * 1e3:.1f}" for r in refs])
    row("GEMM part: fraction of the roofline (alone / in the step)",
        [f"{results[r]['gemm_alone'] / results[r]['pieces']['GEMMs']:.1%}" for r in refs])
    row("GEMM rate in the step, GFLOP/s (of the machine's)",
        [f"{results[r]['gemm_flops'] / results[r]['pieces']['GEMMs'] / 1e9:.1f} "
         f"({results[r]['gemm_flops'] / results[r]['pieces']['GEMMs'] / 1e9 / rate:.0%})" for r in refs])
    row("whole step at the GEMM roofline rate: GEMMs alone / whole step",
        [f"{results[r]['gemm_alone'] / results[r]['total']:.1%}" for r in refs])
