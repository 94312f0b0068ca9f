"""A long mixed day in one real ComfyUI server (issue 34): four concurrent API clients send a seeded random mix
(tests/soak_fixtures.py: t2i, CFG, edits with keep_cache, instruction-only changes, LoRA chains and strengths,
the Fun ControlNet, ComfyUI samplers, img2img / inpaint, batches 1-4, two DiT files), some prompts interrupted at a
random point (`/interrupt` with their prompt id), `/free` with and without unloading now and then. Afterwards:

- the server is up and answers, and every completed prompt's latents equal the same prompt run alone (keep_cache
  off) to 1e-5 of their scale: by a fresh headless runner of the pack in this process (same code, same tiny files,
  fp32), and, for the prompts with a ComfyUI sampler (which only a ComfyUI has), by a second, fresh ComfyUI server
  running them one at a time; so interrupted prompts left nothing that changed a later one;
- the server's RSS after the soak and a final `/free` is within `RSS_MARGIN` of its level after the first 10
  prompts, and the slope fitted over the last two-thirds of the soak is under `SLOPE_BOUND` bytes per prompt
  (ComfyUI's history entries are deleted once read, so its own 10,000-prompt history is not counted);
- the kept store (ceiling set through ComfyUI's settings route, as the settings panel does) never held more than
  its ceiling, evicted to stay under it, and held nothing after the final `/free`.

Runs with QI21_COMFYUI set (see tests/test_comfyui_server.py) and QI21_SOAK_PROMPTS, the prompt count, set too (300
is the count docs/measurements.md reports; it takes about 11 minutes on a 2-core CPU, so CI, which starts a real
ComfyUI for the other server tests, leaves it out); marked slow. QI21_SOAK_SEED sets the mix.
"""

import json
import os
import queue
import shutil
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

import qi21_comfy_harness as harness  # tests/comfyui/, on sys.path through pyproject's pytest `pythonpath`
import soak_fixtures as soak

pytestmark = pytest.mark.slow

PROMPTS = int(os.environ.get("QI21_SOAK_PROMPTS", "0"))
if PROMPTS <= 0:
    pytest.skip("the soak runs when QI21_SOAK_PROMPTS is set (e.g. 300, about 11 minutes on a 2-core CPU)",
                allow_module_level=True)
SEED = int(os.environ.get("QI21_SOAK_SEED", "34"))
CLIENTS = 4
BASELINE = 10  # prompts before the memory baseline (no interrupt or free among them)
CEILING_BYTES = 448 * 2**10  # an edit's prefix cache and a few prompts' (tiny set): the mix must evict
SETTING_GIB = CEILING_BYTES / 2**30  # 7 * 2**-14: exact in binary, so the server computes the same bytes
# Measured (docs/measurements.md): the RSS climbs ~60 MiB over the first ~130 prompts (the baseline's 10 already
# ran every kind once at the largest batch) and is then flat to a few MiB up to 1,000 prompts; glibc keeps what
# it holds after /free. The bounds leave room for that step, and catch a growth of 100 KiB per prompt.
RSS_MARGIN = 96 * 2**20
SLOPE_BOUND = 96 * 2**10  # bytes per prompt, fitted over the last two-thirds of the soak
PROMPT_TIMEOUT_S = 300


def _start(prefix: str) -> harness.ComfyServer:
    comfyui, python = harness.configured_comfyui()
    server = harness.ComfyServer(comfyui, python, Path(tempfile.mkdtemp(prefix=prefix)))
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    soak.write_images(server.base / "input")
    return server


@pytest.fixture(scope="module")
def servers():
    started = {}

    def get(name):
        if name not in started:
            started[name] = _start(f"qi21_soak_{name}_")
        return started[name]

    yield get
    for server in started.values():
        server.stop()
        if not os.environ.get("QI21_KEEP_COMFYUI_BASE"):
            shutil.rmtree(server.base, ignore_errors=True)


def rss_bytes(server) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS for the server process")


def _running(server, prompt_id) -> bool:
    return any(item[1] == prompt_id for item in server.get_json("/queue").get("queue_running", []))


def _wait(server, prompt_id) -> dict:
    deadline = time.monotonic() + PROMPT_TIMEOUT_S
    while time.monotonic() < deadline:
        entry = server.get_json(f"/history/{urllib.parse.quote(prompt_id)}").get(prompt_id)
        if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
            return entry
        assert server.proc.poll() is None, f"ComfyUI died during the soak\n{server.log_tail()}"
        time.sleep(0.1)
    raise AssertionError(f"prompt {prompt_id} did not finish in {PROMPT_TIMEOUT_S} s\n{server.log_tail()}")


