"""Weight streaming on a GPU: the planner's plan under memory caps, the peak it predicted against the peak measured,
seconds per step against the resident run, and whether the latents are bit-identical.

For each cap (8 / 12 / 16 / 24 GiB by default) the process is limited with `torch.cuda.set_per_process_memory_fraction`,
the planner is given that budget, and a short Turbo run (random full-size bf16 DiT, 1024x1024, `--references`
1024x1024 references, 75 text tokens) samples under the plan it picks: blocks streamed from pinned host memory on a
side stream, the prefix cache on the device or the host. The resident run (no cap) is the baseline.

    python benchmarks/memory.py streaming [--caps 8 12 16 24] [--references 0 1] [--steps 4] [--json out.json]
    python benchmarks/memory.py streaming --dry-run     # CPU, tiny model: the same code path, for the tests

Needs about 14 GiB of GPU memory for the uncapped baseline and 14 GiB of pinned host memory. `--dry-run` runs on the
CPU with a 4-block model and three simulated budgets (all resident, halfway, the leanest plan); no GPU needed.
gpu_check.py's `streaming` section runs this first, on an empty GPU (its caps limit the whole process).
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch

import bench_pack  # noqa: E402,F401  (registers the repository as package `qi21`)
from qi21.model.encoders.conditioning import Conditioning  # noqa: E402
from qi21.model.memory.estimate import GIB  # noqa: E402
from qi21.model.memory.planner import Budget, RunShape, least_memory, plan_run, sampling_phases
from qi21.model.memory.streaming import StreamedRun, place_layers  # noqa: E402
from qi21.model.memory.weights import dit_weights
from qi21.model.sampling.loop import initial_noise, sample  # noqa: E402
from qi21.model.sampling.schedule import turbo_sigmas  # noqa: E402
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT  # noqa: E402

TINY = DiTConfig(num_layers=4, num_heads=2, head_dim=64, context_in_dim=64, mlp_ratio=3, axes_dims_rope=(8, 28, 28))


def random_model(config: DiTConfig, device, dtype) -> QwenImage21DiT:
    """A DiT with random weights (scaled like trained ones, so 8 steps stay finite), built on `device`."""
    generator = torch.Generator(device).manual_seed(0)
    model = QwenImage21DiT(config, device=device, dtype=dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator, device=device))
            else:
                param.copy_(torch.randn(param.shape, generator=generator, device=device) / math.sqrt(param.shape[1]))
    return model


def conditioning(config: DiTConfig, references: int, size: int, text_tokens: int = 75) -> Conditioning:
    generator = torch.Generator().manual_seed(1)
    grid = size // 16
    slots = [False] * 5
    for _ in range(references):
        slots += [True] * (grid * grid // 4) + [False] * 2
    slots += [False] * (text_tokens - len([s for s in slots if not s]))
    tokens = references * grid * grid
    return Conditioning(text=torch.randn(len(slots), config.context_in_dim, generator=generator),
                        image_slots=torch.tensor(slots),
                        references=torch.randn(tokens, 64, generator=generator) if tokens else None,
                        ref_shapes=((grid, grid),) * references)


def run_once(model, cond, size: int, plan, device, steps: int):
    """(latents, report, measured peak or None) of one run under `plan` (None: everything resident)."""
    streamed, cache = (plan.streamed, plan.cache) if plan is not None else ((), "device")
    place_layers(model, model.blocks, streamed, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # blocks just moved out must not count against the cap as cached memory
        torch.cuda.reset_peak_memory_stats(device)
    sigmas = turbo_sigmas()[: steps + 1]  # the first `steps` of Turbo's 8 (a partly denoised latent: fine here)
    start = time.perf_counter()
    with torch.no_grad(), StreamedRun(model, streamed, cache, device) as streamed_run:
        result = sample(model, cond, sigmas=sigmas, width=size, height=size, noise=initial_noise(0, 1, size, size),
                        new_cache=streamed_run.new_cache, add_noise=True)
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return result.latents.float().cpu(), {**result.report, "wall_seconds": round(wall, 3)}, peak


def budgets(args, model, run, itemsize, device):
    """(label, Budget or None for the uncapped baseline, cap in bytes or None)."""
    out = [("resident (no cap)", None, None)]
    if args.dry_run:
        weights = dit_weights(model)
        low = least_memory(weights, model.config, run, itemsize)
        high = max(sampling_phases(weights, model.config, run, itemsize, (), "device").values())
        for label, f in (("simulated: all fits", 1.0), ("simulated: halfway", 0.5), ("simulated: leanest", 0.0)):
            out.append((label, Budget(int(low + f * (high - low)), 1 << 40, where="cpu (simulated)"), None))
        return out
    for cap in args.caps:
        cap_bytes = int(cap * GIB)
        budget = Budget(cap_bytes - args.reserve_mib * 2**20, host=None, where=f"{cap:g} GiB cap")
        out.append((f"{cap:g} GiB cap", budget, cap_bytes))
    return out


def run(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="memory.py streaming", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", type=float, nargs="+", default=[8, 12, 16, 24], help="GPU memory caps in GiB")
    parser.add_argument("--references", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=4, help="Turbo steps per run (the first N of its 8 sigmas)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--reserve-mib", type=int, default=400, help="kept back from each cap (ComfyUI's reserve)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, simulated budgets (no GPU)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)

    if args.dry_run:
        device, dtype, config = torch.device("cpu"), torch.float32, TINY
        args.size = min(args.size, 128)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --dry-run on a CPU (the GPU measurements need a GPU).")
        device, dtype, config = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, DiTConfig()
    itemsize = torch.empty((), dtype=dtype).element_size()
    model = random_model(config, device, dtype)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    rows = []
    for refs in args.references:
        cond = conditioning(config, refs, args.size)
        grid = (args.size // 16, args.size // 16)
        run = RunShape((cond.layout(grid).prefix_len,), grid, reference_tokens=tuple(h * w for h, w in cond.ref_shapes))
        baseline = None
        for label, budget, cap in budgets(args, model, run, itemsize, device):
            plan = None if budget is None else plan_run(dit_weights(model), config, run, budget, itemsize)
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap / total), device)
            latents, report, peak = run_once(model, cond, args.size, plan, device, args.steps)
            if baseline is None:
                baseline = (latents, report)
            predicted = (plan.sampling_peak if plan is not None else
                         max(sampling_phases(dit_weights(model), config, run, itemsize, (), "device",
                                             device.type == "cpu").values()))
            row = {
                "references": refs, "budget": label,
                "plan": plan.report() if plan is not None else {"weights": "resident", "cache": "device"},
                "predicted_peak_gib": round(predicted / GIB, 3),
                "measured_peak_gib": None if peak is None else round(peak / GIB, 3),
                "step_seconds": report["step_seconds"], "prefill_seconds": report["prefill_seconds"],
                "step_vs_resident": (round(report["step_seconds"] / baseline[1]["step_seconds"], 3)
                                     if report["step_seconds"] and baseline[1]["step_seconds"] else None),
                "bit_identical": bool(torch.equal(latents, baseline[0])),
                "max_abs_diff": float((latents - baseline[0]).abs().max()),
            }
            rows.append(row)
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    print("| refs | budget | weights | cache | predicted peak GiB | measured peak GiB | s/step | vs resident | "
          "bit-identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        measured = "-" if r["measured_peak_gib"] is None else r["measured_peak_gib"]
        print(f"| {r['references']} | {r['budget']} | {r['plan']['weights']} | {r['plan']['cache']} | "
              f"{r['predicted_peak_gib']} | {measured} | {r['step_seconds']} | {r['step_vs_resident']} | "
              f"{r['bit_identical']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows
