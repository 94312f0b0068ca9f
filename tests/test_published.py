"""The published files as the pack names them: every download link (the workflows' `properties.models`, the README
and docs) in the official repackage's form and naming a file it publishes (tests/published_files.py, the one
table); the loaders' file widgets in the UI and API workflows; the speed workflows on published LoRAs with their
schedules; `QI21Sigmas`' `shift_terminal` (Lightning's schedule) against diffusers' scheduler."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from oracle import BASE_SCHEDULER
from published_files import DOWNLOAD, PUBLISHED, REPOSITORY, download_url, folder_of
from qi21.model.sampling.schedule import schedule_mu, turbo_sigmas
from qi21.model.vae.latents import latent_tokens
from qi21.nodes.schedule import QI21Sigmas

ROOT = Path(__file__).resolve().parents[1]
UI_FILES = sorted((ROOT / "workflows").glob("*.json"))
API_FILES = sorted((ROOT / "workflows" / "api").glob("*.json"))
DOCS = [ROOT / "README.md", ROOT / "workflows" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: loader node -> (its file widget, the models folder it reads)
LOADERS = {"QI21ModelLoader": ("model_name", "diffusion_models"), "QI21TextEncoderLoader": ("text_encoder_name",
           "text_encoders"), "QI21VAELoader": ("vae_name", "vae"), "QI21LoraLoader": ("lora_name", "loras"),
           "CLIPLoader": ("clip_name", "text_encoders"),  # core's loader of the prompt enhancer (official_*)
           "QI21ControlNetLoader": ("control_net_name", "model_patches")}
HF_LINK = re.compile(r"https?://huggingface\.co/Comfy-Org/Qwen-Image-2\.1[^\s)\"'`>\]]*")


def test_the_table_holds_what_ecosystem_md_lists():
    assert sum(len(names) for names in PUBLISHED.values()) == 17
    assert folder_of("qwen_image_2.1_turbo_lora_avg_rank_178_bf16.safetensors") == "loras"
    assert folder_of("qwen_image_2.1_speed_lora.safetensors") is None
    assert download_url("vae", "x") == "https://huggingface.co/Comfy-Org/Qwen-Image-2.1/resolve/main/vae/x"


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_every_download_entry_of_a_ui_workflow_is_a_published_file_at_its_address(path):
    workflow = json.loads(path.read_text())
    entries = [(node["type"], entry) for node in workflow["nodes"]
               for entry in node.get("properties", {}).get("models", [])]
    assert entries
    for node_type, entry in entries:
        assert entry["directory"] == LOADERS[node_type][1], (path.name, entry)
        assert entry["name"] in PUBLISHED[entry["directory"]], (path.name, entry)
        assert entry["url"] == download_url(entry["directory"], entry["name"]), (path.name, entry)
        assert "split_files" not in entry["url"]


@pytest.mark.parametrize("path", UI_FILES + API_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_loader_of_a_workflow_loads_a_published_file(path):
    """UI files by their download entry, API files (no `properties`) by the widget value itself."""
    workflow = json.loads(path.read_text())
    if "nodes" in workflow:
        loaders = [(n["type"], n["properties"]["models"][0]["name"]) for n in workflow["nodes"] if n["type"] in LOADERS]
    else:
        loaders = [(n["class_type"], n["inputs"][LOADERS[n["class_type"]][0]]) for n in workflow.values()
                   if n["class_type"] in LOADERS]
    assert len(loaders) >= 3
    for node_type, name in loaders:
        assert folder_of(name) == LOADERS[node_type][1], (path.name, node_type, name)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_link_to_the_repackage_in_the_docs_is_in_its_published_form(path):
    for link in HF_LINK.findall(path.read_text()):
        if link in (REPOSITORY, REPOSITORY + "/"):
            continue
        assert link.startswith(DOWNLOAD + "/"), (path.name, link)
        folder, _, name = link.removeprefix(DOWNLOAD + "/").partition("/")
        assert name in PUBLISHED.get(folder, ()), (path.name, link)


def test_the_readme_links_each_file_it_names_for_download():
    readme = (ROOT / "README.md").read_text()
    linked = {link.rpartition("/")[2] for link in HF_LINK.findall(readme)}
    for folder in ("diffusion_models", "text_encoders", "vae", "loras"):
        for name in PUBLISHED[folder]:
            if f"`{name}`" in readme:
                assert name in linked, name


# -- the speed workflows -------------------------------------------------------------------------------------
def api(name):
    return json.loads((ROOT / "workflows" / "api" / f"{name}.json").read_text())


def only(workflow, class_type):
    (node,) = [n for n in workflow.values() if n["class_type"] == class_type]
    return node


def test_the_speed_lora_workflow_runs_pruna_s_8_step_lora_on_its_sigmas():
    workflow = api("base_speed_lora")
    lora = only(workflow, "QI21LoraLoader")["inputs"]["lora_name"]
    assert lora == "p_q_image_2.1_8_steps_v0.1_comfyui_bf16.safetensors"
    sigmas = [float(v) for v in only(workflow, "ManualSigmas")["inputs"]["sigmas"].split(",")]
    t = np.linspace(1, 0, 9)
    np.testing.assert_allclose(sigmas, 2 * t / (1 + t), atol=1e-9)  # shift 2 over 8 even steps
    sampler = only(workflow, "QI21Sampler")["inputs"]
    assert sampler["cfg"] == 1.0 and sampler["sigmas"][0] in workflow
    assert only(workflow, "QI21ModelLoader")["inputs"]["model_name"] == "qwen_image_2.1_bf16.safetensors"


def test_the_turbo_lora_workflow_runs_base_on_turbo_s_sigmas():
    workflow = api("base_turbo_lora")
    lora = only(workflow, "QI21LoraLoader")["inputs"]
    assert lora["lora_name"] == "qwen_image_2.1_turbo_lora_avg_rank_178_bf16.safetensors" and lora["strength"] == 1.0
    assert only(workflow, "QI21ModelLoader")["inputs"]["model_name"] == "qwen_image_2.1_bf16.safetensors"
    schedule = only(workflow, "QI21Sigmas")["inputs"]
    sampler = only(workflow, "QI21Sampler")["inputs"]
    assert workflow[sampler["sigmas"][0]]["class_type"] == "QI21Sigmas" and sampler["cfg"] == 1.0
    got = QI21Sigmas.execute(schedule["schedule"], schedule["steps"], schedule["width"], schedule["height"])[0]
    assert torch.equal(got, turbo_sigmas())


@pytest.mark.parametrize("steps, width, height", [(4, 1024, 1024), (8, 768, 1344), (4, 2048, 2048)])
def test_shift_terminal_0_gives_the_size_shifted_schedule_without_the_stretch(steps, width, height):
    """Lightning's schedule: the Base scheduler's exponential dynamic shift with shift_terminal None (diffusers,
    same grid and mu as the pipeline), bit for bit; the default 0.02 stays the official schedule."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(dict(BASE_SCHEDULER, shift_terminal=None))
    mu = schedule_mu(latent_tokens(width, height))
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    got = QI21Sigmas.execute("base", steps, width, height, shift_terminal=0.0)[0]
    assert torch.equal(got, scheduler.sigmas.float())
    official = QI21Sigmas.execute("base", steps, width, height)[0]
    assert official[-2].item() == pytest.approx(0.02) and got[-2] > official[-2]
    assert QI21Sigmas.validate_inputs(schedule="base", steps=4, width=0, height=0, shift_terminal=0.7) is not True
