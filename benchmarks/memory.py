"""Memory, and what loading costs: the host's real peak against the planner's, the planner's plans for common
GPUs, weight streaming under GPU memory caps, and the load-time checks' cost. One script, a question each.

    python benchmarks/memory.py host [--width 1024] [--layers 12] [--encoder-layers 10] [--json rows.json]
    python benchmarks/memory.py plan-table [--cards 8 12 16 24 48 80] [--host-gib 64] [--format bf16 int8]
    python benchmarks/memory.py streaming [--caps 8 12 16 24] [--references 0 1] [--steps 4] [--json out.json]
    python benchmarks/memory.py streaming --dry-run     # CPU, tiny model: the same code path, for the tests
    python benchmarks/memory.py load-checks [--threads 2]

`host`: the planner's predicted host peak against the process's measured RssAnon, each scenario in a fresh process
(`HOST_HELP`). `plan-table`: the planner's plans for the released model on common GPUs, as the Markdown tables of
docs/measurements.md; no GPU or weights needed (`PLAN_TABLE_HELP`). `streaming`: streamed weights and the host
prefix cache on a GPU under memory caps, bit-identical or not, predicted peak against measured
(parts/weight_streaming.py; gpu_check.py's `streaming` section runs it too). `load-checks`: what the NaN/inf check
and the GGUF pre-scan cost at real sizes (`LOAD_CHECKS_HELP`). `python benchmarks/memory.py QUESTION --help` says
what a question prints.
"""

import argparse
import json
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from parts import weight_streaming
from qi21.demo.tiny_checkpoints import comfy_dit_state_dict, dit_state_dict
from qi21.model.layers.gguf import block_scales
from qi21.model.loaders.finite import nonfinite
from qi21.model.memory.estimate import GIB, EncoderDims, VAEShape, encode_transient, synthetic_encoder_weights
from qi21.model.memory.host import plan_host
from qi21.model.memory.planner import Budget, PlanError, RunShape, plan_layers, plan_run
from qi21.model.memory.weights import synthetic_dit_weights
from qi21.model.transformer.dit import DiTConfig

# -- host: the planned host peak against RssAnon -----------------------------------------------------------------------
HOST_HELP = """Host memory: the planner's predicted host peak (model/memory/host.py) against the anonymous memory
the process really holds (RssAnon in /proc/self/status, sampled every half millisecond), on the CPU, with bf16 DiT
files of the released architecture at a smaller width.

Each scenario runs in a fresh process (an allocator keeps some of what an earlier scenario freed) and counts from
what that process held before loading; the files are written first, by this process.

    cpu-bf16    a bf16 DiT loaded at once and computing in bf16 on the CPU (the device is the host): one 512 px run
                of 2 steps. Predicted: the plan's sampling peak (weights + the run's transient).
    deferred    the pipeline as on a GPU, the device simulated per block: a stand-in text encoder (a second bf16
                file) loaded into host memory as its loader does (after encoding it is offloaded there), then the
                DiT loaded deferred and placed by the plan under a device budget that holds about half its blocks:
                the resident blocks are read into the simulated device (a shared file mapping, which, like GPU
                memory, is not anonymous host memory), the streamed ones into host memory. Then evicted back to its
                file, as ComfyUI's unload does. Predicted: `plan_host(...).peak`.
    eager       the same with the DiT loaded at once into host memory first (every loader before this change):
                the whole file beside the text encoder.

    python benchmarks/memory.py host [--width 1024] [--layers 12] [--encoder-layers 10] [--json rows.json]
"""

SCENARIOS = ("cpu-bf16", "deferred", "eager")
PROMPT_TOKENS, SIZE = 64, 512


def rss_anon() -> int:
    """This process's anonymous resident memory, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakSampler:
    """The highest RssAnon seen while the body runs, sampled by a thread every `interval` seconds."""

    def __init__(self, interval: float = 0.0005):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = rss_anon()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def config(width: int, layers: int) -> DiTConfig:
    return DiTConfig(num_layers=layers, num_heads=width // 128, head_dim=128, context_in_dim=512)


def write_file(path: Path, cfg: DiTConfig, seed: int) -> Path:
    """A bf16 DiT file in ComfyUI's single-file layout, with random weights."""
    state = comfy_dit_state_dict(dit_state_dict(cfg, seed))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(path))
    return path


