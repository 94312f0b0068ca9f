"""The one-call device check: every CUDA path of the pack, correctness first, then memory and speed, in one run.

On a GPU (bf16, the released width, 1024x1024 targets, references of 1024x1024) it prints one table per section:
- `streaming`: streamed vs resident weights and the host prefix cache under memory caps, bit-identical or not, the
  planner's predicted peak against the measured one (`memory.py streaming`, run first on an empty GPU);
- `bf16`: our whole DiT against diffusers' on the same weights: prefill and cached step (ms) with 0 / 1 / 2
  references, and how far the two velocities are apart (the bf16 drift every fast path is judged against);
- `formats`: int8 ConvRot, fp8, W4A8 (comfy-kitchen's kernels), GGUF Q8_0 and Q4_K, a LoRA: each model against a
  plain bf16 model holding its own dequantized (and merged) weights, and its prefill / cached step next to
  diffusers' bf16 (`--format-layers` blocks at full width: files are written and read, so not all 32);
- `drift`: the cached velocity in bf16 against fp32 on the same weights, ours and diffusers' (what the `bf16`
  section's difference between the two is read against: random weights amplify rounding with depth);
- `planner`: the planner's predicted device peak per phase (prefill, cached step, decode) against
  `torch.cuda.max_memory_allocated` around each, and a decode's peak at three sizes, one pass and tiled;
- `cache`: the host-side prefix cache against the device one (same latents? seconds per step);
- `cache_quant`: the int8 / int4 prefix cache: a cached step's time and its velocity against the model-dtype cache;
- `e2e`: whole images, 40-step Base and 8-step Turbo, sampling and VAE decode (random weights, text states given:
  the text encoder is not run);
- `host`: per cached step (1 reference), ours and diffusers': the kernels it launches, the host's time to issue them
  and the step's time; an issue time near the step time means the host, not the GPU, sets the pace;
- `compiled`: the cached step eager, with compiled blocks and with compiled blocks replayed as CUDA graphs (the
  loader's `compile` option), next to diffusers': ms, the cold compile's seconds, the difference to eager
  (parts/gpu_check_compiled.py);
- `fp8`: the cached step in bf16, `fp8_e4m3fn_fast` (torch._scaled_mm, per-row scales) and int8 ConvRot on each int8
  engine (comfy-kitchen, torch._int_mm), eager and compiled, against our bf16 eager step (parts/gpu_check_fp8.py).
Each section has a time budget it is sized for (`BUDGET_S`); one that fails is reported with its error and the run goes
on, so one call gives every result. `--sections` picks some; `--json` also writes the rows.

    python benchmarks/gpu_check.py                  # on an H200: about 4 minutes, one call
    python benchmarks/gpu_check.py --dry-run        # CPU, tiny widths, every path reached (CI runs this)

`--dry-run` runs the same code on the CPU with a 2-block, 256-wide model at 128x128: no number it prints says anything
about a GPU (measured peaks print "n/a (CPU)"); it checks that every path runs and agrees with its twin.
"""

import argparse
import dataclasses
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from parts.gpu_check_common import Check, dit_calls, gib, rel_diff, table
from qi21.model.memory.estimate import GIB, VAEShape, decode_transient
from qi21.model.memory.planner import Budget, RunShape, plan_run
from qi21.model.memory.streaming import StreamedRun
from qi21.model.memory.weights import dit_weights
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.prefix_cache.storage_formats import cache_storage
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import base_sigmas, turbo_sigmas
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT
from qi21.model.vae.autoencoder import QwenImage21VAE, QwenImage21VAEConfig, VAETiling
from qi21.model.vae.latents import RELEASED_LATENT_FORMAT

SECTIONS = ("streaming", "bf16", "drift", "formats", "planner", "cache", "cache_quant", "e2e", "host", "compiled",
            "fp8")