def _latents(server, entry, save_id):
    from safetensors.torch import load_file

    (saved,) = entry["outputs"][save_id]["latents"]
    return load_file(str(server.base / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]


def _outcome(server, item, entry) -> dict:
    messages = entry["status"].get("messages", [])
    if entry["status"]["status_str"] == "success":
        report = entry["outputs"]["10"]["qi21_report"][0]
        return {"state": "completed", "latents": _latents(server, entry, item.save_id), "report": report}
    if any(kind == "execution_interrupted" for kind, _ in messages):
        return {"state": "interrupted"}
    errors = [m for kind, m in messages if kind == "execution_error"]
    return {"state": "failed", "error": errors[0].get("exception_message") if errors else messages}


def run_soak(server, mix) -> tuple[dict, list]:
    """The mix through CLIENTS concurrent clients; (outcome per prompt index, [(completed count, RSS)])."""
    work, outcomes, samples, lock = queue.Queue(), {}, [], threading.Lock()
    for item in mix:
        work.put(item)
    failures = []

    def client(number):
        while True:
            try:
                item = work.get_nowait()
            except queue.Empty:
                return
            try:
                answer = server.post_json("/prompt", {"prompt": item.prompt, "client_id": f"qi21-soak-{number}"})
                assert not answer.get("node_errors"), answer
                prompt_id = answer["prompt_id"]
                if item.interrupt_after is not None:
                    deadline = time.monotonic() + PROMPT_TIMEOUT_S
                    while not _running(server, prompt_id) and time.monotonic() < deadline:
                        if server.get_json(f"/history/{prompt_id}").get(prompt_id):
                            break  # it finished before it was seen running
                        time.sleep(0.02)
                    time.sleep(item.interrupt_after)
                    server.post_json("/interrupt", {"prompt_id": prompt_id})
                outcome = _outcome(server, item, _wait(server, prompt_id))
                # read: out of ComfyUI's history (it keeps 10,000 prompts), so its growth is not counted as ours
                server.post_json("/history", {"delete": [prompt_id]})
                if item.free_after:
                    server.post_json("/free", item.free_after)
                with lock:
                    outcomes[item.index] = outcome
                    samples.append((len(outcomes), rss_bytes(server)))
            except BaseException as error:  # noqa: BLE001 (reported after the other clients finish)
                with lock:
                    failures.append(f"prompt {item.index} ({item.kind}): {error!r}")

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, "\n".join(failures[:5]) + f"\n{server.log_tail()}"
    return outcomes, samples


def headless_reference(server, mix, outcomes, folder: Path) -> dict:
    """index -> latents of each completed prompt without a ComfyUI sampler, run alone by the pack's headless runner
    over the server's own model and input files (keep_cache off, the kept store emptied before each)."""
    from safetensors.torch import load_file

    from qi21.demo.workflow_runner import Runner
    from qi21.nodes import bridge
    from qi21.nodes.placement import KEPT_CACHES

    bridge.set_models_root(server.base / "models")
    try:
        runner, expected = Runner(folder / "out", server.base / "input", quick=False), {}
        for item in mix:
            if outcomes[item.index]["state"] != "completed" or item.kind == "comfy_sampler":
                continue
            KEPT_CACHES.clear()
            path = folder / f"p{item.index:04}.json"
            path.write_text(json.dumps(soak.reference_prompt(item.prompt)))
            result = runner.run(path)
            assert result.ok, f"prompt {item.index} alone: {result.error}"
            (latent,) = [p for p in result.images if str(p).endswith(".latent")]
            expected[item.index] = load_file(str(latent))["latent_tensor"]
        return expected
    finally:
        KEPT_CACHES.clear()
        bridge.set_models_root(None)


def test_a_long_mixed_day_in_one_server(servers, tmp_path):
    server = servers("day")
    server.post_json(f"/settings/{soak_setting()}", SETTING_GIB)  # as the settings panel saves it
    mix = soak.soak_mix(PROMPTS, SEED, comfy_samplers=True, quiet_start=BASELINE)
    started = time.monotonic()
    outcomes, samples = run_soak(server, mix)
    seconds = time.monotonic() - started
    assert server.get_json("/system_stats")["system"], "the server does not answer after the soak"
    rss_end = rss_bytes(server)
    server.free(unload_models=True, free_memory=True)
    rss_free = rss_bytes(server)
    rss_10 = next(rss for count, rss in samples if count == BASELINE)
    slope = soak.slope_per_prompt([(c, r) for c, r in samples if c >= BASELINE])
    settled = soak.slope_per_prompt([(c, r) for c, r in samples if c >= max(BASELINE, PROMPTS // 3)])

    # the kept store after /free: the next keep_cache prompt finds it empty (its own cache is all it holds)
    probe = soak.soak_mix(1, SEED + 1, comfy_samplers=False)[0]
    probe.prompt["10"]["inputs"]["keep_cache"] = True
    after = _outcome(server, probe, _wait(server, server.post_json("/prompt", {"prompt": probe.prompt})["prompt_id"]))

    reports = [o["report"] for o in outcomes.values() if o["state"] == "completed"]
    kept = [r for r in reports if "kept_bytes" in r]
    peak = max((r["kept_bytes"] for r in kept), default=0)
    evictions = sum(r.get("kept_evictions", 0) for r in reports)
    failed = {i: o["error"] for i, o in outcomes.items() if o["state"] == "failed"}

    expected = headless_reference(server, mix, outcomes, tmp_path)
    sampler_prompts = [item for item in mix if item.kind == "comfy_sampler"
                       and outcomes[item.index]["state"] == "completed"]
    if sampler_prompts:
        alone = servers("alone")
        for item in sampler_prompts:
            queued = alone.post_json("/prompt", {"prompt": soak.reference_prompt(item.prompt)})
            entry = _wait(alone, queued["prompt_id"])
            assert entry["status"]["status_str"] == "success", _outcome(alone, item, entry)
            expected[item.index] = _latents(alone, entry, item.save_id)
    differences = {i: soak.relative_difference(outcomes[i]["latents"], e) for i, e in expected.items()}
    unequal = {i: d for i, d in differences.items() if d > soak.TOLERANCE}
    after_interrupt = sum(1 for item in mix if outcomes[item.index]["state"] == "completed"
                          and any(outcomes[j]["state"] == "interrupted" for j in range(item.index)))

    figures = {
        "prompts": PROMPTS, "seed": SEED, "clients": CLIENTS, "seconds": round(seconds, 1),
        **soak.summary(mix, outcomes), "failed": failed,
        "compared": len(differences), "compared_by_comfyui_reference": len(sampler_prompts),
        "equality_failures": len(unequal), "worst_relative_difference": max(differences.values(), default=0.0),
        "completed_after_an_interrupt": after_interrupt,
        "rss_mib": {"after_10": round(rss_10 / 2**20, 1), f"after_{PROMPTS}": round(rss_end / 2**20, 1),
                    "after_free": round(rss_free / 2**20, 1)},
        "slope_bytes_per_prompt": round(slope), "slope_last_two_thirds": round(settled),
        "rss_curve_mib": {c: round(r / 2**20, 1) for c, r in samples if c % max(1, PROMPTS // 15) == 0},
        "kept_peak_bytes": peak, "kept_ceiling_bytes": CEILING_BYTES,
        "evictions": evictions, "kept_after_free": after["report"]["kept_bytes"] - after["report"]["cache_bytes"],
        "frees": sum(1 for item in mix if item.free_after),
    }
    print("\nsoak figures: " + json.dumps(figures, indent=1, default=str))
    (Path(os.environ.get("QI21_SOAK_FIGURES", tmp_path / "figures.json"))).write_text(json.dumps(figures, indent=1))
    assert not failed, f"prompts failed: {failed}"
    assert not unequal, f"prompts differ from the same prompt run alone: {unequal}"
    assert all(r["kept_bytes"] <= r["kept_limit_bytes"] == CEILING_BYTES for r in kept) and peak <= CEILING_BYTES
    assert evictions > 0, "the soak never filled the kept store: lower CEILING_BYTES"
    assert after["state"] == "completed" and after["report"]["cache"] == "miss"
    assert figures["kept_after_free"] == 0, "kept caches survived /free"
    assert rss_free - rss_10 <= RSS_MARGIN, figures["rss_mib"]
    assert settled <= SLOPE_BOUND, f"RSS grows by {settled:,.0f} bytes per prompt over the last two-thirds"


def soak_setting() -> str:
    from qi21.nodes.bridge import KEPT_CACHE_BUDGET_SETTING

    return KEPT_CACHE_BUDGET_SETTING
