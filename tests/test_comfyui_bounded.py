"""Issue 58's faults against a real ComfyUI server, as the hostile API client met them: a `devices` list of 2,500 CPU
ranks (one worker was started per rank), a count that does not divide the heads (met only inside each worker),
40 chained ImageBlend nodes in `POST /qi21/route_key` (no answer: one walk per path; now a key, each node hashed
once), `weight_dtype` = 10^400 there (HTTP 500), and a 10,000-character text-encoder `device` (a 30,427-character
message). Each ends in a clear answer within a second or two, no worker starts, the server stays up and the next
prompt equals a clean one.

Skipped unless a ComfyUI checkout is configured (tests/test_comfyui_server.py's docstring has the set-up); shares that
module's server."""

import copy
import json
import time
import urllib.error
import urllib.request

import pytest

import qi21_comfy_harness as harness  # tests/comfyui/, on sys.path through pyproject's pytest `pythonpath`
from test_comfyui_parallel import image, workers

WORKFLOWS = harness.API_WORKFLOW_FOLDER


@pytest.fixture(scope="module")
def server(request) -> harness.ComfyServer:
    return harness.server_for(request)


@pytest.fixture(scope="module")
def turbo():
    small, _ = harness.shrink_prompt(json.loads((WORKFLOWS / "text_to_image_turbo.json").read_text()))
    return small


@pytest.fixture(scope="module")
def clean(server, turbo):
    entry = server.run_prompt(turbo)
    assert entry["status"]["status_str"] == "success", server.log_tail()
    return image(server, entry)


def post(server, path: str, body) -> tuple[int, bytes, float]:
    """(status, raw answer, seconds) of a POST that may be refused."""
    data = json.dumps(body).encode() if not isinstance(body, bytes) else body
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, response.read(), time.monotonic() - start
    except urllib.error.HTTPError as error:
        return error.code, error.read(), time.monotonic() - start


def with_loader(prompt: dict, kind: str, **inputs) -> dict:
    prompt = copy.deepcopy(prompt)
    for node in prompt.values():
        if node["class_type"] == kind:
            node["inputs"].update(inputs)
    return prompt


def assert_next_prompt_is_clean(server, turbo, clean):
    entry = server.run_prompt(turbo)
    assert entry["status"]["status_str"] == "success", server.log_tail()
    assert (image(server, entry) == clean).all()


@pytest.mark.parametrize("devices, message", [
    (",".join(["cpu"] * 2500), "longer than 4096 characters"),
    (",".join(["cpu"] * 17), "names 17 devices; at most 16"),
    ("cpu,cpu,cpu,cpu", "divide the model's 2 attention heads"),
])
def test_a_rank_list_is_refused_when_the_prompt_is_validated_and_no_worker_starts(server, turbo, clean, devices,
                                                                                   message):
    before = workers(server)
    prompt = with_loader(turbo, "QI21ModelLoader", devices=devices, parallel="ulysses")
    status, raw, seconds = post(server, "/prompt", {"prompt": prompt, "client_id": "qi21-bounded"})
    assert status == 400 and message in raw.decode() and seconds < 2.0, raw[:2000]
    assert len(raw) < 4000  # the 10,000-character list is not echoed
    assert workers(server) == before
    assert_next_prompt_is_clean(server, turbo, clean)


def test_an_oversized_text_encoder_device_is_refused_with_a_short_message(server, turbo, clean):
    prompt = with_loader(turbo, "QI21TextEncoderLoader", device="cuda" + "x" * 10_000)
    status, raw, seconds = post(server, "/prompt", {"prompt": prompt, "client_id": "qi21-bounded"})
    assert status == 400 and "10,004 characters" in raw.decode() and seconds < 2.0, raw[:2000]
    assert len(raw) < 4000, len(raw)  # was 30,427 characters
    assert_next_prompt_is_clean(server, turbo, clean)


def blend_chain(turbo: dict, links: int) -> dict:
    """The turbo prompt with a reference made of `links` ImageBlend nodes, each blending the one before with itself
    (for the route key only: it is never queued)."""
    prompt = copy.deepcopy(turbo)
    prompt["b0"] = {"class_type": "LoadImage", "inputs": {"image": "a.png"}}
    for i in range(1, links + 1):
        prompt[f"b{i}"] = {"class_type": "ImageBlend", "inputs": {"image1": [f"b{i - 1}", 0],
                                                                  "image2": [f"b{i - 1}", 0], "blend_factor": 0.5,
                                                                  "blend_mode": "normal"}}
    encode = next(n for n in prompt.values() if n["class_type"] == "QI21TextEncode")
    vae = next(k for k, n in prompt.items() if n["class_type"] == "QI21VAELoader")
    prompt["ref"] = {"class_type": "QI21Reference", "inputs": {"image": [f"b{links}", 0], "vae": [vae, 0],
                                                               "resolution": 512}}
    encode["inputs"]["references"] = ["ref", 0]
    return prompt


def test_the_route_key_answers_a_doubling_chain_with_its_key_and_an_overflowing_number_with_400(server, turbo, clean):
    hashes = {"a.png": "0" * 64}
    status, raw, seconds = post(server, "/qi21/route_key", {"prompt": blend_chain(turbo, 40), "image_hashes": hashes})
    assert status == 200 and len(json.loads(raw)["route_key"]) == 32 and seconds < 2.0, raw[:2000]
    text = json.dumps({"prompt": with_loader(turbo, "QI21ModelLoader", weight_dtype="HUGE"), "image_hashes": hashes})
    status, raw, seconds = post(server, "/qi21/route_key", text.replace('"HUGE"', "1" + "0" * 400).encode())
    assert status == 400 and "does not fit a double" in raw.decode() and len(raw) < 1000, raw[:2000]
    status, raw, _ = post(server, "/qi21/route_key", {"prompt": blend_chain(turbo, 3), "image_hashes": hashes})
    assert status == 200 and len(json.loads(raw)["route_key"]) == 32
    assert_next_prompt_is_clean(server, turbo, clean)
