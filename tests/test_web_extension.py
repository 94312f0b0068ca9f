"""The front-end extension (web/): its arithmetic under Node against the Python code, the run-report texts, and the
extension's wiring with a stubbed ComfyUI app, api and a fake graph (tests/web/). No browser and no ComfyUI: those
checks are separate (tests/test_comfyui_browser.py).

Every test skips when `node` is not on PATH.
"""

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from qi21.model.encoders.canvas import fit_inside, padded_size
from qi21.model.encoders.references import MIN_VLM_PIXELS, reference_size

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "web"
HELPERS = Path(__file__).resolve().parent / "web"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="node (Node.js) is not on PATH; the web extension tests need it")

MIB = 1024 * 1024
FULL_MODEL_BYTES_PER_TOKEN = 2 * 32 * 32 * 128 * 2  # K and V, 32 layers x 32 heads x 128 head_dim, bf16


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """ComfyUI's layout in miniature: <root>/scripts/app.js (a stub) and <root>/extensions/qi21/*.js (our files),
    with `"type": "module"` so Node treats the .js files as ES modules, as the browser does."""
    root = tmp_path_factory.mktemp("comfy_web")
    pack = root / "extensions" / "qi21"
    pack.mkdir(parents=True)
    for file in WEB.glob("*.js"):
        shutil.copy(file, pack / file.name)
    (root / "scripts").mkdir()
    shutil.copy(HELPERS / "app_stub.mjs", root / "scripts" / "app.js")
    shutil.copy(HELPERS / "api_stub.mjs", root / "scripts" / "api.js")
    (root / "package.json").write_text('{"type": "module"}\n')
    return pack


def _node(*args, stdin: str | None = None) -> str:
    result = subprocess.run([NODE, *map(str, args)], input=stdin, capture_output=True, text=True, timeout=60,
                            cwd=HELPERS)
    assert result.returncode == 0, f"node {' '.join(map(str, args))} failed:\n{result.stderr}"
    return result.stdout


def call(sandbox: Path, *calls, module: str = "qi21_estimate.js"):
    """Call exported functions of web/<module> under Node: [(name, [args])] -> [result]."""
    results = json.loads(_node(HELPERS / "call.mjs", sandbox / module, stdin=json.dumps(calls)))
    for (name, args), result in zip(calls, results):
        assert "error" not in result, f"{name}{tuple(args)} raised: {result['error']}"
    return [result["value"] for result in results]


def drive(sandbox: Path, scenario: str) -> dict:
    return json.loads(_node(HELPERS / "extension_driver.mjs", sandbox / "qi21.js", scenario))


# ------------------------------------------------------------------------------------------- pure arithmetic

def test_every_js_file_in_web_is_an_es_module_node_can_load(sandbox):
    # ComfyUI imports every .js under WEB_DIRECTORY as a module; each must parse and load (qi21.js with the stub).
    files = sorted(p.name for p in WEB.glob("*.js"))
    assert {"qi21.js", "qi21_estimate.js", "qi21_report.js"} <= set(files)
    for name in files:
        _node("--check", sandbox / name)
    _node("--input-type=module", "-e", f"globalThis.__QI21_TEST_APP__ = {{registerExtension() {{}}}}; "
          f"await import({json.dumps((sandbox / 'qi21.js').as_uri())});")


def test_presets_are_x32_about_1024_squared_and_have_their_ratios(sandbox):
    (presets,) = call(sandbox, ("presetSizes", []))
    labels = [p["label"] for p in presets]
    assert labels[0] == "custom" and presets[0]["width"] is None
    follow = next(p for p in presets if p["label"].startswith("follow reference"))
    assert (follow["width"], follow["height"]) == (0, 0)
    ratios = {tuple(p["ratio"]): p for p in presets if p["ratio"]}
    for wanted in [(1, 1), (4, 3), (3, 4), (3, 2), (2, 3), (16, 9), (9, 16), (21, 9)]:
        assert wanted in ratios, f"missing preset {wanted}"
    for (a, b), preset in ratios.items():
        width, height = preset["width"], preset["height"]
        assert width % 32 == 0 and height % 32 == 0, preset
        assert abs(width * height / 1024**2 - 1) <= 0.10, preset
        assert abs(math.log((width / height) / (a / b))) <= 0.05, preset
        # The one rule: the reference pipeline's resize of an a:b image to area ~1024^2.
        assert (width, height) == reference_size(a, b, 1024), preset
        assert preset["label"].startswith(f"{a}:{b}") and f"{width}x{height}" in preset["label"]
        if (b, a) in ratios:
            assert (ratios[(b, a)]["width"], ratios[(b, a)]["height"]) == (height, width)
    assert ratios[(1, 1)]["width"] == ratios[(1, 1)]["height"] == 1024
    assert (ratios[(16, 9)]["width"], ratios[(16, 9)]["height"]) == (1376, 768)
    assert len(set(labels)) == len(labels)
    lookups = call(sandbox, ("presetFor", [1376, 768]), ("presetFor", [0, 0]), ("presetFor", [1000, 768]),
                   ("presetFor", [0, 1024]))
    assert lookups == ["16:9 (1376x768)", "follow reference (0x0)", "custom", "custom"]