#: seconds each section is sized for on an H200: about twice what each took there on 2026-12-04 (torch 2.11; 14, 38,
#: 27, 44, 20, 4, -, 7, 5 and 34 s, cold compiles included; cache_quant was added after that run)
BUDGET_S = {"streaming": 60, "bf16": 60, "drift": 60, "formats": 90, "planner": 40, "cache": 20, "cache_quant": 30,
            "e2e": 30, "host": 20, "compiled": 60, "fp8": 240}  # fp8: not yet run on a GPU (8 cold compiles)
#: the dry run's model: two blocks, heads of 128 (RoPE's 16/56/56), inputs a multiple of 256 (ConvRot, Q4_K)
DRY_DIT = DiTConfig(num_layers=2, num_heads=2, head_dim=128, context_in_dim=256, mlp_ratio=3)
DRY_VAE = QwenImage21VAEConfig(base_dim=4, decoder_base_dim=6)


# -- sections -----------------------------------------------------------------------------------------------------
def section_streaming(check: Check) -> list[dict]:
    from parts import weight_streaming

    check.release()  # the caps limit the whole process: nothing else may sit on the GPU
    args = ["--dry-run", "--steps", "2", "--references", "1"] if check.dry_run else \
        ["--caps", "12", "24", "--references", "1", "--steps", "3"]
    print("\n### streaming: streamed / host cache vs resident (memory.py streaming " + " ".join(args) + ")\n")
    return weight_streaming.run(args)


def section_bf16(check: Check) -> list[dict]:
    reference, ours = check.pair()
    rows = []
    with torch.inference_mode():
        for refs in (0, 1, 2):
            _, prefix, target, kwargs = check.case(refs)
            our_prefill, our_step, their_prefill, their_step = dit_calls(check, reference, ours, prefix, target, kwargs)
            times = {name: check.median_ms(fn) for name, fn in
                     (("ours prefill", our_prefill), ("diffusers prefill", their_prefill),
                      ("ours cached", our_step), ("diffusers cached", their_step))}
            rows.append({"references": refs, "prefix": prefix.layout.prefix_len, **times,
                         "rel_diff_cached": rel_diff(our_step(), their_step())})
    table(f"bf16: our DiT vs diffusers' ({ours.config.num_layers} blocks, {check.size}x{check.size}, ms)",
          ["refs", "prefix tokens", "prefill ours / diffusers", "cached step ours / diffusers", "cached ratio",
           "rel. diff of the cached velocity"],
          [[r["references"], r["prefix"], f"{r['ours prefill']:.1f} / {r['diffusers prefill']:.1f}",
            f"{r['ours cached']:.1f} / {r['diffusers cached']:.1f}",
            f"{r['ours cached'] / r['diffusers cached']:.3f}", f"{r['rel_diff_cached']:.2e}"] for r in rows])
    return rows


