"""Run the shipped API-format workflows headlessly through the pack's own node classes; no ComfyUI needed.

    python demo/run_workflows.py [--models DIR] [--out DIR] [--workflows PATH] [--input DIR] [--quick] [--verbose]
                                 [--only NAME[,NAME]] [--prompt TEXT] [--seed N]
    python -m demo.run_workflows ...     (the same, from the repository root)

By default the models are the toy trained here (demo/toy_model.py: it draws flat shapes, mostly as its prompt
asks, docs/toy-model.md): the shipped workflows run with a prompt of that vocabulary in place of theirs and toy scenes
as their input images; each picture is read (demo/toy_eval.py) and the table says whether it shows what was asked
(`drew`), and `<out>/contact_sheet.png` shows every output with its prompt and that verdict. `--random` uses the tiny
random set instead (every file layout, images are noise), `--models DIR` real weights. `--only` runs the named
workflows, `--prompt` gives every text encoder of them your words instead, `--seed` every sampler your seed.

Every `*.json` in `--workflows` (default: workflows/api/) is run the way ComfyUI's executor would run it:
the graph is validated first (known node types, required inputs present, links pointing at an existing output
of the right type, widget values inside their combo lists and min/max, each node's own `validate_inputs`), then
the nodes that lead to an output node run in dependency order, optional inputs the workflow leaves out taking
their schema defaults. The pack's nodes run through `qi21.nodes.NODES`; the core nodes the workflows use are
implemented here with ComfyUI's conventions:

- LoadImage: the named file from `--input` (default `<out>/input/`, where an example image is generated for
  every missing name, see `wants_alpha` for which are RGBA, all large enough for any reference resolution),
  returning IMAGE `[1, H, W, 3]` in [0, 1] (alpha dropped) and MASK `[1, H, W]` (1 = transparent, or a 64x64
  zero mask for an opaque image);
- SaveImage / PreviewImage / MaskPreview: PNGs under `<out>/<workflow>/`, RGB for 3-channel and RGBA for
  4-channel IMAGEs, a MASK as grey levels; the workflow is embedded in each PNG as ComfyUI embeds it.

The official templates' counterparts run through the stand-ins of demo/core_standins.py (KSamplerSelect, their
prompt enhancer's switch, which is off: its language model never runs here) and, with the toy or random set, their
int8 ConvRot file names hold that set's plain weights (`write_template_files`).

Each sampler's `qi21_report` is written next to the images as `qi21_report_<node id>.json`, a summary table is
printed and written to `<out>/summary.json`, and the exit status is 1 if any workflow failed (or none was found).

With `--models DIR` the loaders read real weights from that ComfyUI-style models folder (`diffusion_models/`,
`text_encoders/`, `vae/`, `diffusers/`). With `--random` a tiny random checkpoint set is generated in a temporary
folder (`tiny_checkpoints.py`) and the images are noise; in that mode (and with `--quick`) sizes and steps are
capped so every workflow runs in seconds on a CPU, and the output says so.
"""

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not (__package__ or "").endswith(".demo"):
    # Run as `python demo/run_workflows.py` (no package; Python put demo/ on sys.path) or as `python -m
    # demo.run_workflows` (package `demo`, outside the pack): register the repository as package `qi21`
    # (pack_import.py) and run this module inside it, where its relative imports of the pack resolve.
    if __package__:
        from .pack_import import import_pack
    else:
        from pack_import import import_pack

    sys.exit(importlib.import_module(f"{import_pack().__name__}.demo.run_workflows").main())

from ..nodes import bridge
from .core_nodes import WorkflowError, input_file_name, write_example_images
from .pack_import import ROOT
from .tiny_checkpoints import write_tiny_checkpoints
from .toy_model import write_toy_checkpoints
from .toy_workflows import TOY_RUN_NOTES, contact_sheet, judge, toy_overrides, write_toy_inputs
from .workflow_runner import QUICK_NOTE, TINY_BANNER, Runner, WorkflowResult, load_workflow

TOY_BANNER = ("USING THE TOY MODEL TRAINED HERE (demo/toy_model.py): flat shapes on the asked background, the asked "
              "colour and side in 38 of 40 held-out prompts and 19 of 20 edits at cfg 1 (docs/toy-model.md); --models "
              "for real weights")