SIDES = [1, 17, 31, 32, 33, 48, 64, 100, 255, 333, 512, 640, 720, 800, 1000, 1023, 1024, 1080, 1200, 1333, 1536,
         1920, 2048, 3000, 4096, 7000]
RESOLUTIONS = [0, 32, 48, 80, 256, 512, 768, 1000, 1024, 1040, 1328, 2048, 4096]


def test_reference_size_matches_python_exactly(sandbox):
    grid = [(w, h, r) for w in SIDES for h in SIDES for r in RESOLUTIONS]
    got = call(sandbox, *[("referenceSize", list(args)) for args in grid])
    mismatches = [(args, tuple(js), reference_size(*args)) for args, js in zip(grid, got)
                  if tuple(js) != reference_size(*args)]
    assert not mismatches, f"{len(mismatches)} of {len(grid)} differ, e.g. {mismatches[:5]}"
    # Python's round() sends halves to even: a 100x100 image at resolution 80 is 2.5 x 32 per side -> 64.
    assert reference_size(100, 100, 80) == (64, 64)
    assert call(sandbox, ("referenceSize", [100, 100, 80]), ("roundHalfEven", [2.5]), ("roundHalfEven", [3.5]),
                ("roundHalfEven", [2.4999])) == [[64, 64], 2, 4, 2]


def test_padded_reference_size_matches_python_exactly(sandbox):
    """fit = pad: the canvas the Reference pads to (model/encoders/references.py `_padded_reference`)."""
    grid = [(w, h, r) for w in SIDES for h in SIDES for r in RESOLUTIONS if w * h <= 4096 * 4096]
    got = call(sandbox, *[("paddedReferenceSize", list(args)) for args in grid])

    def python(w, h, r):
        own = fit_inside(w, h, r * r) if r else (w, h)
        return padded_size(*own, min_pixels=MIN_VLM_PIXELS)

    mismatches = [(args, tuple(js), python(*args)) for args, js in zip(grid, got) if tuple(js) != python(*args)]
    assert not mismatches, f"{len(mismatches)} of {len(grid)} differ, e.g. {mismatches[:5]}"
    assert call(sandbox, ("paddedReferenceSize", [270, 262, 0]), ("paddedReferenceSize", [100, 90, 0])) == [
        [288, 288], [256, 256]]


def test_reference_size_rejects_what_python_rejects(sandbox):
    results = json.loads(_node(HELPERS / "call.mjs", sandbox / "qi21_estimate.js",
                               stdin=json.dumps([["referenceSize", [0, 10, 1024]], ["referenceSize", [10, 10, -32]]])))
    assert all("error" in r for r in results)
    for args in [(0, 10, 1024), (10, 10, -32)]:
        with pytest.raises(ValueError):
            reference_size(*args)


