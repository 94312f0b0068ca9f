"""Our step methods against the peers' caches, on the trained toy (demo/toy), whole prompts, interleaved:

    python benchmarks/step_cache_peers.py [--prompts 14] [--edits 16] [--seed 7] [--steps 40] [--cfg 1] [--passes 3]
        [--calibrate-cfg 1] [--threads 1]
        [--only LABEL,...] [--no-diffusers | --no-ours] [--task t2i|edit] [--json FILE] [--merge FILE ...]
        [--no-measure] [--plot docs/images/step_cache_curve.png]
        [--turbo]   (the Turbo model, 8 steps: masks instead of schedules, no peers)
        [--schedules FILE]   (write the calibrated schedules, the presets' source; --calibrated FILE reads them)

Cases (the defaults): the issue's yardstick, its 20 pictures (quality.py `cases`, seed 7: 14 prompts and 6 edits)
plus 10 more edits with references (`--edits 16`: the same draw's next 10; each edit's reference is its source
scene), 40 Base steps, 256 px, cfg 1 (`--cfg 4`: true CFG against the empty prompt, ours batched, diffusers' loop
one call per prompt). None of them calibrates anything (the schedules are chosen on `cases(seed=99)`, below);
`--seed N` draws other cases, held out from the presets' pick too (made on seed 7's curve).
Each case runs, in a rotating order, the exact path (no step cache) and every setting of `settings()`, `--passes`
times (each pass in another rotation; the pictures of the first pass are judged, they are the same each pass); a run
is the whole prompt: the text (and reference) encoded, sampled, decoded. Per setting: PSNR / SSIM of the RGBA
picture against the exact one (mean and worst), the share of the DiT's block runs done (noise-free work: a skipped
step still runs its probe and back blocks), and the time over the exact run's (per case the median over the passes
of the ratio to the same pass's exact run, then the median over the cases; the machine is shared, so read the block
share too).

Calibration (DPCache's idea): the full steps of `schedule` settings are chosen on other draws (`cases(seed=99)`, 3
prompts and 2 edits, never judged) from the exact runs' residuals of every block (input of block 0 to output of the
last) at cfg 1 (`--calibrate-cfg 4`: runs at cfg 4, both prompts' rows): a dynamic programme over the last two full
steps picks the K steps that minimise the forecast's (order 1) error summed over the skipped steps,
each weighted by its step in sigma.

Peers: diffusers 0.42.1's FirstBlockCache, TaylorSeer, SeaCache and MagCache (calibrated once on a calibration
prompt) run on the toy written as a diffusers folder, each against the same diffusers loop without a cache (their
own exact path; parts/diffusers_caches.py says why without the 2.1 KV cache). cache-dit 1.5.3 is asked in its own
venv whether it adapts the 2.1 transformer; its DBCache rule (and DBCache + TaylorSeer, and diffusers' TaylorSeer
schedule) also run as settings of ours, labelled "(rule, ours)".
"""

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from parts import diffusers_caches as peers
from parts.curve_plot import draw_curve
from qi21.demo.toy_data import SIZE
from qi21.demo.toy_eval import ToyPipeline, psnr, ssim
from qi21.demo.toy_model import write_toy_checkpoints
from qi21.model.encoders.pipeline import decode_images
from qi21.model.sampling.loop import initial_noise
from qi21.model.sampling.schedule import base_sigmas
from qi21.model.sampling.step_cache import StepCacheOptions
from quality import cases  # the same draws as the step cache's yardstick

STATIC = 1e9  # a threshold no indicator reaches: the mask or the schedule alone decides
BUDGETS = (4, 5, 6, 8, 13, 16, 20, 24)  # full steps of 40 the calibrated schedules may run


