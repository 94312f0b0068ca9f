"""The front-end extension (web/): its arithmetic under Node against the Python code, and the extension's wiring
with a stubbed ComfyUI app and a fake graph (tests/web/). No browser and no ComfyUI: those checks are separate.

Every test skips when `node` is not on PATH.
"""

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from qi21.model.references import reference_size

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
    (root / "package.json").write_text('{"type": "module"}\n')
    return pack


def _node(*args, stdin: str | None = None) -> str:
    result = subprocess.run([NODE, *map(str, args)], input=stdin, capture_output=True, text=True, timeout=60,
                            cwd=HELPERS)
    assert result.returncode == 0, f"node {' '.join(map(str, args))} failed:\n{result.stderr}"
    return result.stdout


def call(sandbox: Path, *calls):
    """Call exported functions of web/qi21_estimate.js under Node: [(name, [args])] -> [result]."""
    results = json.loads(_node(HELPERS / "call.mjs", sandbox / "qi21_estimate.js", stdin=json.dumps(calls)))
    for (name, args), result in zip(calls, results):
        assert "error" not in result, f"{name}{tuple(args)} raised: {result['error']}"
    return [result["value"] for result in results]


def drive(sandbox: Path, scenario: str) -> dict:
    return json.loads(_node(HELPERS / "extension_driver.mjs", sandbox / "qi21.js", scenario))


# ------------------------------------------------------------------------------------------- pure arithmetic

def test_every_js_file_in_web_is_an_es_module_node_can_load(sandbox):
    # ComfyUI imports every .js under WEB_DIRECTORY as a module; each must parse and load (qi21.js with the stub).
    files = sorted(p.name for p in WEB.glob("*.js"))
    assert {"qi21.js", "qi21_estimate.js"} <= set(files)
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


@pytest.mark.parametrize("sampler", ["sampler", "turbo"])
def test_front_end_widgets_are_appended_and_never_serialized(full, sampler):
    node = full["created"][sampler]
    names = [w["name"] for w in node["widgets"]]
    assert names[-2:] == ["qi21_aspect_preset", "qi21_prefix_estimate"]
    schema_widgets = names[:-2]
    for widget in node["widgets"][-2:]:
        assert widget["serialize"] is False and widget["optionsSerialize"] is False
    # Saved workflow: positional values only for the schema's widgets, no holes; named values likewise.
    assert len(node["widgets_values"]) == len(schema_widgets)
    assert None not in node["widgets_values"]  # a hole would come back as null
    assert list(node["widgets_values_named"]) == schema_widgets
    # API prompt: only the schema's inputs.
    assert set(node["prompt"]) == set(schema_widgets)
    preset = node["widgets"][-2]
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


@pytest.mark.parametrize("scenario", ["no-register", "odd-node"])
def test_a_different_front_end_api_gives_one_warning_and_no_error(sandbox, scenario):
    result = drive(sandbox, scenario)
    assert result["loaded"] is True
    assert len(result["warnings"]) == 1 and "Qwen-Image 2.1" in result["warnings"][0]