def test_cache_bytes_are_half_a_mib_per_prefix_token_in_bf16(sandbox):
    tokens = [0, 1, 10, 4096, 8300, 41_000]
    got = call(sandbox, *[("cacheBytes", [n]) for n in tokens])
    assert FULL_MODEL_BYTES_PER_TOKEN == MIB // 2
    assert got == [n * MIB // 2 for n in tokens]
    # A different model shape / dtype goes through the same formula.
    assert call(sandbox, ("cacheBytes", [100, {"layers": 2, "heads": 4, "headDim": 128, "bytesPerElement": 4}])) == \
        [2 * 2 * 4 * 128 * 100 * 4]


def test_quantized_cache_bytes_match_the_planners(sandbox):
    from qi21.model.prefix_cache.storage_formats import cache_row_bytes

    tokens = [1, 75, 12_363]
    for dtype in ("int8", "int4"):
        got = call(sandbox, *[("cacheBytes", [n, {}, dtype]) for n in tokens])
        assert got == [2 * 32 * n * cache_row_bytes(dtype, 4096, 2) for n in tokens]
        assert got[-1] <= (0.52 if dtype == "int8" else 0.27) * tokens[-1] * MIB // 2
    (estimate,) = call(sandbox, ("estimatePrefix", [[{"promptChars": 40, "references": []}], {}, "int4"]))
    assert estimate["bytes"] == 2 * 32 * estimate["tokens"] * 2052
    assert call(sandbox, ("formatEstimate", [estimate]))[0].endswith("(int4)")


def _expected_prefix(prompt_chars, references):
    """The estimate's formula, spelled out: template 10 + ceil(chars / 4) (at least 1) + per reference 8 tag tokens
    and (H/16)(W/16) latent tokens of its resized size."""
    tokens = 10 + max(1, math.ceil(prompt_chars / 4))
    for width, height, resolution in references:
        w, h = reference_size(width, height, resolution)
        tokens += 8 + (h // 16) * (w // 16)
    return tokens


def test_prefix_tokens_follow_the_formula(sandbox):
    cases = [
        (0, []),
        (5, []),
        (400, []),
        (120, [(1600, 1200, 1024)]),
        (37, [(1024, 1024, 1024), (768, 1344, 512), (3000, 2000, 0)]),
    ]
    calls = [("prefixTokens", [chars, [list(reference_size(*ref)) for ref in refs]]) for chars, refs in cases]
    got = call(sandbox, *calls)
    assert got == [_expected_prefix(chars, refs) for chars, refs in cases]
    assert got[0] == 11  # an empty prompt is encoded as one space
    assert got[3] == 10 + 30 + 8 + (896 // 16) * (1184 // 16)  # 1600x1200 -> 1184x896 -> 4144 latent tokens
    # A 1024-resolution reference alone: 4096 latent tokens (2 GiB of cache), as the Reference node's tooltip says.
    assert call(sandbox, ("latentTokens", [1024, 1024])) == [4096]


def test_estimate_sums_prompts_assumes_unknown_images_square_and_formats(sandbox):
    prompts = [
        {"promptChars": 80, "references": [{"width": 1600, "height": 1200, "resolution": 1024},
                                           {"width": None, "height": None, "resolution": 512}]},
        {"promptChars": 8, "references": [{"width": None, "height": None, "resolution": 0}]},
    ]
    (estimate,) = call(sandbox, ("estimatePrefix", [prompts]))
    positive = _expected_prefix(80, [(1600, 1200, 1024), (512, 512, 512)])
    negative = _expected_prefix(8, [(1024, 1024, 0)])  # resolution 0 and size unknown: 1024 square
    assert estimate["perPrompt"] == [positive, negative]
    assert estimate["tokens"] == positive + negative
    assert estimate["bytes"] == estimate["tokens"] * MIB // 2
    assert estimate["assumed"] == 2
    on, off, one = call(sandbox, ("formatEstimate", [estimate]), ("formatEstimate", [estimate, {"cacheOn": False}]),
                        ("formatEstimate", [{"tokens": 8300, "bytes": 8300 * MIB // 2, "perPrompt": [8300]}]))
    assert one == "~8,300 tokens · ~4.1 GiB (bf16)"
    assert on.startswith(f"~{positive + negative:,} tokens (2 prompts) · ~") and on.endswith("GiB (bf16)")
    assert off.endswith("cache off")
    assert call(sandbox, ("formatBytes", [512 * MIB]), ("formatCount", [1234567])) == ["512.0 MiB", "1,234,567"]


# ------------------------------------------------------------------------------ the extension, with a fake app

@pytest.fixture(scope="module")
def full(sandbox):
    return drive(sandbox, "full")


def test_extension_registers_once_with_its_hooks(full):
    assert full["warnings"] == []
    assert len(full["extensions"]) == 1
    assert {"beforeRegisterNodeDef", "nodeCreated", "setup"} <= set(full["extensions"][0]["hooks"])
    assert full["timers"] and all(ms >= 500 for ms in full["timers"])  # a cheap poll, not a busy loop


def test_extension_registers_the_kept_cache_ceiling_setting_the_server_reads(full):
    from qi21.nodes.bridge import KEPT_CACHE_BUDGET_SETTING

    (setting,) = full["extensions"][0]["settings"]
    assert setting["id"] == KEPT_CACHE_BUDGET_SETTING  # the id nodes/bridge.py looks up in comfy.settings.json
    assert setting["type"] == "number" and setting["defaultValue"] == 0 and setting["attrs"]["min"] == 0
    assert "evicted" in setting["tooltip"] and "0 (default)" in setting["tooltip"]


FRONT_END_WIDGETS = ["qi21_aspect_preset", "qi21_prefix_estimate", "qi21_run_report"]


@pytest.mark.parametrize("sampler", ["sampler", "turbo"])
def test_front_end_widgets_are_appended_and_never_serialized(full, sampler):
    node = full["created"][sampler]
    names = [w["name"] for w in node["widgets"]]
    assert names[-3:] == FRONT_END_WIDGETS
    schema_widgets = names[:-3]
    for widget in node["widgets"][-3:]:
        assert widget["serialize"] is False and widget["optionsSerialize"] is False
    # Saved workflow: positional values only for the schema's widgets, no holes; named values likewise.
    assert len(node["widgets_values"]) == len(schema_widgets)
    assert None not in node["widgets_values"]  # a hole would come back as null
    assert list(node["widgets_values_named"]) == schema_widgets
    # API prompt: only the schema's inputs.
    assert set(node["prompt"]) == set(schema_widgets)
    preset = node["widgets"][-3]
    assert preset["type"] == "combo" and preset["values"][0] == "custom"
    assert preset["value"] == "follow reference (0x0)"  # width = height = 0 by default


def test_preset_fills_width_height_and_flips_to_custom_on_hand_edits(full):
    steps = full["presetSteps"]
    assert steps[0] == ["16:9 (1376x768)", 1376, 768]
    assert steps[1] == ["custom", 1000, 768]
    assert steps[2] == ["custom", 1000, 1000]
    assert steps[3] == ["custom", 1024, 1000]
    assert steps[4] == ["1:1 (1024x1024)", 1024, 1024]  # a hand edit that lands on a preset shows it
    assert steps[5] == ["custom", 1024, 1024]  # choosing custom leaves the sizes alone
    assert steps[6] == ["follow reference (0x0)", 0, 0]
    assert steps[7] == ["2:3 (832x1248)", 832, 1248]
    after = full["afterPresets"]
    named = after["widgets_values_named"]
    assert (named["width"], named["height"]) == (832, 1248)
    assert "qi21_aspect_preset" not in named and "qi21_aspect_preset" not in after["prompt"]
    assert full["afterConfigure"] == "16:9 (1376x768)"  # reloaded workflow: preset derived from the sizes


def test_estimate_walks_the_graph_and_follows_the_formula(full):
    ref1 = (1600, 1200, 1024)  # LoadImage preview 1600x1200, resolution 1024
    ref2 = (512, 512, 512)  # image of unknown size: a square at its resolution 512
    positive = _expected_prefix(40, [ref1, ref2])
    negative = _expected_prefix(len("blurry"), [])

    def text(tokens, prompts=1):
        gib = tokens * (MIB // 2) / 1024**3
        return f"~{tokens:,} tokens{' (2 prompts)' if prompts == 2 else ''} · ~{gib:.1f} GiB (bf16)"

    assert full["unconnected"] == "connect positive"
    assert full["positive"] == text(positive)
    assert "assumed square" in full["tooltip"]
    assert full["negativeCfg1"] == text(positive)  # cfg 1: the negative prompt is not used, no second cache
    assert full["negativeCfg4"] == text(positive + negative, prompts=2)
    assert full["cacheOff"] == f"~{positive + negative:,} tokens (2 prompts) · cache off"
    bypassed = _expected_prefix(40, [ref2])
    assert full["bypassed"] == f"~{bypassed:,} tokens · ~{bypassed * (MIB // 2) / MIB:.1f} MiB (bf16)"
    empty = _expected_prefix(0, [ref1, ref2])
    assert full["emptyPrompt"] == text(empty)
    assert full["turbo"] == text(empty)
    assert full["afterHandEdit"] == text(empty)  # read-only: an edit is put back
    quantized = {dtype: 2 * 32 * empty * (4096 * bits // 8 + 4) for dtype, bits in (("int8", 8), ("int4", 4))}
    assert full["int8"] == f"~{empty:,} tokens · ~{quantized['int8'] / 1024**3:.1f} GiB (int8)"
    assert full["int4"] == f"~{empty:,} tokens · ~{quantized['int4'] / 1024**2:.1f} MiB (int4)"  # under 1 GiB
    assert "device auto, dtype int8" in full["int8Tooltip"]
    assert full["optionsOff"] == f"~{empty:,} tokens · cache off"
    assert full["optionsBypassed"] == text(empty)


@pytest.mark.parametrize("scenario", ["no-register", "odd-node"])
def test_a_different_front_end_api_gives_one_warning_and_no_error(sandbox, scenario):
    result = drive(sandbox, scenario)
    assert result["loaded"] is True
    assert len(result["warnings"]) == 1 and "Qwen-Image 2.1" in result["warnings"][0]


# ----------------------------------------------------------------------------- the run report (web/qi21_report.js)

GIB = 1024**3
#: A report as nodes/samplers.py returns it (model/sampling/loop.py's keys), a kept-cache hit on a GPU.
HIT = {"prefix_tokens": 4171, "target_tokens": 4096, "batch": 1, "steps": 8, "cache": "hit",
       "cache_bytes": 4171 * MIB // 2, "cache_device": "cuda:0", "prefill_seconds": None, "step_seconds": 0.1612}
#: A miss with notes, as a CPU run with a floored size and an unused negative prompt reports it.
MISS = {"prefix_tokens": 5204, "target_tokens": 3968, "batch": 2, "steps": 40, "cache": "miss",
        "cache_bytes": 5204 * MIB // 2, "cache_device": "cpu", "prefill_seconds": 1.2345, "step_seconds": 0.0456,
        "notes": ["size 1000x1000 floored to 992x992 (multiples of 32)",
                  "negative prompt ignored: true CFG needs cfg > 1"]}


def report_call(sandbox, *calls):
    return call(sandbox, *calls, module="qi21_report.js")


def test_report_summary_is_one_compact_line(sandbox):
    hit, miss, off = report_call(sandbox, ("summarizeReport", [HIT]), ("summarizeReport", [MISS]),
                                 ("summarizeReport", [{"cache": "off", "prefix_tokens": 300, "cache_bytes": 0,
                                                       "cache_device": None, "prefill_seconds": None,
                                                       "step_seconds": 2.5}]))
    assert hit == "cache hit · 4,171 prefix tokens · 2.0 GiB on cuda:0 · step 0.16 s"  # the example
    assert miss == "cache miss · 5,204 prefix tokens · 2.5 GiB on cpu · prefill 1.23 s · step 45.6 ms"
    assert off == "cache off · 300 prefix tokens · step 2.50 s"  # no cache: no size, no device
    partial = dict(MISS, cache="partial", prefix_tokens=4160, prefix_rows_reused=4131, prefix_rows_computed=29)
    line, detail = report_call(sandbox, ("summarizeReport", [partial]), ("reportDetail", [partial]))
    assert line.startswith("partial: 4,131 of 4,160 prefix rows reused · 4,160 prefix tokens")  # the line
    assert "prefix rows: 4,131 reused, 29 computed in step 1" in detail.split("\n")
    assert report_call(sandbox, ("formatSeconds", [0.0043]), ("formatSeconds", [0.16]), ("formatSeconds", [12.34]),
                       ("formatSeconds", [123.4]), ("formatSeconds", [None])) == \
        ["4.3 ms", "0.16 s", "12.3 s", "123 s", "?"]


def test_report_names_a_quantized_cache(sandbox):
    report = {"cache": "miss", "prefix_tokens": 4171, "cache_bytes": 1_069_000_000, "cache_device": "cuda:0",
              "cache_dtype": "int8"}
    summary, detail = report_call(sandbox, ("summarizeReport", [report]), ("reportDetail", [report]))
    assert summary == "cache miss · 4,171 prefix tokens · 1019.5 MiB int8 on cuda:0"
    assert "cache dtype: int8 (quantized per token; the size includes the scales)" in detail
    assert "cache_dtype:" not in detail  # described, not listed as an unknown key


def test_report_says_what_the_step_cache_skipped_and_each_steps_indicator(sandbox):
    step_cache = {"mode": "t8", "threshold": 0.08, "window": [0.1, 0.85], "max_skips": 2, "per": "step", "run": 3,
                  "skipped": 2, "blocks_skipped_share": 0.3875, "indicator": [None, 0.2, 0.05, 0.0412, 0.12],
                  "pattern": "FFSSF"}
    report = dict(MISS, step_cache=step_cache)
    summary, detail = report_call(sandbox, ("summarizeReport", [report]), ("reportDetail", [report]))
    assert summary.endswith(" · step 45.6 ms · skipped 2 of 5 steps")
    lines = detail.split("\n")
    assert ("step cache: skipped 2 of 5 steps (39% of the block work); t8, threshold 0.08, window 0.1-0.85, at most 2 "
            "in a row") in lines
    assert ("indicator per step (S = skipped): 1: -, 2: 0.2000, 3: 0.0500 S, 4: 0.0412 S, 5: 0.1200") in lines
    assert "step_cache:" not in detail  # described, not listed as an unknown key
    calls = report_call(sandbox, ("summarizeReport", [{"step_cache": dict(step_cache, per="model call")}]))
    assert calls == ["skipped 2 of 5 calls"]
    controlled = dict(MISS, step_cache=dict(step_cache, control="recompute"))
    detail = report_call(sandbox, ("reportDetail", [controlled]))[0]
    assert any(line.endswith("at most 2 in a row, Fun ControlNet recomputed on skipped steps")
               for line in detail.split("\n"))


def test_report_with_missing_keys_or_odd_values_shows_what_is_there(sandbox):
    got = report_call(
        sandbox,
        ("summarizeReport", [{}]),
        ("summarizeReport", [{"cache": "miss"}]),
        ("summarizeReport", [{"prefix_tokens": "many", "cache_bytes": None, "step_seconds": "slow",
                              "cache_device": "cuda:1"}]),
        ("summarizeReport", [{"cache_bytes": 3 * GIB}]),  # bytes without a device: no "on ..."
        ("summarizeReport", [None]),
        ("reportNotes", [{"notes": "one note"}]),
        ("reportNotes", [{"notes": ["a", None, "", {"b": 1}]}]),
        ("reportNotes", [{}]),
    )
    assert got == ["no details reported", "cache miss", "no details reported", "3.0 GiB", "no report",
                   ["one note"], ["a", '{"b":1}'], []]


def test_report_detail_explains_every_key_then_the_notes(sandbox):
    detail, later, extra = report_call(
        sandbox, ("reportDetail", [MISS]), ("reportDetail", [HIT, {"index": 3, "count": 3}]),
        ("reportDetail", [{"cache": "hit", "peak_bytes": 12 * GIB, "loras": [{"name": "style.safetensors",
                                                                           "strength": 0.8}],
                           "plan": {"weights": "cuda:0", "decode": "cpu"}, "new_key": [1, 2]}]))
    lines = detail.split("\n")
    assert lines[0] == "Qwen-Image 2.1 sampler: last run"
    assert "prefix cache: miss (step 1 computed the prefix and cached it; later steps reused it)" in lines
    assert "prefix tokens: 5,204 (prompt and references, all prompts)" in lines
    assert "target tokens: 3,968 per image" in lines
    assert "batch: 2 images sharing one cache" in lines
    assert "steps: 40" in lines
    assert f"cache size: 2.5 GiB ({5204 * MIB // 2:,} bytes)" in lines
    assert "cache device: cpu" in lines
    assert "prefill (step 1): 1.23 s" in lines
    assert "mean step after the prefill: 45.6 ms" in lines
    assert lines[-2:] == ["⚠ size 1000x1000 floored to 992x992 (multiples of 32)",
                          "⚠ negative prompt ignored: true CFG needs cfg > 1"]
    assert later.startswith("Qwen-Image 2.1 sampler: run 3 of 3 (the last is shown)\n")
    assert "prefix cache: hit (the prefix came from a kept cache: no prefill this run)" in later
    assert "prefill" not in later.replace("no prefill", "").replace("after the prefill", "")  # none on a hit
    assert "peak device memory: 12.0 GiB" in extra
    assert "LoRAs: style.safetensors (0.8)" in extra
    assert "plan: weights cuda:0, decode cpu" in extra
    assert "new_key: [1,2]" in extra  # keys added later still reach the tooltip


def test_report_view_shows_the_last_run_counts_runs_and_marks_notes(sandbox):
    one, many, cached, empty, bare, other = report_call(
        sandbox, ("reportView", [{"qi21_report": [MISS]}]), ("reportView", [[HIT, MISS, HIT]]),
        ("reportView", [[HIT], {"cached": True}]), ("reportView", [{"qi21_report": []}]),
        ("reportView", [MISS]), ("reportView", [{"images": [{"filename": "x.png"}]}]))
    assert one["summary"] == "cache miss · 5,204 prefix tokens · 2.5 GiB on cpu · prefill 1.23 s · step 45.6 ms"
    assert one["runs"] is None and one["empty"] is False
    assert one["notes"] == [{"text": "⚠ size 1000x1000 floored to 992x992 (multiples of 32)", "warning": True},
                            {"text": "⚠ negative prompt ignored: true CFG needs cfg > 1", "warning": True}]
    assert one["tooltip"].startswith("Qwen-Image 2.1 sampler: last run\n")
    assert many["summary"] == "last of 3 runs: cache hit · 4,171 prefix tokens · 2.0 GiB on cuda:0 · step 0.16 s"
    assert many["runs"] == "last of 3 runs" and many["notes"] == []
    assert many["tooltip"].startswith("Qwen-Image 2.1 sampler: run 3 of 3")
    assert cached["summary"].startswith("not re-run (ComfyUI cache) · cache hit")
    assert "the sampler did not run" in cached["tooltip"]
    assert empty == {"empty": True, "summary": "", "runs": None, "notes": [], "tooltip": ""}
    assert bare["summary"] == one["summary"]  # a bare report dict works too
    assert other["empty"] is True  # another node's UI output is no report
    line, quiet = report_call(sandbox, ("reportLine", [one]), ("reportLine", [many]))
    assert line == one["summary"] + " · ⚠ 2 notes" and quiet == many["summary"]


def test_phase_follows_comfyui_progress(sandbox):
    phases = report_call(
        sandbox,
        ("describePhase", [{"running": False}]),
        ("describePhase", [{"running": True, "value": 0, "max": 8}]),  # step 1 runs: no progress event yet
        ("describePhase", [{"running": True, "value": 1, "max": 8}]),  # step 1 done: the cached steps
        ("describePhase", [{"running": True, "value": 7, "max": 8}]),
        ("describePhase", [{"running": True, "value": 8, "max": 8}]),
        ("describePhase", [{"running": True, "value": 0, "max": 8, "keepCache": True}]),
        ("describePhase", [{"running": True, "value": 3, "max": 8, "prefixCache": "off"}]),
        ("describePhase", [{"running": True}]),  # steps unknown
        ("describeStop", ["interrupted", {"value": 2, "max": 8}]),
        ("describeStop", ["error", {"value": 0, "max": None}]),
    )
    assert phases[0] is None
    assert phases[1] == {"short": "prefill 1/8", "text": "step 1/8 · prefill: prompt and references into the cache"}
    assert phases[2] == {"short": "cached 2/8", "text": "step 2/8 · cached step: image rows only"}
    assert phases[3]["short"] == "cached 8/8"
    assert phases[4] == {"short": "done 8/8", "text": "8 steps done: finishing"}
    assert phases[5]["text"] == "step 1/8 · prefill, or a kept cache (keep_cache)"
    assert phases[6] == {"short": "step 4/8", "text": "step 4/8 · full sequence (prefix cache off)"}
    assert phases[7]["short"] == "prefill 1"
    assert phases[8:] == ["⚠ interrupted at step 3/8", "⚠ failed at step 1"]


@pytest.fixture(scope="module")
def report_run(sandbox):
    return drive(sandbox, "report")


def _lines(view):
    return [(line["kind"], line["text"]) for line in view["lines"]]


def test_report_widget_is_appended_front_end_only_in_both_renderings(report_run):
    assert report_run["warnings"] == []
    for name, kind in (("base", "qi21_report"), ("turbo", "text")):  # a DOM widget; without one, a text widget
        node = report_run["created"][name]
        widget = node["widgets"][-1]
        assert (widget["name"], widget["type"], widget["label"]) == ("qi21_run_report", kind, "last run")
        assert widget["serialize"] is False and widget["optionsSerialize"] is False
    assert _lines(report_run["initial"]["base"]) == [("placeholder", "no run yet: the run report shows here")]
    assert report_run["initial"]["turbo"]["value"] == "no run yet: the run report shows here"


def test_report_shows_after_the_run_with_phases_while_it_runs(report_run):
    r = report_run
    assert _lines(r["queued"]) == [("placeholder", "queued: the run report shows here after the run")]
    assert _lines(r["step1"]) == [("phase", "step 1/40 · prefill: prompt and references into the cache")]
    assert r["title1"] == [{"text": "prefill 1/40", "x": 305, "y": -15}]  # title bar, right end, beside the bar
    assert _lines(r["step2"]) == [("phase", "step 2/3 · cached step: image rows only")]
    assert _lines(r["finishing"]) == [("phase", "3 steps done: finishing")]
    hit = "cache hit · 4,171 prefix tokens · 2.0 GiB on cuda:0 · step 0.16 s"
    assert _lines(r["afterBase"]) == [("summary", hit)] and r["afterBase"]["value"] == hit
    assert r["afterBase"]["tooltip"].startswith("Qwen-Image 2.1 sampler: last run\nprefix cache: hit")
    assert r["titleIdle"] == []  # nothing drawn once it is done
    assert r["turboStep1"]["value"] == "step 1/8 · prefill: prompt and references into the cache"  # Turbo: 8 steps
    # The Turbo sampler (text-widget fallback): one line with the note count, the notes in the tooltip.
    turbo = r["afterRun"]["turbo"]
    assert turbo["value"] == \
        "cache miss · 31 prefix tokens · 62.0 KiB on cpu · prefill 0.43 s · step 52.3 ms · ⚠ 2 notes"
    assert turbo["tooltip"].endswith("⚠ size 1000x1000 floored to 992x992 (multiples of 32)\n"
                                     "⚠ negative prompt ignored: true CFG needs cfg > 1")
    assert "batch: 2 images sharing one cache" in turbo["tooltip"]
    # Two samplers in one graph: each keeps its own report; a redraw changes nothing.
    assert r["afterRun"]["base"]["value"] == hit
    assert r["redrawn"] == r["afterRun"]["base"]
    assert r["sizes"]["after"][1] >= r["sizes"]["needed"][1]  # the node is tall enough for its report


def test_notes_are_marked_as_warnings_on_the_dom_widget(report_run):
    assert all(line["color"] for line in report_run["interrupted"]["lines"] if line["kind"] == "warning")
    assert _lines(report_run["interrupted"]) == [("warning", "⚠ interrupted at step 3/8")]


def test_report_is_never_saved_nor_queued(report_run):
    for name in ("base", "turbo"):
        saved = report_run["saved"][name]
        assert saved["properties"] == {}
        schema = [w["name"] for w in saved["widgets"] if w["name"] not in FRONT_END_WIDGETS]
        assert list(saved["widgets_values_named"]) == schema and len(saved["widgets_values"]) == len(schema)
        assert set(saved["prompt"]) == set(schema)
        text = json.dumps({k: saved[k] for k in ("properties", "widgets_values", "widgets_values_named", "prompt",
                                                  "title")})
        for word in ("prefix tokens", "cache hit", "cache miss", "qi21_run_report", "qi21_report"):
            assert word not in text


def test_the_report_shows_the_last_of_a_batch_a_comfyui_cache_hit_and_clears_on_queue(report_run):
    r = report_run
    assert r["batch"]["value"] == "last of 3 runs: cache hit · 102 prefix tokens · 2.0 GiB on cuda:0 · step 0.16 s"
    assert r["batch"]["tooltip"].startswith("Qwen-Image 2.1 sampler: run 3 of 3")
    assert r["turboAfterBatch"]["value"] == "queued: the run report shows here after the run"  # cleared on queue
    assert r["twoInOne"]["value"].startswith("last of 2 runs: cache hit · 7 prefix tokens")
    # ComfyUI's cache: the sampler does not run; the node shows the last report it had, marked.
    assert r["cachedAnnounced"]["value"] == \
        "not re-run (ComfyUI cache) · cache hit · 7 prefix tokens · 2.0 GiB on cuda:0 · step 0.16 s"  # the last one
    assert r["cached"]["value"].startswith("not re-run (ComfyUI cache) · cache hit · 4,171 prefix tokens")
    assert r["cachedNoUi"]["value"] == r["cached"]["value"]
    assert "the sampler did not run" in r["cachedNoUi"]["tooltip"]
    assert r["cachedNever"]["value"] == "not re-run (ComfyUI cache): no report in this page yet"
    assert _lines(r["cacheOff"]) == [("phase", "step 3/8 · full sequence (prefix cache off)")]
    assert _lines(r["keepCache"]) == [("phase", "step 1/8 · prefill, or a kept cache (keep_cache)")]
    assert _lines(r["requeued"]) == [("placeholder", "queued: the run report shows here after the run")]
    assert r["sparse"]["value"] == "cache off"
    assert "future_key: 3" in r["sparse"]["tooltip"]
    assert r["notAReport"] == r["sparse"]  # another UI entry leaves the report alone
    assert _lines(r["subgraph"]) == [("phase", "step 2/8 · cached step: image rows only")]  # "7:12" execution ids
    assert _lines(r["rootWhileSubgraph"]) == [("placeholder", "queued: the run report shows here after the run")]


def test_without_comfyui_api_events_reports_still_arrive(sandbox):
    result = drive(sandbox, "no-api")
    assert result["loaded"] is True
    (warning,) = result["warnings"]
    assert "Qwen-Image 2.1" in warning and "(live)" in warning
    assert result["view"]["value"] == "cache miss · 12 prefix tokens"
