"""The model split over two CPU ranks inside a real ComfyUI server: a /prompt whose loader names `devices` cpu,cpu and
`parallel` ulysses gives the image the single-process prompt gives, the workers stay for the next prompt, a worker
killed mid-run gives an error naming it and its step and the next prompt starts clean workers, /interrupt stops the
ranks and keeps them, CFG-parallel draws what one process draws, a Step Cache on the split model skips what one process
skips, compile with devices is refused by name at validation, and /free ends them.

Skipped unless a ComfyUI checkout is configured (tests/test_comfyui_server.py's docstring has the set-up); shares that
module's server. Linux only where it counts the workers (children of the server that multiprocessing spawned).
"""

import copy
import io
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import qi21_comfy_harness as harness  # tests/comfyui/, on sys.path through pyproject's pytest `pythonpath`

WORKFLOWS = harness.API_WORKFLOW_FOLDER
CLIENT_ID = "qi21-parallel"
client = harness.deploy_module("qi21_client")  # its websocket reader: the tests wait for a prompt's progress


@pytest.fixture(scope="module")
def server(request) -> harness.ComfyServer:
    return harness.server_for(request)


def workers(server) -> list[int]:
    """Process ids of the server's children that multiprocessing spawned (our workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_text()
        except (OSError, ValueError, IndexError):
            continue
        if parent == server.proc.pid and "spawn_main" in command:
            found.append(int(entry.name))
    return sorted(found)


def split(prompt: dict, **sampler) -> dict:
    prompt = copy.deepcopy(prompt)
    for node in prompt.values():
        if node["class_type"] == "QI21ModelLoader":
            node["inputs"].update(devices="cpu,cpu", parallel="ulysses")
        if node["class_type"] in harness.SAMPLERS:
            node["inputs"].update(sampler)
    return prompt


def image(server, entry) -> np.ndarray:
    for node in entry["outputs"].values():
        for saved in node.get("images", []):
            return np.asarray(Image.open(io.BytesIO(server.view(saved))))
    raise AssertionError(f"no image in {entry['outputs']}")


def report(entry) -> dict:
    return next(node["qi21_report"][0] for node in entry["outputs"].values() if "qi21_report" in node)


def finished(server, prompt_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = server.get_json(f"/history/{prompt_id}").get(prompt_id)
        if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
            return entry
        time.sleep(0.25)
    raise AssertionError(f"prompt {prompt_id} did not finish.\n{server.log_tail()}")


def queue(server, prompt: dict) -> str:
    return server.post_json("/prompt", {"prompt": prompt, "client_id": CLIENT_ID})["prompt_id"]


@pytest.fixture(scope="module")
def turbo():
    small, _ = harness.shrink_prompt(json.loads((WORKFLOWS / "text_to_image_turbo.json").read_text()))
    return small


@pytest.fixture(scope="module")
def long_base():
    """A Base prompt long enough to be caught in the middle (tiny model, 2048x2048: about a minute on two busy cores,
    and it never runs to its end: the tests interrupt it or kill a worker)."""
    small, _ = harness.shrink_prompt(json.loads((WORKFLOWS / "text_to_image_base.json").read_text()))
    return split(small, steps=200, width=2048, height=2048)


def test_a_split_prompt_draws_what_one_process_draws_and_keeps_its_workers(server, turbo):
    single = server.run_prompt(turbo)
    first = server.run_prompt(split(turbo))
    assert first["status"]["status_str"] == "success", server.log_tail()
    assert np.array_equal(image(server, first), image(server, single))
    parallel = report(first)["parallel"]
    assert parallel["cache_bytes_per_device"] == [report(single)["cache_bytes"] // 2] * 2
    pids = workers(server)
    assert len(pids) == 2
    again = server.run_prompt(split(turbo, seed=43))
    assert again["status"]["status_str"] == "success" and workers(server) == pids


def queue_and_wait_for_a_step(server, prompt: dict) -> str:
    """Queue `prompt` and return once the server has announced its first finished denoising step (a `progress`
    message with value >= 1 on the websocket of the client that queued it): a worker killed or an interrupt sent then
    lands in the middle of sampling, whatever the machine's pace (a fixed wait of a few seconds did not, on two loaded
    cores, for this 2048x2048 prompt)."""
    seat = client.Seat(server.url, CLIENT_ID, {}, timeout=120)  # opened first: progress is not replayed
    try:
        prompt_id = queue(server, prompt)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            message = seat.message()
            if message and message.get("type") == "progress" and message["data"].get("prompt_id") == prompt_id \
                    and message["data"]["value"] >= 1:
                return prompt_id
        raise AssertionError(f"prompt {prompt_id} announced no finished step within 300 s.\n{server.log_tail()}")
    finally:
        seat.close()


def test_interrupt_stops_the_ranks_and_keeps_them(server, turbo, long_base):
    server.run_prompt(split(turbo))  # the Base model loads on the first Base prompt; the pool exists
    pids = workers(server)
    prompt_id = queue_and_wait_for_a_step(server, long_base)
    server.post_json("/interrupt", {})
    entry = finished(server, prompt_id)
    assert any(kind == "execution_interrupted" for kind, _ in entry["status"]["messages"]), entry["status"]
    assert workers(server) == pids
    assert server.run_prompt(split(turbo))["status"]["status_str"] == "success"


def test_a_killed_worker_is_named_and_the_next_prompt_starts_clean_ones(server, turbo, long_base):
    reference = image(server, server.run_prompt(turbo))
    server.run_prompt(split(turbo))
    pids = workers(server)
    prompt_id = queue_and_wait_for_a_step(server, long_base)
    server.expected_in_log.append("(rank 1) stopped (exit code -9)")  # the pack's error for the kill, on purpose
    os.kill(pids[1], signal.SIGKILL)
    entry = finished(server, prompt_id)
    errors = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert errors and "the Qwen-Image worker on cpu (rank 1) stopped (exit code -9) during sampling at step" in \
        errors[0]["exception_message"]
    assert workers(server) == []
    fresh = server.run_prompt(split(turbo))
    assert fresh["status"]["status_str"] == "success" and np.array_equal(image(server, fresh), reference)
    assert len(workers(server)) == 2 and not set(workers(server)) & set(pids)


def test_cfg_parallel_draws_what_one_process_draws(server):
    prompt, _ = harness.shrink_prompt(json.loads((WORKFLOWS / "text_to_image_base.json").read_text()))
    sampler_id, sampler = next((k, n) for k, n in prompt.items() if n["class_type"] == "QI21Sampler")
    encode = prompt[sampler["inputs"]["positive"][0]]
    prompt["99"] = {"class_type": "QI21TextEncode",
                    "inputs": {"text_encoder": encode["inputs"]["text_encoder"], "prompt": "blurry, low quality"}}
    sampler["inputs"].update(negative=["99", 0], cfg=3.0)
    single = server.run_prompt(prompt)
    cfg = split(prompt)
    next(n for n in cfg.values() if n["class_type"] == "QI21ModelLoader")["inputs"]["parallel"] = "cfg"
    got = server.run_prompt(cfg)
    assert got["status"]["status_str"] == "success", server.log_tail()
    # the latents agree to float rounding (the two prompts run as two forwards instead of one ragged one, cfg 3
    # amplifies the difference), so a pixel may round to the neighbouring 8-bit value
    difference = np.abs(image(server, got).astype(int) - image(server, single).astype(int))
    assert difference.max() <= 1 and (difference > 0).mean() < 0.01, (difference.max(), (difference > 0).mean())
    assert report(got)["parallel"]["mode"] == "cfg" and len(workers(server)) == 2


def with_step_cache(prompt: dict, threshold: float = 1.0) -> dict:
    """`prompt` with a Step Cache node between its loader and its sampler (skips every step the rule allows where the
    tiny random model's indicator is below `threshold`, the widget's largest)."""
    prompt = copy.deepcopy(prompt)
    loader = next(k for k, n in prompt.items() if n["class_type"] == "QI21ModelLoader")
    prompt["qi21_step_cache"] = {"class_type": "QI21StepCache", "inputs": {
        "model": [loader, 0], "mode": "t8", "threshold": threshold, "edit_threshold": threshold, "start_percent": 0.0,
        "end_percent": 1.0, "max_skips": 2}}
    for node in prompt.values():
        if node["class_type"] in harness.SAMPLERS:
            node["inputs"]["model"] = ["qi21_step_cache", 0]
    return prompt


def test_a_step_cache_on_a_cpu_cpu_model_draws_what_one_process_draws(server, turbo):
    """The ranks reduce the indicator over their group (model/parallel/agreement.py): they skip the steps one process
    skips, and the image is the same."""
    single = server.run_prompt(with_step_cache(turbo))
    assert single["status"]["status_str"] == "success", server.log_tail()
    got = server.run_prompt(with_step_cache(split(turbo)))
    assert got["status"]["status_str"] == "success", server.log_tail()
    pattern = report(single)["step_cache"]["pattern"]
    assert report(got)["step_cache"]["pattern"] == pattern and "S" in pattern, (pattern, report(got)["step_cache"])
    assert np.array_equal(image(server, got), image(server, single))


def test_compile_with_devices_is_refused_by_name_before_anything_runs(server, turbo):
    prompt = split(turbo)
    next(n for n in prompt.values() if n["class_type"] == "QI21ModelLoader")["inputs"]["compile"] = "blocks"
    try:
        answer = server.post_json("/prompt", {"prompt": prompt, "client_id": "qi21-parallel"})
    except AssertionError as refused:  # HTTP 400: ComfyUI's validation, with the node's message
        message = str(refused)
    else:
        raise AssertionError(f"the prompt was queued: {answer}")
    assert "the Model Loader's compile and the Model Loader's devices / parallel do not work together" in message, \
        message


def test_free_ends_the_workers(server, turbo):
    server.run_prompt(split(turbo))
    assert len(workers(server)) == 2
    server.free(unload_models=True, free_memory=True)
    deadline = time.monotonic() + 30
    while workers(server) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert workers(server) == []