def section_drift(check: Check) -> list[dict]:
    """How far bf16 moves the cached velocity from the same weights in fp32, ours and diffusers' alike: the yardstick
    the bf16 section's difference between the two is read against (random weights amplify rounding with depth)."""
    from parts.gpu_check_common import random_pair

    check.release()
    # built in fp32 with bf16-valued weights: building in bf16 would also round diffusers' fp32 timestep-frequency
    # buffer, and the fp32 pass would no longer be the truth
    reference, ours = random_pair(check.config, check.config.num_layers, check.device, torch.float32)
    with torch.no_grad():
        for param in [*reference.parameters(), *ours.parameters()]:
            param.copy_(param.to(torch.bfloat16))
    _, prefix, target, kwargs = check.case(1)
    velocities = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):  # the same weights either way: only the arithmetic moves
            reference.to(dtype)
            ours.to(dtype)
            ours.compute_dtype = dtype
            cast = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
            cast_prefix = dataclasses.replace(prefix, text=prefix.text.to(dtype),
                                              references=prefix.references.to(dtype))  # case(1): one reference
            calls = dit_calls(check, reference, ours, cast_prefix, target.to(dtype), cast)
            calls[0](), calls[2]()  # prefill both caches
            velocities["ours", dtype], velocities["diffusers", dtype] = calls[1]().float(), calls[3]().float()
    del reference, ours
    check.release()
    truth = velocities["ours", torch.float32]
    rows = [{"pair": name, "rel_diff": rel_diff(velocities[key], truth)} for name, key in
            (("diffusers fp32 vs ours fp32", ("diffusers", torch.float32)),
             ("ours bf16 vs ours fp32", ("ours", torch.bfloat16)),
             ("diffusers bf16 vs ours fp32", ("diffusers", torch.bfloat16)))]
    rows.append({"pair": "ours bf16 vs diffusers bf16",
                 "rel_diff": rel_diff(velocities["ours", torch.bfloat16], velocities["diffusers", torch.bfloat16])})
    table(f"drift: the cached velocity in bf16 against fp32 on the same (bf16-valued) weights "
          f"({check.config.num_layers} blocks, 1 reference, {check.size}x{check.size})",
          ["pair", "relative difference"], [[r["pair"], f"{r['rel_diff']:.2e}"] for r in rows])
    return rows


def section_formats(check: Check) -> list[dict]:
    from parts import gpu_check_formats

    return gpu_check_formats.run(check)


def section_compiled(check: Check) -> list[dict]:
    from parts import gpu_check_compiled

    return gpu_check_compiled.run(check)


def section_fp8(check: Check) -> list[dict]:
    from parts import gpu_check_fp8

    return gpu_check_fp8.run(check)


def planned_phases(check: Check, ours, cond, batch: int = 1) -> dict[str, int]:
    grid = check.grid
    run = RunShape((cond.layout(grid).prefix_len,), grid, batch=batch,
                   reference_tokens=tuple(h * w for h, w in cond.ref_shapes))
    itemsize = torch.empty((), dtype=check.dtype).element_size()
    budget = Budget(1 << 50, host=None, unified=not check.cuda, where=str(check.device))
    vae = VAEShape.released(itemsize) if not check.dry_run else VAEShape.of(check_vae(check))
    return plan_run(dit_weights(ours), ours.config, run, budget, itemsize, choice="resident", vae=vae).phases


def check_vae(check: Check) -> QwenImage21VAE:
    """A random VAE of the released shape (the dry run's: 4/6 channels wide), on the device, kept."""
    if "vae" not in check.built:
        torch.manual_seed(0)
        config = DRY_VAE if check.dry_run else QwenImage21VAEConfig()
        check.built["vae"] = QwenImage21VAE(config).to(device=check.device, dtype=check.dtype).eval()
    return check.built["vae"]


def section_planner(check: Check) -> list[dict]:
    ours = our_model(check)
    check.built.pop(("pair", ours.config.num_layers), None)  # diffusers' weights off the device: only ours counts
    check.release()
    check.built["ours"] = ours
    cond, prefix, target, _ = check.case(1)
    phases = planned_phases(check, ours, cond)
    weights = sum(p.numel() * p.element_size() for p in ours.parameters())
    cache = PrefixKVCache()
    t = torch.tensor([0.8], device=check.device)
    vae = check_vae(check)
    vae_bytes = sum(p.numel() * p.element_size() for p in vae.parameters())
    with torch.inference_mode():
        _, prefill = check.peak(lambda: ours(target, t, [prefix], cache=cache, mode="prefill"))
        velocity, step = check.peak(lambda: ours(target, t, [prefix], cache=cache, mode="cached"))
        held = cache.nbytes
        latents = RELEASED_LATENT_FORMAT.denormalize(velocity.transpose(1, 2).reshape(1, 64, *check.grid))
        cache.free()
        del velocity
        _, decode = check.peak(lambda: vae.decode(latents, tiled=False))
    measured = {"prefill": None if prefill is None else weights + prefill,
                "cached": None if step is None else weights + held + step,
                "decode": None if decode is None else vae_bytes + decode}
    rows = [{"phase": phase, "predicted_gib": phases[phase] / GIB,
             "measured_gib": None if measured[phase] is None else measured[phase] / GIB} for phase in measured]
    table(f"planner: predicted vs measured device peak per phase (1 reference, {check.size}x{check.size}, GiB)",
          ["phase", "predicted", "measured", "measured / predicted"],
          [[r["phase"], f"{r['predicted_gib']:.2f}", gib(measured[r["phase"]]),
            "n/a (CPU)" if r["measured_gib"] is None else f"{r['measured_gib'] / r['predicted_gib']:.3f}"]
           for r in rows])
    print("measured: the step's own peak above what was allocated before it, plus what the phase holds (the DiT's "
          "weights, and in the cached step the prefix cache it reads; the VAE's weights for the decode)")
    return rows + decode_sizes(check, vae)


