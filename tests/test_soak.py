"""The soak's short version, in seconds and without ComfyUI: the seeded mix of tests/soak_fixtures.py run one prompt
after another through the headless runner (demo/workflow_runner.py: loaders' outputs reused as ComfyUI's cache
reuses them, the samplers' kept store under a ceiling set in the user settings file), with interrupts (at the
first check: the prefill) and frees. Then every completed prompt's latents equal the same prompt run alone by a
fresh runner (keep_cache off, an empty store; to 1e-5 of the latents' scale, `soak.relative_difference`), the
store never went over its ceiling and did evict, and a free leaves it empty. The long, concurrent version against
a real ComfyUI is tests/test_comfyui_soak.py."""

import json

import pytest
import torch
from safetensors.torch import load_file

import soak_fixtures as soak
from qi21.demo.workflow_runner import Runner
from qi21.nodes import bridge
from qi21.nodes.placement import KEPT_CACHES

PROMPTS, SEED = 14, 28  # seed 28: every kind, 3 interrupts, 3 frees (with and without unloading)
CEILING_BYTES = 448 * 2**10  # a few tiny prefix caches: the mix must evict to stay under it


def _latents(result) -> torch.Tensor:
    (path,) = [p for p in result.images if str(p).endswith(".latent")]
    return load_file(str(path))["latent_tensor"]


def _run(runner, item, folder, prompt=None) -> object:
    path = folder / f"p{item.index:04}.json"
    path.write_text(json.dumps(prompt or item.prompt))
    return runner.run(path)


@pytest.fixture
def settings(tmp_path):
    (tmp_path / "user" / "default").mkdir(parents=True)
    (tmp_path / "user" / "default" / bridge.SETTINGS_FILE).write_text(
        json.dumps({bridge.KEPT_CACHE_BUDGET_SETTING: CEILING_BYTES / 2**30}))
    bridge.set_user_root(tmp_path / "user")
    KEPT_CACHES.clear()
    KEPT_CACHES.peak_bytes = 0  # the store's peak is since the process started: earlier tests' caches are not ours
    yield
    bridge.set_user_root(None)
    KEPT_CACHES.set_budget(None)
    KEPT_CACHES.clear()


def test_a_short_soak_through_the_headless_runner(models_root, tmp_path, settings):
    soak.write_images(tmp_path / "input")
    mix = soak.soak_mix(PROMPTS, SEED, comfy_samplers=False, interrupts=0.2, frees=0.2, quiet_start=2)
    assert {item.kind for item in mix} == set(soak.KINDS) - {"comfy_sampler"}, "the seed no longer mixes every kind"
    session = Runner(tmp_path / "out", tmp_path / "input", quick=False)
    evictions, outcomes, peak = KEPT_CACHES.evictions, {}, 0
    for item in mix:
        if item.interrupt_after is not None:
            bridge.request_interrupt()  # stops the run at its first check (the prefill's first block)
        result = _run(session, item, tmp_path)
        if item.interrupt_after is not None:
            assert not result.ok and "interrupted" in result.error, result.error
            outcomes[item.index] = {"state": "interrupted"}
        else:
            assert result.ok, f"prompt {item.index} ({item.kind}): {result.error}\n{result.details}"
            outcomes[item.index] = {"state": "completed", "latents": _latents(result)}
        assert KEPT_CACHES.kept_bytes() <= CEILING_BYTES
        peak = max(peak, KEPT_CACHES.peak_bytes)
        if item.free_after:  # ComfyUI's /free: unload_models unloads the models (their kept caches go with them),
            KEPT_CACHES.clear()  # free_memory drops the node outputs (the models, then their caches, are collected)
            if item.free_after.get("free_memory"):
                session.loader_cache.clear()
            assert KEPT_CACHES.kept_bytes() == 0 and len(KEPT_CACHES) == 0
    counts = soak.summary(mix, outcomes)
    assert counts["states"].get("interrupted", 0) >= 1 and counts["states"]["completed"] >= PROMPTS // 2
    evicted = KEPT_CACHES.evictions - evictions
    print(f"\nsoak: {counts}, kept peak {peak:,} B of {CEILING_BYTES:,} B, {evicted} evictions")
    assert evicted > 0 and peak <= CEILING_BYTES

    KEPT_CACHES.clear()
    alone = Runner(tmp_path / "alone", tmp_path / "input", quick=False)
    worst = 0.0
    for item in mix:
        if outcomes[item.index]["state"] != "completed":
            continue
        KEPT_CACHES.clear()
        result = _run(alone, item, tmp_path, soak.reference_prompt(item.prompt))
        assert result.ok, result.error
        expected, got = _latents(result), outcomes[item.index]["latents"]
        assert got.shape == expected.shape
        worst = max(worst, soak.relative_difference(got, expected))
    assert worst <= soak.TOLERANCE, f"a prompt of the soak differs from the same prompt run alone by {worst:.3g}"