class SimulatedDevice:
    """Device memory stood in for by shared file mappings in a folder: real memory, but not anonymous (RssFile or
    RssShmem), as a GPU's is not; tensors on it are ordinary CPU tensors, so `param.data` may point at them."""

    def __init__(self, folder: Path):
        self.folder, self.count = folder, 0

    def allocate(self, shape, dtype, device=None) -> torch.Tensor:
        self.count += 1
        numel = 1
        for size in shape:
            numel *= size
        path = self.folder / f"tensor{self.count}"
        return torch.from_file(str(path), shared=True, size=max(1, numel), dtype=dtype)[:numel].view(shape)


# -- host: one scenario, in its own process ----------------------------------------------------------------------------
def _simulated_budget(weights, cfg, run):
    """A device budget that holds about half of the DiT's blocks beside the run (the rest streamed)."""
    from qi21.model.memory.planner import Budget, sampling_phases, spread

    n = len(weights.layers)
    need = max(sampling_phases(weights, cfg, run, 2, spread(n - n // 2, n), "device").values())
    return Budget(need, None, where="a simulated device")


def _warm_up(sample, conditioning) -> None:
    """One tiny bf16 run through the same code, so the first use of each kernel is paid before counting."""
    from qi21.model.transformer.dit import QwenImage21DiT

    tiny = QwenImage21DiT(config(256, 1), dtype=torch.bfloat16).eval()
    for param in tiny.parameters():
        param.data.normal_(0, 0.02)
    text = torch.randn(8, 512).bfloat16()
    sample(tiny, conditioning(text, torch.zeros(8, dtype=torch.bool)), sigmas=torch.linspace(1.0, 0.0, 3), width=64,
           height=64)


def run_scenario(name: str, folder: Path, width: int, layers: int, encoder_layers: int) -> dict:
    from qi21.model.encoders.conditioning import Conditioning
    from qi21.model.loaders.deferred import FileBackedPart
    from qi21.model.loaders.dit import load_dit
    from qi21.model.memory.host import plan_host
    from qi21.model.memory.planner import Budget, LayerPlan, RunShape, plan_run
    from qi21.model.memory.streaming import resident_part
    from qi21.model.memory.weights import dit_weights, run_layers
    from qi21.model.sampling.loop import sample

    cfg = config(width, layers)
    run = RunShape((PROMPT_TOKENS,), (SIZE // 16, SIZE // 16))
    torch.set_grad_enabled(False)
    if name == "cpu-bf16":  # the libraries' one-time state (thread pools, kernel caches) is not the run's memory
        _warm_up(sample, Conditioning)
    base = rss_anon()
    with PeakSampler() as sampler:
        if name == "cpu-bf16":
            model = load_dit(folder / "dit.safetensors", "default", device="cpu")
            weights = dit_weights(model)
            plan = plan_run(weights, cfg, run, Budget(1 << 62, unified=True, where="cpu"), 2)
            predicted, what = plan.sampling_peak, f"weights + one {SIZE} px run"
            text = torch.randn(PROMPT_TOKENS, cfg.context_in_dim, generator=torch.Generator().manual_seed(0))
            sample(model, Conditioning(text.bfloat16(), torch.zeros(PROMPT_TOKENS, dtype=torch.bool)),
                   sigmas=torch.linspace(1.0, 0.0, 3), width=SIZE, height=SIZE)
        else:
            encoder = load_dit(folder / "encoder.safetensors", "default", device="cpu")  # as offloaded to the host
            encoder_weights = dit_weights(encoder)
            deferred = name == "deferred"
            model = load_dit(folder / "dit.safetensors", "default", defer=deferred)
            weights = dit_weights(model)
            plan = plan_run(weights, cfg, run, _simulated_budget(weights, cfg, run), 2)
            host = plan_host(encoder_weights, LayerPlan((), encoder_layers, 0), weights, plan, 0, deferred=deferred)
            predicted, what = host.peak, f"{host.peak_phase}: {host.describe()}"
            device = SimulatedDevice(Path(tempfile.mkdtemp(dir=folder)))
            layers_ = run_layers(model)
            on_host = {id(p) for i in plan.streamed for p in layers_[i].parameters()}
            if deferred:  # each tensor read from the file straight to where the plan puts it
                model.file_weights.materialize(lambda p: "cpu" if id(p) in on_host else "meta",
                                               allocate=lambda shape, dtype, dev: (
                                                   device.allocate(shape, dtype) if str(dev) == "meta"
                                                   else torch.empty(shape, dtype=dtype)))
            else:  # the resident blocks moved from their host copy to the device, one tensor at a time
                for param in model.parameters():
                    if id(param) not in on_host:
                        param.data = device.allocate(param.shape, param.dtype).copy_(param.data)
            placed = rss_anon() - base
            if deferred:  # evicted (ComfyUI's unload): the resident part back to its file
                FileBackedPart(resident_part(model, layers_, plan.streamed), model.file_weights).to("cpu")
    measured = sampler.peak - base
    return {"scenario": name, "predicted_bytes": int(predicted), "measured_bytes": int(measured),
            "ratio": measured / predicted, "what": what,
            "placed_bytes": int(placed) if name != "cpu-bf16" else None,
            "streamed": f"{len(plan.streamed)}/{len(plan.streamed) + plan.resident_blocks}"}


# -- host: the driver --------------------------------------------------------------------------------------------------
def measure(width: int = 1024, layers: int = 12, encoder_layers: int = 10, scenarios=SCENARIOS,
            folder: Path | None = None) -> list[dict]:
    """Write the files, run each scenario in a fresh interpreter, return its rows."""
    with tempfile.TemporaryDirectory(prefix="qi21_host_") as tmp:
        folder = Path(folder or tmp)
        write_file(folder / "dit.safetensors", config(width, layers), seed=0)
        if any(s != "cpu-bf16" for s in scenarios):
            write_file(folder / "encoder.safetensors", config(width, encoder_layers), seed=1)
        rows = []
        for name in scenarios:
            out = subprocess.run([sys.executable, __file__, "host", "--child", name, "--dir", str(folder),
                                  "--width", str(width), "--layers", str(layers), "--encoder-layers",
                                  str(encoder_layers)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            rows[-1]["dit_file_bytes"] = (folder / "dit.safetensors").stat().st_size
        return rows


def host_table(rows) -> str:
    lines = ["| scenario | DiT file | streamed | predicted host peak | measured RssAnon peak | measured / predicted |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['dit_file_bytes'] / 1e6:.0f} MB | {r['streamed']} | "
                     f"{r['predicted_bytes'] / 1e6:.1f} MB | {r['measured_bytes'] / 1e6:.1f} MB | {r['ratio']:.3f} |")
    return "\n".join(lines)


def run_host(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="memory.py host", description=HOST_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--encoder-layers", type=int, default=10)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_scenario(args.child, args.dir, args.width, args.layers, args.encoder_layers)))
        return []
    rows = measure(args.width, args.layers, args.encoder_layers, args.scenarios)
    print(host_table(rows))
    for r in rows:
        print(f"{r['scenario']}: {r['what']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


# -- plan-table: the planner's plans for common GPUs -------------------------------------------------------------------
PLAN_TABLE_HELP = """The memory planner's choices for the released model on common GPUs, as Markdown tables (for
docs/measurements.md).

No GPU or weights needed: the planner works from sizes (model/memory/planner.py). For each card, each workload at
1024x1024 (text-to-image, a one-reference edit, a three-reference edit of 1024x1024 references, a 75-token prompt,
batch 1, cfg 1) and each DiT weight format (bf16; int8: one byte per block linear weight plus a per-row fp32
scale), it prints the plan of every phase, the predicted device peak and the host's peak over the whole pipeline
(model/memory/host.py: the DiT deferred, the text encoder offloaded to host memory after encoding).

Assumptions (flags change them): a card of N GiB gives a run N GiB minus 600 MiB (CUDA context, other processes)
minus ComfyUI's 400 MiB reserve; 64 GiB of host RAM; the bf16 Qwen3-VL 8B text encoder; the released VAE in bf16.

    python benchmarks/memory.py plan-table [--cards 8 12 16 24 48 80] [--host-gib 64] [--format bf16 int8]
"""

WORKLOADS = (("t2i", 0), ("edit, 1 ref", 1), ("edit, 3 refs", 3))
TEXT_TOKENS, TEMPLATE_TOKENS = 75, 64


def plan_rows(cards, host_gib: float, formats, size: int = 1024):
    config, itemsize = DiTConfig(), 2
    encoder = synthetic_encoder_weights()
    vae = VAEShape.released(itemsize)
    for fmt in formats:
        weights = synthetic_dit_weights(config, fmt)
        for card in cards:
            budget = Budget.gpu(int(card * GIB), host_bytes=int(host_gib * GIB))
            for name, refs in WORKLOADS:
                run = RunShape.released(size, refs, TEXT_TOKENS)
                tokens = TEXT_TOKENS + TEMPLATE_TOKENS + refs * (size // 32) ** 2
                transient = encode_transient(EncoderDims(), tokens, refs * (size // 16) ** 2, itemsize)
                try:
                    te = plan_layers(encoder, transient, budget)
                    te_label, te_peak = te.label, te.peak
                except PlanError:
                    te, te_label, te_peak = None, "does not fit", None
                try:
                    plan = plan_run(weights, config, run, budget, itemsize, vae=vae)
                except PlanError:
                    yield (fmt, card, name, te_label, "does not fit", "", "", None, te_peak, None, None, None)
                    continue
                phases = plan.phases
                sampling = max(phases.get("prefill", 0), phases.get("cached", 0))
                host = None if te is None else plan_host(encoder, te, weights, plan, vae.weight_bytes).peak
                yield (fmt, card, name, te_label, plan.weights_label, plan.cache, plan.decode, sampling, te_peak,
                       phases["decode"], plan.copied_per_step, host)


def gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"


def plan_markdown(cards, host_gib, formats) -> str:
    lines = []
    current = None
    for row in plan_rows(cards, host_gib, formats):
        fmt = row[0]
        if fmt != current:
            current = fmt
            lines += ["", f"**DiT weights {fmt}** ({synthetic_dit_weights(DiTConfig(), fmt).total / GIB:.1f} GiB)",
                      "",
                      "| GPU | workload | text encoder | DiT weights | prefix cache | decode | peak GiB: encode / "
                      "sample / decode | copied per step | host peak GiB |",
                      "|---|---|---|---|---|---|---|---|---|"]
        _, card, name, te, weights, cache, decode, sampling, te_peak, dec, copied, host = row
        moved = "-" if copied is None else ("0" if copied == 0 else f"{copied / GIB:.1f} GiB")
        lines.append(f"| {card} GB | {name} | {te} | {weights} | {cache} | {decode} | {gib(te_peak)} / "
                     f"{gib(sampling)} / {gib(dec)} | {moved} | {gib(host)} |")
    return "\n".join(lines).lstrip()


def run_plan_table(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="memory.py plan-table", description=PLAN_TABLE_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cards", type=float, nargs="+", default=[8, 12, 16, 24, 48, 80], help="GPU sizes in GiB")
    parser.add_argument("--host-gib", type=float, default=64, help="host RAM available for pinned weights")
    parser.add_argument("--format", nargs="+", default=["bf16", "int8"], choices=["bf16", "fp16", "fp8", "int8"])
    args = parser.parse_args(argv)
    cards = [int(c) if c == int(c) else c for c in args.cards]
    print(plan_markdown(cards, args.host_gib, args.format))


# -- load-checks: what the load-time checks cost -----------------------------------------------------------------------
LOAD_CHECKS_HELP = """What the load-time checks of issue "Reliability III" cost, at real sizes, in one run.

1. The NaN/inf check (model/loaders/finite.py) on one 4096 x 12288 tensor (the released DiT's MLP weight) in
   bf16, as fp8_e4m3fn and as Q8_0 blocks (its block scales only), next to a plain copy of the same bytes (what
   reading the tensor costs anyway); medians of interleaved runs.
2. The GGUF metadata bombs (a 170-byte file declaring 2^40 array elements; a valid 10 MB file holding a
   10M-element array): each loaded through `load_dit` in a fresh process, its time and peak resident memory
   (ru_maxrss) against the same process before the load; and the gguf package's own reader on the same file
   (what the loader ran before the pre-scan), under a 4 GiB address-space limit and a 20 s timeout.

    python benchmarks/memory.py load-checks [--threads 2]
"""

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


def run_child(code: str, timeout: float) -> str:
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"still running after {timeout:.0f} s (killed)"
    return (done.stdout.strip() or done.stderr.strip().splitlines()[-1])[:300]


def run_load_checks(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="memory.py load-checks", description=LOAD_CHECKS_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch threads: {args.threads}")
    reduction_costs()
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in bombs(Path(tmp)).items():
            print(f"{name} ({path.stat().st_size:,} bytes)")
            print("  load_dit (pre-scan):   " + run_child(CHILD.format(benchmarks=str(REPO / "benchmarks"),
                                                                   path=str(path)), 60))
            print("  gguf package's reader: " + run_child(PACKAGE_ONLY.format(path=str(path)), 20))


QUESTIONS = {"host": run_host, "plan-table": run_plan_table, "streaming": weight_streaming.run,
             "load-checks": run_load_checks}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in QUESTIONS:
        raise SystemExit(f"usage: memory.py {{{','.join(QUESTIONS)}}} [options]\n\n{__doc__}")
    return QUESTIONS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