def decode_sizes(check: Check, vae: QwenImage21VAE) -> list[dict]:
    """The decode's own peak by image size, one pass and tiled, against the planner's `decode_transient`: whether
    the planner's per-pixel figure (set from an H200 run; a CPU holds less) holds on this device."""
    shape = VAEShape.of(vae)
    sides = (64, 128, 256) if check.dry_run else (512, 1024, 2048)
    rows = []
    with torch.inference_mode():
        for side, tiled in [(side, False) for side in sides] + [(sides[-1], True)]:
            grid = (side // 16, side // 16)
            latents = torch.randn(1, vae.config.z_dim, *grid, device=check.device, dtype=check.dtype)
            tiling = VAETiling(tile=max(2, grid[0] // 2), overlap=max(1, grid[0] // 8))  # 4 tiles and more
            _, peak = check.peak(lambda z=latents, t=tiled, tiles=tiling: vae.decode(z, tiled=t, tiling=tiles))
            predicted = decode_transient(dataclasses.replace(shape, tiling=tiling), 1, grid, tiled)
            rows.append({"phase": f"decode {side}x{side} {'tiled' if tiled else 'one pass'}",
                         "predicted_gib": predicted / GIB, "measured_gib": None if peak is None else peak / GIB})
    table("planner: a decode's own peak by size (GiB; above the VAE's weights)",
          ["decode", "predicted", "measured", "measured / predicted"],
          [[r["phase"], f"{r['predicted_gib']:.3f}",
            "n/a (CPU)" if r["measured_gib"] is None else f"{r['measured_gib']:.3f}",
            "n/a (CPU)" if r["measured_gib"] is None else f"{r['measured_gib'] / r['predicted_gib']:.3f}"]
           for r in rows])
    return rows


def our_model(check: Check) -> QwenImage21DiT:
    if "ours" not in check.built:
        check.built["ours"] = check.pair()[1]
    return check.built["ours"]


def section_cache(check: Check) -> list[dict]:
    ours = our_model(check)
    cond = check.case(1)[0]
    rows, baseline = [], None
    for where in ("device", "host"):
        with torch.inference_mode(), StreamedRun(ours, (), where, check.device) as streamed:
            result = sample(ours, cond, sigmas=turbo_sigmas()[:4], width=check.size, height=check.size,
                            noise=initial_noise(0, 1, check.size, check.size), new_cache=streamed.new_cache)
        latents = result.latents.float().cpu()
        baseline = latents if baseline is None else baseline
        rows.append({"cache": where, "step_seconds": result.report["step_seconds"],
                     "prefill_seconds": result.report["prefill_seconds"],
                     "bit_identical": bool(torch.equal(latents, baseline)),
                     "max_abs_diff": float((latents - baseline).abs().max())})
    table("cache: the host-side prefix cache vs the device one (3 Turbo steps, 1 reference)",
          ["cache", "prefill s", "s / cached step", "vs device", "bit-identical", "max abs diff"],
          [[r["cache"], r["prefill_seconds"], r["step_seconds"], f"{r['step_seconds'] / rows[0]['step_seconds']:.3f}",
            r["bit_identical"], f"{r['max_abs_diff']:.3g}"] for r in rows])
    return rows


def section_cache_quant(check: Check) -> list[dict]:
    """The int8 / int4 prefix cache (issue 32) on this device: a cached step's time and how far its velocity moves
    from the model-dtype cache, 1 and 2 references."""
    ours = our_model(check)
    t_fill, t_step = torch.tensor([1.0], device=check.device), torch.tensor([0.5], device=check.device)
    rows = []
    with torch.inference_mode():
        for refs in (1, 2):
            _, prefix, target, _ = check.case(refs)
            caches, calls = {}, {}
            for storage in ("default", "int8", "int4"):
                cache = caches[storage] = PrefixKVCache()
                cache.storage = cache_storage(storage)
                ours(target, t_fill, [prefix], cache=cache, mode="prefill")
                calls[storage] = lambda c=cache, x=target, p=prefix: ours(x, t_step, [p], cache=c, mode="cached")
            plain = calls["default"]()
            for storage, call in calls.items():
                rows.append({"references": refs, "cache": storage, "ms": check.median_ms(call),
                             "bytes": caches[storage].nbytes, "rel_diff": rel_diff(call(), plain)})
            for cache in caches.values():
                cache.free()
    base = {r["references"]: r for r in rows if r["cache"] == "default"}
    table(f"cache_quant: the int8 / int4 prefix cache, one cached step ({ours.config.num_layers} blocks, "
          f"{check.size}x{check.size}, ms)",
          ["refs", "cache", "ms per step", "vs model-dtype cache", "cache MiB", "rel. diff vs model-dtype cache"],
          [[r["references"], r["cache"], f"{r['ms']:.1f}", f"{r['ms'] / base[r['references']]['ms']:.3f}",
            f"{r['bytes'] / 2**20:.1f}", f"{r['rel_diff']:.2e}"] for r in rows])
    return rows


def section_e2e(check: Check) -> list[dict]:
    ours, vae = our_model(check), check_vae(check)
    cond = check.case(0)[0]
    rows = []
    runs = (("Base, 40 steps", base_sigmas(40, check.size, check.size)), ("Turbo, 8 steps", turbo_sigmas()))
    for name, sigmas in runs:
        check.sync()
        start = time.perf_counter()
        with torch.inference_mode():
            result = sample(ours, cond, sigmas=sigmas, width=check.size, height=check.size, seed=0)
            check.sync()
            sampled = time.perf_counter()
            pixels = vae.decode(RELEASED_LATENT_FORMAT.denormalize(result.latents)).float().cpu()
        end = time.perf_counter()
        rows.append({"run": name, "sample_s": sampled - start, "decode_s": end - sampled, "total_s": end - start,
                     "prefill_s": result.report["prefill_seconds"], "step_s": result.report["step_seconds"],
                     "finite": bool(torch.isfinite(pixels).all())})
    table(f"e2e: whole images, {check.size}x{check.size}, text-to-image (text states given, random weights, s)",
          ["run", "sampling", "prefill", "per cached step", "decode", "total", "finite"],
          [[r["run"], f"{r['sample_s']:.2f}", r["prefill_s"], r["step_s"], f"{r['decode_s']:.2f}",
            f"{r['total_s']:.2f}", r["finite"]] for r in rows])
    return rows


def section_host(check: Check) -> list[dict]:
    from speed import KernelCount

    reference, ours = check.pair()
    _, prefix, target, kwargs = check.case(1)
    rows = []
    with torch.inference_mode():
        our_prefill, our_step, their_prefill, their_step = dit_calls(check, reference, ours, prefix, target, kwargs)
        our_prefill()
        their_prefill()
        for side, step in (("ours", our_step), ("diffusers", their_step)):
            step()
            with KernelCount() as count:
                step()
            issued = []
            for _ in range(check.repeats):
                check.sync()
                start = time.perf_counter()
                step()  # no sync: the time the host takes to issue the step (all of it on a CPU)
                issued.append((time.perf_counter() - start) * 1e3)
            check.sync()
            kernels = sum(count.ops.values())
            rows.append({"side": side, "kernels": kernels, "kernels_per_block": kernels / ours.config.num_layers,
                         "issue_ms": statistics.median(issued), "step_ms": check.median_ms(step)})
    table(f"host: what a cached step asks of the host ({ours.config.num_layers} blocks, 1 reference)",
          ["side", "kernels per step", "per block", "host ms to issue", "ms per step", "issue / step"],
          [[r["side"], r["kernels"], f"{r['kernels_per_block']:.1f}", f"{r['issue_ms']:.1f}", f"{r['step_ms']:.1f}",
            f"{r['issue_ms'] / r['step_ms']:.2f}"] for r in rows])
    return rows


RUNNERS = {"streaming": section_streaming, "bf16": section_bf16, "drift": section_drift, "formats": section_formats,
           "planner": section_planner, "cache": section_cache, "cache_quant": section_cache_quant,
           "e2e": section_e2e, "host": section_host, "compiled": section_compiled, "fp8": section_fp8}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny widths: every path, no GPU numbers")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--layers", type=int, default=None, help="DiT blocks (default: 32; the dry run: 2)")
    parser.add_argument("--format-layers", type=int, default=2, help="blocks of the per-format models")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per median (GPU 5, dry run 1)")
    parser.add_argument("--json", type=Path, help="also write every section's rows here")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, dtype, config, size = torch.device("cpu"), torch.float32, DRY_DIT, 128
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --dry-run on a CPU.")
        device, dtype, config, size = torch.device("cuda"), torch.bfloat16, DiTConfig(), 1024
    if args.layers:
        config = DiTConfig(**{**config.__dict__, "num_layers": args.layers})
    check = Check(device, dtype, config, size, args.repeats or (1 if args.dry_run else 5),
                  min(args.format_layers, config.num_layers), args.dry_run)
    name = torch.cuda.get_device_name(device) if check.cuda else "CPU (dry run: tiny widths, no GPU numbers)"
    print(f"# gpu_check on {name}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, "
          f"{config.num_layers} blocks of width {config.width}, {size}x{size}; sections: {' '.join(args.sections)}")
    results, started, threads = {}, time.perf_counter(), torch.get_num_threads()
    if args.dry_run:
        torch.set_num_threads(1)  # tiny GEMMs: threads only contend (restored below, for callers in-process)
    try:
        for section in args.sections:
            run_section(check, section, results)
    finally:
        torch.set_num_threads(threads)
    failed = [s for s, r in results.items() if not r["ok"]]
    print(f"\n# done in {time.perf_counter() - started:.0f} s; failed sections: {', '.join(failed) or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return results


def run_section(check: Check, section: str, results: dict) -> None:
    """Run one section into `results[section]`; a failure is printed with its traceback and recorded, not raised."""
    begin = time.perf_counter()
    try:
        rows = RUNNERS[section](check)
        results[section] = {"ok": True, "rows": rows}
    except Exception as error:  # one failing section is reported; the others still run
        results[section] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        print(f"\n### {section}: FAILED\n\n```\n{traceback.format_exc(limit=6)}```")
    spent = time.perf_counter() - begin
    results[section]["seconds"] = round(spent, 1)
    over = "" if check.dry_run or spent <= BUDGET_S[section] else f" (over its {BUDGET_S[section]} s budget)"
    print(f"\n[{section}: {'ok' if results[section]['ok'] else 'FAILED'} in {spent:.1f} s{over}]", flush=True)


if __name__ == "__main__":
    results = main()
    raise SystemExit(1 if any(not r["ok"] for r in results.values()) else 0)
