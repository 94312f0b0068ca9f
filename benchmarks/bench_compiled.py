"""Compiled blocks (the loader's `compile` option, model/transformer/compiled.py) on this machine: the cached step
compiled against eager, what the first compiled calls cost cold and warm, and what compiling changes numerically.

bench_dit's scaled shape (heads of 128, width 1024 = 8 heads, SwiGLU x3, 75 text tokens, one 512x512 reference, a
512x512 target), `--layers` blocks, inductor. It prints:
- the median cached step eager and compiled (fp32, calls interleaved) and their ratio;
- the first compiled calls: the cached step's (one graph) and the prefill's (two: its blocks and its last block),
  cold (inductor's caches in a fresh folder: what the first run after an install pays) and warm (dynamo reset in the
  same process, inductor's caches filled: about what a restarted ComfyUI pays);
- the cached velocity compiled vs eager in fp32 and in bf16, next to bf16 eager vs fp32 eager (bf16's own drift) and
  bf16 compiled vs fp32 eager, as max abs and relative L2 differences.

    python benchmarks/bench_compiled.py [--layers 2] [--repeats 5] [--threads N] [--device cpu|cuda]
"""

import os
import statistics
import tempfile
import time

import torch

from bench_dit import build_inputs, build_models, cpu_bench_args
from qi21.model.loaders.lora import clone_tree
from qi21.model.transformer.compiled import compile_blocks
from qi21.model.transformer.dit import QwenImage21DiT
from qi21.model.transformer.prefix_cache import PrefixKVCache


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


def main() -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    args = cpu_bench_args(__doc__, layers=2, repeats=5,
                          add=lambda parser: parser.add_argument("--device", default=default_device))
    device = torch.device(args.device)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="qi21_inductor_")  # cold: nothing compiled yet
    _, base, _ = build_models(args.layers)
    base = base.to(device)
    prefix, target, _, _ = build_inputs(1)
    prefix = type(prefix)(layout=prefix.layout, text=prefix.text.to(device), references=prefix.references.to(device))
    target = target.to(device)
    print(f"# bench_compiled: {args.layers} blocks of width 1024, 1 reference, 512x512, {device}, "
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


if __name__ == "__main__":
    main()