SHIPPED_WORKFLOWS = ROOT / "workflows" / "api"
#: The official templates load int8 ConvRot files; the toy and random sets have their weights only as the plain
#: files, so those are written under these names too (the int8 format itself is tested in tests/test_quantized.py).
TEMPLATE_FILES = {"diffusion_models": {"qwen_image_2.1_int8_convrot.safetensors": "qwen_image_2.1_bf16.safetensors",
                                       "qwen_image_2.1_turbo_int8_convrot.safetensors":
                                           "qwen_image_2.1_turbo_bf16.safetensors"},
                  "text_encoders": {"qwen3vl_8b_int8_convrot.safetensors": "qwen3vl_8b_bf16.safetensors"}}


def write_template_files(models: Path) -> None:
    """The official templates' file names in a generated models folder, as copies of its plain files (with the text
    encoder's tokenizer folder, which sits beside its file under the file's stem)."""
    for folder, names in TEMPLATE_FILES.items():
        for name, plain in names.items():
            shutil.copyfile(models / folder / plain, models / folder / name)
            tokenizer = models / folder / (Path(plain).stem + "_tokenizer")
            if tokenizer.is_dir():
                shutil.copytree(tokenizer, models / folder / (Path(name).stem + "_tokenizer"), dirs_exist_ok=True)


def user_overrides(prompt: str | None, seed: int | None):
    """`--prompt` and `--seed` as a runner override: every written prompt (after the toy's) and every sampler seed."""
    def override(workflow: str, class_type: str, kwargs: dict) -> list[str]:
        changed = []
        if prompt is not None and class_type == "QI21TextEncode" and isinstance(kwargs.get("prompt"), str):
            changed.append(f"prompt {kwargs['prompt'][:40]!r} -> {prompt!r} (--prompt)")
            kwargs["prompt"] = prompt
        if seed is not None and class_type in ("QI21Sampler", "QI21TurboSampler") and kwargs.get("seed") != seed:
            changed.append(f"seed {kwargs.get('seed')} -> {seed} (--seed)")
            kwargs["seed"] = seed
        return changed
    return override


def chain(*overrides):
    """One runner override that applies each of `overrides` (None: skipped) in turn."""
    present = [o for o in overrides if o is not None]
    if not present:
        return None
    return lambda workflow, class_type, kwargs: [c for o in present for c in o(workflow, class_type, kwargs)]


def only(workflows: list[Path], names: str) -> tuple[list[Path], str | None]:
    """The workflows `--only` names (comma-separated stems), or an error naming the unknown ones and the choices."""
    wanted = [n.strip().removesuffix(".json") for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {p.stem for p in workflows}]
    if unknown or not wanted:
        return [], (f"--only {names!r}: no workflow named {', '.join(unknown) or '(none given)'}; the choices: "
                    + ", ".join(p.stem for p in workflows))
    return [p for p in workflows if p.stem in wanted], None


