"""Host memory: the planner's predicted host peak (model/memory/host.py) against the anonymous memory the process
really holds (RssAnon in /proc/self/status, sampled every half millisecond), on the CPU, with bf16 DiT files of the
released architecture at a smaller width.

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

    python benchmarks/host_memory.py [--width 1024] [--layers 12] [--encoder-layers 10] [--json rows.json]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from qi21.demo.tiny_checkpoints import comfy_dit_state_dict, dit_state_dict
from qi21.model.transformer.dit import DiTConfig

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


# -- one scenario, in its own process --------------------------------------------------------------------------------
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


# -- the driver ------------------------------------------------------------------------------------------------------
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
            out = subprocess.run([sys.executable, __file__, "--child", name, "--dir", str(folder), "--width",
                                  str(width), "--layers", str(layers), "--encoder-layers", str(encoder_layers)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            rows[-1]["dit_file_bytes"] = (folder / "dit.safetensors").stat().st_size
        return rows


def table(rows) -> str:
    lines = ["| scenario | DiT file | streamed | predicted host peak | measured RssAnon peak | measured / predicted |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['dit_file_bytes'] / 1e6:.0f} MB | {r['streamed']} | "
                     f"{r['predicted_bytes'] / 1e6:.1f} MB | {r['measured_bytes'] / 1e6:.1f} MB | {r['ratio']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    print(table(rows))
    for r in rows:
        print(f"{r['scenario']}: {r['what']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
