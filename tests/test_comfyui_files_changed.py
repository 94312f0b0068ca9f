"""Files changed on disk under a real ComfyUI with its default node cache (not --cache-none): a LoRA replaced under
the same name (same size and mtime even) is what the next prompt runs, one removed is refused by name, and an input
image deleted between queueing and running gives core's error; each followed by a clean run. The same cases for
every loader, in process, are in tests/test_files_changed.py. Runs with QI21_COMFYUI set (see
tests/test_comfyui_server.py)."""

import os
import shutil
import time
import urllib.error

import pytest

import qi21_comfy_harness as harness  # tests/comfyui/, on sys.path through pyproject's pytest `pythonpath`
import soak_fixtures as soak
from qi21.demo import tiny_checkpoints as tiny


@pytest.fixture(scope="module")
def comfyui_server(request):
    return harness.server_for(request)


def _lora_prompt(seed: int = 5, image: str | None = None) -> dict:
    node = soak._node
    prompt = {
        "1": node("QI21ModelLoader", model_name=tiny.DIT_FILE, weight_dtype="fp32"),
        "2": node("QI21TextEncoderLoader", text_encoder_name=tiny.TEXT_ENCODER_FILE, weight_dtype="fp32"),
        "4": node("QI21LoraLoader", model=["1", 0], lora_name=tiny.SPEED_LORA_FILE, strength=1.0),
        "6": node("QI21TextEncode", text_encoder=["2", 0], prompt="a lighthouse at dawn"),
        "10": node("QI21Sampler", model=["4", 0], positive=["6", 0], seed=seed, steps=2, cfg=1.0, width=128,
                   height=128, batch_size=1, keep_cache=True),
        "90": node("SaveLatent", samples=["10", 0], filename_prefix="qi21_files_changed/run"),
    }
    if image is not None:  # an edit: the prompt reads an input image
        prompt["3"] = node("QI21VAELoader", vae_name=tiny.VAE_FILE, weight_dtype="fp32")
        prompt["5"] = node("LoadImage", image=image)
        prompt["7"] = node("QI21Reference", vae=["3", 0], image=["5", 0], resolution=soak.REFERENCE_RESOLUTION)
        prompt["6"]["inputs"].update(prompt="Make <image1> a watercolour.", references=["7", 0])
        prompt["10"]["inputs"].update(width=0, height=0)
    return prompt


def _run(server, prompt):
    entry = server.run_prompt(prompt)
    assert entry["status"]["status_str"] == "success", entry["status"]
    cached = {str(i) for kind, message in entry["status"]["messages"] if kind == "execution_cached"
              for i in message.get("nodes", [])}
    from safetensors.torch import load_file

    (saved,) = entry["outputs"]["90"]["latents"]
    latents = load_file(str(server.base / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]
    return latents, cached, entry["outputs"]["10"]["qi21_report"][0]


def test_a_replaced_lora_is_what_the_next_prompt_runs(comfyui_server, tmp_path):
    path = comfyui_server.base / "models" / "loras" / tiny.SPEED_LORA_FILE
    original = tmp_path / "original.safetensors"
    shutil.copy2(path, original)
    other = tiny.write_tiny_checkpoints(tmp_path / "other", seed=7)["lora"]  # same name and shapes, other weights
    prompt = _lora_prompt()
    before, _, _ = _run(comfyui_server, prompt)
    _, cached, report = _run(comfyui_server, _lora_prompt(seed=6))  # another seed: only the sampler runs again
    assert {"1", "4"} <= cached and report["cache"] == "hit"  # ComfyUI's cache and the kept store both serve it
    try:
        stat = path.stat()
        shutil.copyfile(other, path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old size and time (`cp -p`)
        replaced, cached, report = _run(comfyui_server, prompt)
        assert "4" not in cached and "1" in cached  # the LoRA node ran again, the DiT under it did not
        assert report["cache"] == "miss" and soak.relative_difference(replaced, before) > 1e-3
        comfyui_server.free(unload_models=True, free_memory=True)  # the new file, loaded from nothing
        alone, cached, _ = _run(comfyui_server, prompt)
        assert "4" not in cached and soak.relative_difference(replaced, alone) <= soak.TOLERANCE
    finally:
        shutil.copy2(original, path)
    clean, cached, _ = _run(comfyui_server, prompt)  # the old file back: the old image again
    assert "4" not in cached and soak.relative_difference(clean, before) <= soak.TOLERANCE


def test_a_removed_lora_is_refused_by_name_then_a_clean_run(comfyui_server, tmp_path):
    path = comfyui_server.base / "models" / "loras" / tiny.SPEED_LORA_FILE
    kept = tmp_path / "kept.safetensors"
    shutil.move(path, kept)
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            comfyui_server.request("/prompt", {"prompt": _lora_prompt(seed=6)})
        assert tiny.SPEED_LORA_FILE in refused.value.read().decode(errors="replace")
    finally:
        shutil.move(kept, path)
    assert comfyui_server.proc.poll() is None
    _run(comfyui_server, _lora_prompt(seed=6))


def test_an_input_image_deleted_between_queueing_and_running_gives_cores_error(comfyui_server):
    soak.write_images(comfyui_server.base / "input")
    image = comfyui_server.base / "input" / "qi21_deleted_soon.png"
    comfyui_server.expected_in_log.append(image.name)  # core's LoadImage error names it (on purpose)
    shutil.copyfile(comfyui_server.base / "input" / soak.IMAGES[0], image)
    slow = _lora_prompt(seed=7)
    slow["10"]["inputs"].update(steps=60, width=256, height=256, batch_size=4, keep_cache=False)
    first = comfyui_server.post_json("/prompt", {"prompt": slow})["prompt_id"]
    second = comfyui_server.post_json("/prompt", {"prompt": _lora_prompt(image=image.name)})["prompt_id"]
    image.unlink()  # validated at queueing; gone before it runs (the slow prompt runs first)
    deadline = time.monotonic() + 300
    entry = None
    while time.monotonic() < deadline:
        entry = comfyui_server.get_json(f"/history/{second}").get(second)
        if entry and entry["status"].get("status_str") in ("success", "error"):
            break
        time.sleep(0.25)
    assert entry and entry["status"]["status_str"] == "error", entry
    (error,) = [m for kind, m in entry["status"]["messages"] if kind == "execution_error"]
    assert error["node_type"] == "LoadImage" and "qi21_deleted_soon.png" in error["exception_message"], error
    assert comfyui_server.get_json(f"/history/{first}")[first]["status"]["status_str"] == "success"
    _run(comfyui_server, _lora_prompt(seed=8, image=soak.IMAGES[0]))  # a clean run after it