# -- command line ------------------------------------------------------------------------------------------------
def find_workflows(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(path.glob("*.json")) if path.is_dir() else []


def image_names(workflows: list[Path]) -> list[str]:
    """Every file a LoadImage node of these workflows reads (unreadable workflows are reported later)."""
    names = []
    for path in workflows:
        try:
            nodes = load_workflow(path)
        except WorkflowError:
            continue
        for node in nodes.values():
            value = node.get("inputs", {}).get("image")
            if node["class_type"] == "LoadImage" and isinstance(value, str):
                try:
                    names.append(input_file_name(value))
                except WorkflowError:
                    pass
    return names


def _report_summary(reports) -> str:
    parts = []
    for _node_id, entries, _path in reports:
        for entry in entries:
            parts.append(f"{entry.get('steps', '?')} steps, cache {entry.get('cache', '?')}, "
                         f"{entry.get('prefix_tokens', '?')}+{entry.get('target_tokens', '?')} tokens")
    return "; ".join(parts) or "-"


def _status(result: WorkflowResult) -> str:
    return "ok" if result.ok else "skipped" if result.skipped else "FAILED"


def print_summary(results: list[WorkflowResult], banner: str | None, out_dir: Path, log=print) -> None:
    width = max([len(r.name) for r in results] + [8])
    judged = any(r.drew for r in results)
    drew = (lambda r: f"{r.drew or '-':<4}  ") if judged else (lambda r: "")
    log("")
    log(f"{'workflow':<{width}}  {'result':<6}  " + ("drew  " if judged else "") + f"{'time':>7}  {'images':>6}  "
        "sampler report")
    log(f"{'-' * width}  ------  " + ("----  " if judged else "") + f"-------  ------  {'-' * 40}")
    for r in results:
        log(f"{r.name:<{width}}  {_status(r):<6}  {drew(r)}{r.seconds:6.1f}s  {len(r.images):>6}  "
            f"{_report_summary(r.reports)}")
    if judged:
        log("\nwhat each picture shows (demo/toy_eval.py reads background, colour and side):")
        for r in results:
            log(f"  {r.name:<{width}}  drew: {r.drew or '-'}  {r.drew_detail}")
    for r in results:
        if r.error:
            log(f"\n{r.name} FAILED: {r.error}")
    for r in results:
        if r.skipped:
            log(f"\n{r.name} skipped: {r.skipped}")
    ok = sum(r.ok for r in results)
    skipped = sum(bool(r.skipped) for r in results)
    counts = {verdict: sum(r.drew == verdict for r in results) for verdict in ("yes", "no", "n/a")}
    log(f"\n{ok}/{len(results)} workflows ok" + (f", {skipped} skipped" if skipped else "")
        + (f"; {counts['yes']}/{len(results)} drew what they were asked ({counts['no']} did not, {counts['n/a']} not "
           "judged)" if judged else "") + f"; images and reports in {out_dir}")
    if banner:
        log(banner)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run the Qwen-Image 2.1 API-format workflows headlessly.")
    parser.add_argument("--models", type=Path, default=None,
                        help="ComfyUI models folder with real weights (diffusion_models/, text_encoders/, vae/, "
                             "diffusers/). Without it the toy trained here runs (demo/toy_model.py).")
    parser.add_argument("--random", action="store_true",
                        help="the tiny random checkpoint set instead of the toy (every file layout; images are noise)")
    parser.add_argument("--out", type=Path, default=Path("out"), help="where images, reports and summary.json go "
                        "(default ./out)")
    parser.add_argument("--workflows", type=Path, default=SHIPPED_WORKFLOWS,
                        help="a folder of API-format *.json workflows, or one file (default: workflows/api)")
    parser.add_argument("--input", type=Path, default=None,
                        help="where LoadImage reads from (default <out>/input, <out>/toy_input for the toy; missing "
                             "images are generated)")
    parser.add_argument("--quick", action="store_true",
                        help="cap sizes and steps as the tiny random set always does: a fast smoke run of real weights")
    parser.add_argument("--verbose", action="store_true", help="per-node timings, notes and tracebacks")
    parser.add_argument("--only", default=None, metavar="NAME[,NAME]",
                        help="run only these workflows (file names without .json, e.g. img2img,official_t2i)")
    parser.add_argument("--prompt", default=None, help="your words in place of every written prompt (the toy's or the "
                        "workflow's); on the toy, its vocabulary (docs/toy-model.md) is what it can draw")
    parser.add_argument("--seed", type=int, default=None, help="this seed for every sampler")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = args.out
    tiny = args.models is None and args.random
    toy = args.models is None and not args.random
    input_dir = args.input if args.input is not None else out_dir / ("toy_input" if toy else "input")
    workflows = find_workflows(args.workflows)
    if not workflows:
        print(f"No API-format workflows (*.json) found at {args.workflows}; nothing to run.")
        return 1
    if args.only is not None:
        workflows, problem = only(workflows, args.only)
        if problem:
            print(problem)
            return 1
    if args.seed is not None and not 0 <= args.seed <= 0xFFFFFFFFFFFFFFFF:
        print(f"--seed {args.seed}: a seed is between 0 and 2**64 - 1.")
        return 1
    if args.models is not None and not args.models.is_dir():
        print(f"--models {args.models}: no such folder.")
        return 1
    if bridge.HAVE_COMFY:
        print("Note: ComfyUI is importable here, so the nodes use ComfyUI's own model folders and --models (or the "
              "generated set) is ignored by the loaders.")
    out_dir.mkdir(parents=True, exist_ok=True)
    banner = TINY_BANNER if tiny else TOY_BANNER if toy else None
    shipped = args.workflows.resolve() == SHIPPED_WORKFLOWS.resolve()
    previous_root = getattr(bridge, "_plain_models_root", None)  # restored afterwards (in-process callers)
    with tempfile.TemporaryDirectory(prefix="qi21_models_", ignore_cleanup_errors=True) as scratch:
        if banner:
            print(banner)
            tick = time.perf_counter()
            write = write_tiny_checkpoints if tiny else write_toy_checkpoints
            models = write(Path(scratch))["root"]
            write_template_files(models)
            print(f"  wrote the {'tiny random' if tiny else 'toy'} model set to {models} in "
                  f"{time.perf_counter() - tick:.1f} s")
        else:
            models = args.models
            print(f"Using real weights from {models}")
        bridge.set_models_root(models)
        try:
            created = (write_toy_inputs if toy else write_example_images)(input_dir, image_names(workflows))
            if created:
                print(f"  generated example input images in {input_dir}: {', '.join(p.name for p in created)}")
            quick = tiny or args.quick
            if quick:
                on_cpu = bridge.compute_device().type == "cpu"
                print(f"  {QUICK_NOTE}" + (", weights in fp32 (no fast bf16 on this CPU)" if on_cpu else ""))
            overrides = chain(toy_overrides if toy and shipped else None, user_overrides(args.prompt, args.seed))
            if toy and shipped:
                print("  the shipped workflows' prompts are for the real model: each runs with a prompt of the toy's "
                      "vocabulary instead, at 256x256 (demo/toy_workflows.py)")
                for note in TOY_RUN_NOTES:
                    print(f"  {note}")
            runner = Runner(out_dir, input_dir, quick, args.verbose, overrides=overrides)
            print(f"Running {len(workflows)} workflow(s) from {args.workflows}")
            results = []
            for index, path in enumerate(workflows, 1):
                print(f"[{index}/{len(workflows)}] {path.name}")
                result = runner.run(path)
                results.append(result)
                if toy:
                    result.drew, result.drew_detail = judge(result, input_dir)
                print(f"    {_status(result)} in {result.seconds:.1f} s, {len(result.images)} image(s)"
                      + (f": {result.error or result.skipped}" if result.error or result.skipped else "")
                      + (f"; prompt {result.prompts[0]!r}" if toy and result.prompts else "")
                      + (f"; drew: {result.drew} ({result.drew_detail})" if toy and result.ok else ""))
                if args.verbose:
                    for note in result.notes:
                        print(f"    note: {note}")
                    if result.details:
                        print(result.details)
            runner.loader_cache.clear()
        finally:
            bridge.set_models_root(previous_root)
    summary = [{
        "workflow": r.name, "ok": r.ok, "skipped": r.skipped, "seconds": round(r.seconds, 3), "error": r.error,
        "notes": r.notes, "prompts": r.prompts, "drew": r.drew, "drew_detail": r.drew_detail,
        "images": [str(p) for p in r.images],
        "reports": [{"node": node_id, "file": str(path), "report": entries} for node_id, entries, path in r.reports],
    } for r in results]
    model = "tiny_random" if tiny else "toy" if toy else "given"
    (out_dir / "summary.json").write_text(json.dumps({"tiny_random_checkpoint": tiny, "model": model,
                                                      "workflows": summary}, indent=2) + "\n", encoding="utf-8")
    sheet = [(r.name, r.prompts[0] if r.prompts else "", p, *([f"drew: {r.drew}"] if r.drew else []))
             for r in results for p in r.images if p.suffix == ".png" and not p.name.startswith("preview_")]
    if sheet:
        print(f"contact sheet: {contact_sheet(sheet, out_dir / 'contact_sheet.png')}")
    print_summary(results, banner, out_dir)
    return 0 if any(r.ok for r in results) and all(r.ok or r.skipped for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