# -- calibration ---------------------------------------------------------------------------------------------------
def residuals_of(pipe: ToyPipeline, prompt, references, seed: int, steps: int, cfg: float = 1.0) -> list[torch.Tensor]:
    """The exact run's residual of every block on the target rows, per step (fp32): what a skipped step of a
    schedule without a probe block (probe_blocks 0) forecasts. cfg > 1: both prompts' rows (one batched call)."""
    model, before, after = pipe.dit(), [], []
    tokens = (SIZE // 16) ** 2 * (2 if cfg > 1 else 1)
    hooks = [model.blocks[0].register_forward_pre_hook(  # a copy: the blocks change their buffer in place
                 lambda module, args: before.append(args[0][-tokens:].float().clone())),
             model.blocks[-1].register_forward_hook(
                 lambda module, args, out: after.append(out[-tokens:].float().clone()))]
    try:
        pipe.generate(prompt, seed, references, steps=steps, cfg=cfg, negative="" if cfg > 1 else None)
    finally:
        for hook in hooks:
            hook.remove()
    return [last - first for first, last in zip(before, after)]


def calibrate(runs: list[list[torch.Tensor]], sigmas: list[float], budgets=BUDGETS) -> dict[int, list[int]]:
    """For each budget K: the K full steps (step 0 always) minimising the summed error of order-1 forecasts on the
    skipped steps (`runs`: per calibration case, per step the residual), each weighted by its step in sigma."""
    n = len(runs[0])

    def error(i, j, k):  # forecast of step k from full steps i (or -1: none) and j
        total = 0.0
        for residual in runs:
            guess = residual[j] if i < 0 else residual[j] + (residual[j] - residual[i]) * (
                (sigmas[k] - sigmas[j]) / (sigmas[j] - sigmas[i]))
            total += float((guess - residual[k]).abs().mean()) * (sigmas[k] - sigmas[k + 1])
        return total

    # tail[i][j][l]: the error of the steps after j up to l - 1, all forecast from (i, j)
    tail = {}
    for j in range(n):
        for i in range(-1, j):
            sums, acc = [0.0], 0.0
            for k in range(j + 1, n):
                acc += error(i, j, k)
                sums.append(acc)
            tail[i, j] = sums  # sums[l - j - 1] = error of steps j+1 .. l-1
    chosen = {}
    for budget in budgets:
        best = {(-1, 0): (0.0, [0])}
        for _ in range(budget - 1):
            following = {}
            for (i, j), (cost, path) in best.items():
                for step in range(j + 1, n):
                    total = cost + tail[i, j][step - j - 1]
                    if (j, step) not in following or total < following[j, step][0]:
                        following[j, step] = (total, path + [step])
            best = following
        cost, path = min(((cost + tail[i, j][n - j - 1], path) for (i, j), (cost, path) in best.items()),
                         key=lambda entry: entry[0])
        chosen[budget] = path
    return chosen


# -- the settings ----------------------------------------------------------------------------------------------------
def settings(schedules: dict[int, list[int]], steps: int) -> list[tuple[str, str, StepCacheOptions]]:
    """(label, kind, options): kind "ours", or "rule" (a peer's published rule run as a setting of ours)."""
    def o(**kwargs):
        return StepCacheOptions(**kwargs)

    def mask(first, every, last, **kwargs):
        return o(decide="mask", full_first=first, full_every=every, full_last=last, threshold=STATIC,
                 edit_threshold=STATIC, **kwargs)

    def scheduled(budget, **kwargs):
        shares = tuple(step / steps for step in schedules[budget])
        return o(decide="schedule", schedule=shares, threshold=STATIC, edit_threshold=STATIC, **kwargs)

    taylor1 = dict(mode="taylor", order=1)  # P0: probe_blocks 0 (no front block), B1: back_blocks 1
    out = [
        ("t8 (today's default)", "ours", o()),
        ("t8 0.2", "ours", o(threshold=0.2, edit_threshold=0.2)),
        ("taylor1 0.3 skips 3", "ours", o(threshold=0.3, edit_threshold=0.3, max_skips=3, **taylor1)),
        ("taylor1 F1B1 0.3 skips 3", "ours", o(threshold=0.3, edit_threshold=0.3, max_skips=3, back_blocks=1,
                                               **taylor1)),
        ("mask 3/6/1 taylor1 P0", "ours", mask(3, 6, 1, probe_blocks=0, **taylor1)),
    ]
    for budget in sorted(schedules):
        out.append((f"schedule {budget}/{steps} taylor1 P0", "ours", scheduled(budget, probe_blocks=0, **taylor1)))
    if 8 in schedules:
        out.append((f"schedule 8/{steps} taylor1 P1", "ours", scheduled(8, **taylor1)))
    warmup = 8 / steps  # cache-dit's max_warmup_steps 8 of 40
    out += [
        ("cache-dit DBCache F1B0 W8 R0.08 (rule, ours)", "rule",
         o(threshold=0.08, edit_threshold=0.08, start_percent=warmup, end_percent=1.0, max_skips=steps)),
        ("cache-dit DBCache F1B0 W8 R0.12 + TaylorSeer O1 (rule, ours)", "rule",
         o(threshold=0.12, edit_threshold=0.12, start_percent=warmup, end_percent=1.0, max_skips=steps, **taylor1)),
        ("diffusers TaylorSeer interval 5 O1 (rule, ours)", "rule", mask(3, 5, 0, probe_blocks=0, **taylor1)),
        # near-exact with a smaller threshold for edits (their worst case was an edit)
        ("DBCache R0.12 O1, edits 0.06", "ours",
         o(threshold=0.12, edit_threshold=0.06, start_percent=warmup, end_percent=1.0, max_skips=steps, **taylor1)),
        ("DBCache R0.12 O1, edits 0.04", "ours",
         o(threshold=0.12, edit_threshold=0.04, start_percent=warmup, end_percent=1.0, max_skips=steps, **taylor1)),
    ]
    return out


def turbo_settings() -> list[tuple[str, str, StepCacheOptions]]:
    """The Turbo sampler's 8 steps: T8's rule, and masks that run every other step (or the first 3, then every
    other), with the forecast of order 1, no probe block or one back block."""
    def mask(first, every, **kwargs):
        return StepCacheOptions(decide="mask", full_first=first, full_every=every, threshold=STATIC,
                                edit_threshold=STATIC, mode="taylor", order=1, **kwargs)

    return [("t8 0.2", "ours", StepCacheOptions(threshold=0.2, edit_threshold=0.2)),
            ("mask 2/2/0 taylor1 P0", "ours", mask(2, 2, probe_blocks=0)),
            ("mask 3/2/0 taylor1 P0", "ours", mask(3, 2, probe_blocks=0)),
            ("mask 2/2/0 taylor1 P0B1", "ours", mask(2, 2, probe_blocks=0, back_blocks=1))]


# -- the measurement -------------------------------------------------------------------------------------------------
def whole_prompt(pipe, prompt, source, seed, steps, turbo=False, cfg=1.0, **options):
    """Encode (the reference too), sample, decode: (RGBA image, report, seconds); `turbo`: the Turbo model; cfg > 1:
    true CFG against the empty prompt."""
    started = time.perf_counter()
    references = (pipe.reference(source.render()),) if source is not None else ()
    images, report = pipe.generate(prompt, seed, references, steps=steps, turbo=turbo, cfg=cfg,
                                   negative="" if cfg > 1 else None, **options)
    return images[0], report, time.perf_counter() - started


def diffusers_prompt(pipe, transformer, prompt, source, seed, steps, cfg=1.0):
    started = time.perf_counter()
    references = (pipe.reference(source.render()),) if source is not None else ()
    cond = pipe.condition(prompt, references)
    negative = pipe.condition("", references) if cfg > 1 else None
    with torch.no_grad():
        latents = peers.denoise(transformer, cond, initial_noise(seed, 1, SIZE, SIZE), steps, negative, cfg)
        image = decode_images(pipe.vae, cond.latent_format.denormalize(latents.float()))[2][0]
    return image, time.perf_counter() - started


def measure(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    if isinstance(args.calibrated, str) and args.calibrated and not Path(args.calibrated).is_file():
        raise SystemExit(f"--calibrated {args.calibrated}: no such file")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "models"
        write_toy_checkpoints(models)
        pipe = ToyPipeline(models)
        sigmas = base_sigmas(args.steps, SIZE, SIZE).tolist()
        calibration = cases(99, 3, 2)
        chosen = []
        if args.turbo:  # the distilled model's 8 stored sigmas; no calibration, no peers
            args.steps, args.calibrated, args.no_diffusers = 8, args.calibrated or "", True
        if not args.no_ours:
            if args.turbo:
                schedules = {}
            elif args.calibrated:  # an earlier run's schedules (the same draws and steps give the same ones)
                schedules = {int(k): v for k, v in json.loads(Path(args.calibrated).read_text())["full_steps"].items()}
            else:
                runs = [residuals_of(pipe, p, (pipe.reference(s.render()),) if s else (), seed, args.steps,
                                     args.calibrate_cfg) for p, s, seed in calibration]
                schedules = calibrate(runs, sigmas)
            print("calibrated schedules (full steps, 0-based):", json.dumps(schedules), flush=True)
            if args.schedules:
                Path(args.schedules).write_text(json.dumps({"steps": args.steps, "full_steps": schedules}, indent=1))
            chosen = [s for s in (turbo_settings() if args.turbo else settings(schedules, args.steps))
                      if not args.only or any(w in s[0] for w in args.only.split(","))]
            if args.calibrate_cfg != 1:  # the schedules' labels say so (the presets are calibrated at cfg 1)
                chosen = [(f"{label}, calibrated at cfg {args.calibrate_cfg:g}" if label.startswith("schedule")
                           else label, kind, options) for label, kind, options in chosen]
        transformer = diffusers_configs = None
        if not args.no_diffusers:
            peers.register_block()
            transformer = peers.load_transformer(models)
            p, s, seed = calibration[0]
            negative = pipe.condition("") if args.cfg > 1 else None
            ratios = peers.calibrate_mag_ratios(transformer, pipe.condition(p), initial_noise(seed, 1, SIZE, SIZE),
                                                args.steps, negative, args.cfg)
            diffusers_configs = peers.peer_configs(ratios)
            if args.only:
                diffusers_configs = {k: v for k, v in diffusers_configs.items()
                                     if any(w in k for w in args.only.split(","))}
            print("cache-dit:", peers.try_cache_dit(models), flush=True)
        for number, (prompt, source, seed) in enumerate(cases(args.seed, args.prompts, args.edits)):
            task = "edit" if source is not None else "t2i"
            if args.task not in ("all", task):
                continue
            if chosen:
                def ours(index, case=(prompt, source, seed)):  # index len(chosen): the exact path
                    options = {} if index == len(chosen) else {"step_cache": chosen[index][2]}
                    return whole_prompt(pipe, *case, args.steps, args.turbo, args.cfg, **options)

                got = interleaved(ours, list(range(len(chosen) + 1)), number, args.passes)
                image_exact, _, _ = got[len(chosen)][0]
                for index in range(len(chosen)):
                    label, kind, options = chosen[index]
                    image, report, _ = got[index][0]
                    sc = report.get("step_cache", {})
                    rows.append(row(label, kind, task, image, image_exact, pass_ratio(got, index, len(chosen)),
                                    1 - sc.get("blocks_skipped_share", 0.0), sc.get("pattern"), args.cfg))
            if transformer is not None:
                def peer(name, case=(prompt, source, seed)):  # None: diffusers' loop without a cache
                    if name is not None:
                        transformer.enable_cache(diffusers_configs[name]())
                    try:
                        image, seconds = diffusers_prompt(pipe, transformer, *case, args.steps, args.cfg)
                        return image, None, seconds
                    finally:
                        if name is not None:
                            transformer.disable_cache()

                got = interleaved(peer, list(diffusers_configs) + [None], number, args.passes)
                for name in diffusers_configs:
                    rows.append(row(name, "peer", task, got[name][0][0], got[None][0][0],
                                    pass_ratio(got, name, None), None, None, args.cfg))
            print(f"case {number} ({task}) done", flush=True)
            if args.json:  # after every case: a run stopped early keeps what it measured
                Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def interleaved(run, keys: list, number: int, passes: int) -> dict:
    """`run(key)` -> (image, report, seconds) for every key, `passes` times: each pass in a rotating order (case
    `number`, pass p starts at key number + p), so no setting always runs first or after the same one. key ->
    the results of each pass."""
    got = {key: [] for key in keys}
    for p in range(passes):
        start = (number + p) % len(keys)
        for key in keys[start:] + keys[:start]:
            got[key].append(run(key))
    return got


def pass_ratio(got: dict, key, exact_key) -> float:
    """The median over the passes of a setting's time over the same pass's exact run."""
    return statistics.median(mine[2] / exact[2] for mine, exact in zip(got[key], got[exact_key]))


def row(label, kind, task, image, exact, ratio, blocks_run, pattern, cfg=1.0) -> dict:
    return {"setting": label, "kind": kind, "task": task, "psnr": psnr(image, exact), "ssim": ssim(image, exact),
            "ratio": ratio, "blocks_run": blocks_run, "pattern": pattern, "cfg": cfg}


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    labels = list(dict.fromkeys(r["setting"] for r in rows))
    for label in labels:
        for task in ("all", "t2i", "edit"):
            chosen = [r for r in rows if r["setting"] == label and (task == "all" or r["task"] == task)]
            if not chosen:
                continue
            finite = [r["psnr"] for r in chosen if math.isfinite(r["psnr"])]
            blocks = [r["blocks_run"] for r in chosen if r["blocks_run"] is not None]
            out.append({"setting": label, "kind": chosen[0]["kind"], "task": task, "cases": len(chosen),
                        "psnr_mean": statistics.fmean(finite) if finite else math.inf,
                        "psnr_min": min(r["psnr"] for r in chosen),
                        "ssim_mean": statistics.fmean(r["ssim"] for r in chosen),
                        "ssim_min": min(r["ssim"] for r in chosen),
                        "time_ratio": statistics.median(r["ratio"] for r in chosen),
                        "blocks_run": statistics.fmean(blocks) if blocks else None})
    return out


def print_table(summary: list[dict]) -> None:
    print("| setting | kind | task | cases | PSNR dB mean (worst) | SSIM mean (worst) | blocks run | time / exact "
          "(median) | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        blocks = "n/a" if s["blocks_run"] is None else f"{s['blocks_run']:.3f}"
        print(f"| {s['setting']} | {s['kind']} | {s['task']} | {s['cases']} | {s['psnr_mean']:.1f} "
              f"({s['psnr_min']:.1f}) | {s['ssim_mean']:.4f} ({s['ssim_min']:.4f}) | {blocks} | "
              f"{s['time_ratio']:.3f} | {1 / s['time_ratio']:.2f}x |")


def print_compact(summary: list[dict]) -> None:
    """One row per setting (docs/step-cache.md's table): every case, then t2i and edits apart."""
    by = {(s["setting"], s["task"]): s for s in summary}
    print("| # | setting | kind | PSNR dB mean (worst), all | t2i | edits | SSIM mean (worst) | blocks run | "
          "time / exact | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    labels = [s["setting"] for s in summary if s["task"] == "all"]
    for number, label in enumerate(labels, 1):
        every, parts = by[label, "all"], [by.get((label, task)) for task in ("t2i", "edit")]
        cells = ["" if p is None else f"{p['psnr_mean']:.1f} ({p['psnr_min']:.1f})" for p in parts]
        blocks = "n/a" if every["blocks_run"] is None else f"{every['blocks_run']:.3f}"
        print(f"| {number} | {label} | {every['kind']} | {every['psnr_mean']:.1f} ({every['psnr_min']:.1f}) | "
              f"{cells[0]} | {cells[1]} | {every['ssim_mean']:.4f} ({every['ssim_min']:.4f}) | {blocks} | "
              f"{every['time_ratio']:.3f} | {1 / every['time_ratio']:.2f}x |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=14)
    parser.add_argument("--edits", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cfg", type=float, default=1.0, help="true CFG against the empty prompt (1: none)")
    parser.add_argument("--seed", type=int, default=7,
                        help="the draw of the judged cases (7: the yardstick's; another: fresh held-out cases)")
    parser.add_argument("--calibrate-cfg", type=float, default=1.0,
                        help="the cfg of the calibration runs (the presets': 1)")
    parser.add_argument("--passes", type=int, default=3,
                        help="interleaved passes per case; its time ratio is the median over them")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default="", help="comma list of setting labels (substrings) to run")
    parser.add_argument("--no-diffusers", action="store_true", help="ours only (no diffusers / cache-dit peers)")
    parser.add_argument("--no-ours", action="store_true", help="the diffusers / cache-dit peers only")
    parser.add_argument("--task", choices=("all", "t2i", "edit"), default="all",
                        help="only these cases (to split a run over processes; --merge joins them)")
    parser.add_argument("--json", default=None, help="write every case's row here")
    parser.add_argument("--merge", nargs="*", default=[], help="rows of earlier runs (--json files) to add")
    parser.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                        help="run the cases (--no-measure: only merge, print and plot)")
    parser.add_argument("--plot", default=None, help="write the speed / PSNR curve here (PNG)")
    parser.add_argument("--schedules", default=None, help="write the calibrated schedules here (JSON)")
    parser.add_argument("--turbo", action="store_true", help="the Turbo model's 8 steps, `turbo_settings()`")
    parser.add_argument("--calibrated", default=None, help="read the schedules from an earlier --schedules file")
    args = parser.parse_args(argv)
    rows = measure(args) if args.measure else []
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    for file in args.merge:
        rows += json.loads(Path(file).read_text())
    if len({r.get("cfg", 1.0) for r in rows}) > 1:
        raise SystemExit("--merge: these rows were measured at different cfg; summarise each cfg apart")
    summary = summarise(rows)
    print_table(summary)
    print()
    print_compact(summary)
    if args.plot:
        cfgs = sorted({r.get("cfg", 1.0) for r in rows})
        draw_curve([s for s in summary if s["task"] == "all"], Path(args.plot),
                   ("Turbo, " if args.turbo else "") + "cfg " + ", ".join(f"{c:g}" for c in cfgs))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
