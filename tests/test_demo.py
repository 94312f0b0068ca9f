"""The tiny random checkpoint set (demo/tiny_checkpoints.py) and the headless workflow runner (demo/run_workflows.py).

The tiny set stands in for the real weights wherever the pack must run end to end without them, so it has to be
the real thing at toy size: every file is checked against the classes that define the layout (diffusers'
`QwenImage21Transformer2DModel` and `AutoencoderKLQwenImage21`, transformers' Qwen3-VL), every file and folder
must load through our loaders, and the single-file and diffusers versions of a component must give identical
outputs (they hold the same bits). The runner must run API-format workflows green on that set, write RGB and
RGBA PNGs and the samplers' reports, and fail loudly, with the reason, on a broken workflow.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
from PIL import Image
from safetensors import safe_open
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from dit_fixtures import make_case, reference_velocity
from qi21.demo import core_nodes, run_workflows, tiny_checkpoints as tiny, workflow_runner
from qi21.model.encoders.references import prepare_reference
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.text_encoder import load_text_encoder
from qi21.model.loaders.vae import load_vae
from qi21.model.sampling.schedule import TURBO_SIGMAS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # whole model sets written, loaded and run through workflows


def header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path), framework="pt") as handle:
        return {key: (handle.get_slice(key).get_dtype(), tuple(handle.get_slice(key).get_shape()))
                for key in handle.keys()}


def headers(paths) -> dict:
    merged = {}
    for path in paths:
        merged.update(header(path))
    return merged


def read(path: Path, key: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(key)


def sharded(folder: Path, index_name: str) -> list[Path]:
    index = json.loads((folder / index_name).read_text())
    files = sorted({folder / name for name in index["weight_map"].values()})
    assert len(files) >= 2 and all(f.is_file() for f in files)
    assert set(index["weight_map"]) == set(headers(files))
    assert index["metadata"]["total_size"] > 0
    return files


# -- the files ---------------------------------------------------------------------------------------------------
def test_every_real_layout_is_written_with_the_released_names(tiny_models):
    root = tiny_models["root"]
    for relative in ("diffusion_models/qwen_image_2.1_bf16.safetensors",
                     "diffusion_models/qwen_image_2.1_turbo_bf16.safetensors",
                     "text_encoders/qwen3vl_8b_bf16.safetensors", "vae/qwen_image_2.1_vae_bf16.safetensors",
                     "text_encoders/qwen3vl_8b_bf16_tokenizer/vocab.json",
                     "text_encoders/qwen3vl_8b_bf16_tokenizer/merges.txt"):
        assert (root / relative).is_file(), relative
    for repo in ("Qwen-Image-2.1", "Qwen-Image-2.1-Turbo"):
        for relative in ("model_index.json", "scheduler/scheduler_config.json", "transformer/config.json",
                         "vae/config.json", "vae/diffusion_pytorch_model.safetensors", "text_encoder/config.json",
                         "processor/tokenizer.json", "processor/preprocessor_config.json"):
            assert (root / "diffusers" / repo / relative).is_file(), f"{repo}/{relative}"
    base, turbo = tiny_models["diffusers_base"], tiny_models["diffusers_turbo"]
    assert "sample_sigmas" not in json.loads((base / "model_index.json").read_text())
    assert json.loads((turbo / "model_index.json").read_text())["sample_sigmas"] == list(TURBO_SIGMAS)
    assert json.loads((base / "scheduler/scheduler_config.json").read_text())["use_dynamic_shifting"] is True
    assert json.loads((turbo / "scheduler/scheduler_config.json").read_text())["use_dynamic_shifting"] is False
    sharded(base / "text_encoder", "model.safetensors.index.json")  # Base: shards + index
    assert (turbo / "text_encoder" / "model.safetensors").is_file()  # Turbo: one file, no index
    assert not (turbo / "text_encoder" / "model.safetensors.index.json").exists()
    # storage as released: bf16, except the diffusers VAE (fp32)
    for path in (tiny_models["dit"], tiny_models["turbo_dit"], tiny_models["text_encoder"], tiny_models["vae"]):
        assert {dtype for dtype, _ in header(path).values()} == {"BF16"}, path.name
    assert {dtype for dtype, _ in header(base / "vae/diffusion_pytorch_model.safetensors").values()} == {"F32"}
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert size < 80 * 2**20, f"the tiny set takes {size / 2**20:.0f} MiB"


def test_dit_files_match_diffusers_and_comfyui_layouts(tiny_models):
    folder = tiny_models["diffusers_base"] / "transformer"
    files = sharded(folder, "diffusion_pytorch_model.safetensors.index.json")
    on_disk = headers(files)
    reference = QwenImage21Transformer2DModel.from_config(json.loads((folder / "config.json").read_text()))
    assert {k: tuple(v.shape) for k, v in reference.state_dict().items()} == {k: s for k, (_, s) in on_disk.items()}

    comfy = header(tiny_models["dit"])
    assert not any("gate_layer" in k or "img_mlp.proj" in k for k in comfy)
    assert len(comfy) == len(on_disk) - tiny.TINY_DIT.num_layers  # gate_layer + proj fused into gate_up
    by_key = {key: file for file in files for key in header(file)}
    for i in range(tiny.TINY_DIT.num_layers):
        p = f"transformer_blocks.{i}.img_mlp."
        fused = read(tiny_models["dit"], p + "gate_up.weight")
        assert torch.equal(fused, torch.cat([read(by_key[p + "gate_layer.weight"], p + "gate_layer.weight"),
                                             read(by_key[p + "proj.weight"], p + "proj.weight")]))  # gate first
    turbo = header(tiny_models["turbo_dit"])
    assert all(k.startswith("model.diffusion_model.") for k in turbo)
    assert {k[len("model.diffusion_model."):] for k in turbo} == set(comfy)


def test_vae_files_match_diffusers_and_wan_layouts(tiny_models):
    folder = tiny_models["diffusers_base"] / "vae"
    reference = AutoencoderKLQwenImage21.from_config(json.loads((folder / "config.json").read_text()))
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    on_disk = header(folder / "diffusion_pytorch_model.safetensors")
    assert expected == {k: s for k, (_, s) in on_disk.items()}  # time_conv included
    comfy = header(tiny_models["vae"])
    assert len(comfy) == len(expected)
    # names and shapes of the released Wan file (docs/checkpoints.md), ComfyUI's detection keys included
    assert comfy["decoder.head.2.weight"][1] == (4, 6, 1, 3, 3)  # 5-D causal conv, temporal kernel 1
    assert comfy["encoder.conv1.weight"][1] == (4, 4, 1, 3, 3)
    assert comfy["decoder.middle.0.residual.0.gamma"][1] == (48, 1, 1, 1)
    assert len(comfy["decoder.upsamples.0.upsamples.0.residual.2.weight"][1]) == 5
    assert comfy["encoder.downsamples.1.downsamples.2.time_conv.weight"][1] == (8, 8, 1, 1, 1)
    assert comfy["decoder.upsamples.0.upsamples.3.time_conv.weight"][1] == (96, 48, 1, 1, 1)
    assert len(comfy["encoder.downsamples.1.downsamples.2.resample.1.weight"][1]) == 4  # not causal: stays 2D
    assert comfy["decoder.middle.1.to_qkv.weight"][1] == (144, 48, 1, 1)
    assert "conv1.weight" in comfy and "conv2.weight" in comfy  # quant_conv / post_quant_conv
    assert "encoder.downsamples.0.downsamples.2.time_conv.weight" not in comfy  # stage 0 is not temporal


def test_text_encoder_files_match_transformers_and_comfyui_layouts(tiny_models):
    folder = tiny_models["diffusers_base"] / "text_encoder"
    config = Qwen3VLConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Qwen3VLForConditionalGeneration(config).state_dict().items()}
    files = sharded(folder, "model.safetensors.index.json")
    assert {k: s for k, (_, s) in headers(files).items()} == expected
    turbo_file = tiny_models["diffusers_turbo"] / "text_encoder/model.safetensors"
    assert {k: s for k, (_, s) in header(turbo_file).items()} == expected
    comfy = header(tiny_models["text_encoder"])
    assert "model.embed_tokens.weight" in comfy and "model.norm.weight" in comfy and "lm_head.weight" in comfy
    assert "model.layers.0.self_attn.q_norm.weight" in comfy
    assert "model.visual.deepstack_merger_list.0.norm.weight" in comfy
    assert not any(k.startswith("model.language_model.") for k in comfy)
    assert {tiny.comfy_text_encoder_key(k) for k in expected} == set(comfy)
    assert config.text_config.hidden_size == tiny.TINY_DIT.context_in_dim  # the DiT reads these states


# -- every layout loads, and the layouts agree --------------------------------------------------------------------
def velocity(model):
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7), context_dim=tiny.TINY_DIT.context_in_dim)
    with torch.no_grad():
        return model(x.to(model.compute_dtype), 0.6, prefixes).float()


def test_dit_single_files_and_diffusers_folders_give_identical_velocities(tiny_models):
    loaded = {key: load_dit(tiny_models[key]) for key in ("dit", "turbo_dit", "diffusers_base", "diffusers_turbo")}
    assert {k: (m.source.layout, m.source.variant) for k, m in loaded.items()} == {
        "dit": ("comfyui", "base"), "turbo_dit": ("comfyui", "turbo"),
        "diffusers_base": ("diffusers", "base"), "diffusers_turbo": ("diffusers", "turbo")}
    assert all(m.config == tiny.TINY_DIT and m.compute_dtype == torch.bfloat16 for m in loaded.values())
    out = {k: velocity(m) for k, m in loaded.items()}
    assert torch.isfinite(out["dit"]).all()
    torch.testing.assert_close(out["dit"], out["diffusers_base"], rtol=0, atol=0)
    torch.testing.assert_close(out["turbo_dit"], out["diffusers_turbo"], rtol=0, atol=0)
    assert not torch.equal(out["dit"], out["turbo_dit"])  # Turbo has its own weights


def test_diffusers_runs_the_tiny_transformer_folder_like_ours(tiny_models):
    """The folder is a real diffusers repository: diffusers' own class loads it and agrees with our loader."""
    reference = QwenImage21Transformer2DModel.from_pretrained(
        str(tiny_models["diffusers_base"]), subfolder="transformer", torch_dtype=torch.float32).eval()
    ours = load_dit(tiny_models["diffusers_base"], weight_dtype="fp32")
    kwargs, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7), context_dim=tiny.TINY_DIT.context_in_dim)
    with torch.no_grad():
        expected = reference_velocity(reference, kwargs, torch.tensor([0.6]))
        got = ours(x, 0.6, prefixes)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_vae_single_file_and_diffusers_folders_decode_identically(tiny_models):
    loaded = {key: load_vae(tiny_models[key], weight_dtype="fp32")
              for key in ("vae", "diffusers_base", "diffusers_turbo")}
    assert [m.source.layout for m in loaded.values()] == ["comfyui", "diffusers", "diffusers"]
    assert all(m.config == loaded["diffusers_base"].config for m in loaded.values())
    assert load_vae(tiny_models["vae"]).dtype == torch.bfloat16
    assert load_vae(tiny_models["diffusers_base"]).dtype == torch.float32
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 64, 3, 4, generator=generator)
    images = torch.rand(1, 4, 48, 64, generator=generator) * 2 - 1
    with torch.no_grad():
        decoded = {k: m.decode(latents) for k, m in loaded.items()}
        encoded = {k: m.encode(images) for k, m in loaded.items()}
        reference = AutoencoderKLQwenImage21.from_pretrained(str(tiny_models["diffusers_base"]), subfolder="vae").eval()
        expected = reference.decode(latents[:, :, None]).sample[:, :, 0]
    assert decoded["vae"].shape == (1, 4, 48, 64) and torch.isfinite(decoded["vae"]).all()
    for key in ("diffusers_base", "diffusers_turbo"):
        torch.testing.assert_close(decoded[key], decoded["vae"], rtol=0, atol=0)
        torch.testing.assert_close(encoded[key], encoded["vae"], rtol=0, atol=0)
    torch.testing.assert_close(decoded["vae"], expected, rtol=0, atol=1e-4)  # diffusers reads the folder the same


def test_text_encoder_single_file_and_diffusers_folders_encode_identically(tiny_models):
    # fp32: the same bits as the files' bf16 (checked above), and bf16 matmuls are slow on CPUs without bf16 units
    loaded = {key: load_text_encoder(tiny_models[key], dtype="fp32")
              for key in ("text_encoder", "diffusers_base", "diffusers_turbo")}
    configs = [m.model.config.to_dict() for m in loaded.values()]
    for config in configs:
        for part in ("text_config", "vision_config"):
            for volatile in ("dtype", "torch_dtype", "architectures", "_name_or_path", "transformers_version"):
                config[part].pop(volatile, None)
    assert configs[0]["text_config"] == configs[1]["text_config"] == configs[2]["text_config"]
    assert configs[0]["vision_config"] == configs[1]["vision_config"] == configs[2]["vision_config"]
    image = torch.from_numpy(np.random.default_rng(0).random((1, 256, 256, 4), dtype=np.float32))
    reference = prepare_reference(image, None, 256)
    out = {k: m.encode("Put <image1> on a table", [reference]) for k, m in loaded.items()}
    first = out["text_encoder"]
    assert torch.isfinite(first.embeds).all()
    assert int(first.image_slots.sum()) == reference.vlm_tokens
    for key in ("diffusers_base", "diffusers_turbo"):
        assert torch.equal(out[key].token_ids, first.token_ids)
        torch.testing.assert_close(out[key].embeds, first.embeds, rtol=0, atol=0)


def test_same_seed_same_weights():
    first, again = tiny.dit_state_dict(seed=3).values(), tiny.dit_state_dict(seed=3).values()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(tiny.dit_state_dict(seed=3)["img_in.weight"], tiny.dit_state_dict(seed=4)["img_in.weight"])


# -- the headless runner -----------------------------------------------------------------------------------------
def loaders(model: str, text_encoder: str, vae: str) -> dict:
    return {
        "1": {"class_type": "QI21ModelLoader", "inputs": {"model_name": model, "weight_dtype": "default"}},
        "2": {"class_type": "QI21TextEncoderLoader",
              "inputs": {"text_encoder_name": text_encoder, "weight_dtype": "default"}},
        "3": {"class_type": "QI21VAELoader", "inputs": {"vae_name": vae, "weight_dtype": "default"}},
    }


#: Base text-to-image with true CFG from the single files: RGB, RGBA and preview outputs.
BASE_T2I = {
    **loaders("qwen_image_2.1_bf16.safetensors", "qwen3vl_8b_bf16.safetensors", "qwen_image_2.1_vae_bf16.safetensors"),
    "4": {"class_type": "QI21TextEncode", "inputs": {"text_encoder": ["2", 0], "prompt": "A red bicycle by a wall."}},
    "5": {"class_type": "QI21TextEncode", "inputs": {"text_encoder": ["2", 0], "prompt": "blurry"}},
    "6": {"class_type": "QI21Sampler", "inputs": {"model": ["1", 0], "positive": ["4", 0], "negative": ["5", 0],
                                                   "seed": 1, "steps": 40, "cfg": 3.0, "width": 1024, "height": 768,
                                                   "batch_size": 1}},
    "7": {"class_type": "QI21VAEDecode", "inputs": {"vae": ["3", 0], "samples": ["6", 0]}},
    "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "base/rgb"}},
    "9": {"class_type": "SaveImage", "inputs": {"images": ["7", 2], "filename_prefix": "base/rgba"}},
    "10": {"class_type": "MaskPreview", "inputs": {"mask": ["7", 1]}},
}
#: Turbo edit from the diffusers folder: an RGB and an RGBA reference (its MASK wired), batch of 2.
TURBO_EDIT = {
    **loaders("diffusers/Qwen-Image-2.1-Turbo", "diffusers/Qwen-Image-2.1-Turbo", "diffusers/Qwen-Image-2.1-Turbo"),
    "11": {"class_type": "LoadImage", "inputs": {"image": "photo.png", "upload": "image"}},
    "12": {"class_type": "LoadImage", "inputs": {"image": "cutout_rgba.png", "upload": "image"}},
    "13": {"class_type": "QI21Reference", "inputs": {"vae": ["3", 0], "image": ["11", 0], "mask": ["11", 1],
                                                     "resolution": 1024}},
    "14": {"class_type": "QI21Reference", "inputs": {"vae": ["3", 0], "image": ["12", 0], "mask": ["12", 1],
                                                     "resolution": 0, "references": ["13", 0]}},
    "4": {"class_type": "QI21TextEncode", "inputs": {"text_encoder": ["2", 0], "prompt": "Put <image2> on <image1>.",
                                                     "references": ["14", 0]}},
    "6": {"class_type": "QI21TurboSampler", "inputs": {"model": ["1", 0], "positive": ["4", 0], "seed": 7, "width": 0,
                                                        "height": 0, "batch_size": 2}},
    "7": {"class_type": "QI21VAEDecode", "inputs": {"vae": ["3", 0], "samples": ["6", 0]}},
    "9": {"class_type": "SaveImage", "inputs": {"images": ["7", 2], "filename_prefix": "edit"}},
}


def write_workflows(folder: Path, workflows: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, graph in workflows.items():
        (folder / f"{name}.json").write_text(json.dumps(graph))
    return folder


def test_the_demo_runs_green_end_to_end_on_the_tiny_set(tmp_path, capsys):
    workflows = write_workflows(tmp_path / "api", {"base_t2i": BASE_T2I, "turbo_edit": TURBO_EDIT})
    out = tmp_path / "out"
    assert run_workflows.main(["--random", "--out", str(out), "--workflows", str(workflows)]) == 0
    printed = capsys.readouterr().out
    assert printed.count(run_workflows.TINY_BANNER) == 2  # at the start and under the summary
    assert "2/2 workflows ok" in printed

    assert Image.open(out / "input" / "photo.png").mode == "RGB"  # generated inputs of both kinds
    assert Image.open(out / "input" / "cutout_rgba.png").mode == "RGBA"
    rgb, rgba = Image.open(out / "base_t2i/base/rgb_00001_.png"), Image.open(out / "base_t2i/base/rgba_00001_.png")
    assert (rgb.mode, rgb.size) == ("RGB", (256, 256))  # 1024x768 capped in tiny mode
    assert rgba.mode == "RGBA" and len(rgba.getbands()) == 4
    assert json.loads(rgba.text["prompt"])["6"]["class_type"] == "QI21Sampler"  # the workflow is embedded
    assert Image.open(out / "base_t2i/preview_10_00001_.png").size == (256, 256)
    edits = sorted((out / "turbo_edit").glob("edit_*_.png"))
    assert len(edits) == 2 and all(Image.open(p).mode == "RGBA" for p in edits)

    base_report = json.loads((out / "base_t2i/qi21_report_6.json").read_text())
    turbo_report = json.loads((out / "turbo_edit/qi21_report_6.json").read_text())
    for report, steps, batch in ((base_report, workflow_runner.QUICK_MAX_STEPS, 1), (turbo_report, 8, 2)):
        assert len(report) == 1
        entry = report[0]
        assert {"prefix_tokens", "target_tokens", "batch", "steps", "cache", "cache_bytes", "cache_device",
                "prefill_seconds", "step_seconds"} <= entry.keys()
        assert (entry["steps"], entry["batch"], entry["cache"]) == (steps, batch, "miss")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tiny_random_checkpoint"] is True and all(w["ok"] for w in summary["workflows"])


def test_a_broken_workflow_fails_with_its_reason_and_the_others_still_run(tmp_path, tiny_models, capsys):
    copy_only = {"1": {"class_type": "LoadImage", "inputs": {"image": "x.png"}},
                 "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "copy"}}}
    wrong_type = {**copy_only, "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 1]}}}
    missing = {**loaders("no_such_model.safetensors", tiny.TEXT_ENCODER_FILE, tiny.VAE_FILE),
               "4": {"class_type": "QI21TextEncode", "inputs": {"text_encoder": ["2", 0]}},
               "6": {"class_type": "QI21TurboSampler", "inputs": {"model": ["1", 0], "positive": ["4", 0], "seed": 0,
                                                                   "width": 16, "height": 0, "batch_size": 1}},
               "7": {"class_type": "QI21VAEDecode", "inputs": {"vae": ["3", 0], "samples": ["6", 0]}},
               "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0]}}}
    unknown = {**copy_only, "3": {"class_type": "ImageScale", "inputs": {"image": ["1", 0]}},
               "2": {"class_type": "SaveImage", "inputs": {"images": ["3", 0]}}}
    workflows = write_workflows(tmp_path / "api", {"a_copy": copy_only, "b_wrong_type": wrong_type,
                                                   "c_missing": missing, "d_unknown": unknown})
    (workflows / "e_ui_format.json").write_text(json.dumps({"nodes": [], "links": []}))
    out = tmp_path / "out"
    args = ["--models", str(tiny_models["root"]), "--out", str(out), "--workflows", str(workflows)]
    assert run_workflows.main(args) == 1
    printed = capsys.readouterr().out
    assert run_workflows.TINY_BANNER not in printed
    results = {w["workflow"]: w for w in json.loads((out / "summary.json").read_text())["workflows"]}
    assert results["a_copy"]["ok"] and (out / "a_copy" / "copy_00001_.png").is_file()
    assert "wants IMAGE but node 1 (LoadImage) output 1 is MASK" in results["b_wrong_type"]["error"]
    error = results["c_missing"]["error"]
    assert "model_name = 'no_such_model.safetensors': not among the choices" in error
    assert "required input 'prompt' is missing" in error
    assert "width = 16" in error  # the sampler's own validate_inputs
    assert "'ImageScale' is neither" in results["d_unknown"]["error"]
    assert "UI-format" in results["e_ui_format"]["error"]
    assert "1/5 workflows ok" in printed


def test_load_image_follows_comfyui_conventions(tmp_path):
    rgba = np.zeros((40, 60, 4), np.uint8)
    rgba[..., 0], rgba[:, 30:, 3] = 200, 255  # left half transparent
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    image, mask = core_nodes.load_image(tmp_path / "a.png")
    assert image.shape == (1, 40, 60, 3) and image.dtype == torch.float32
    assert mask.shape == (1, 40, 60) and mask[0, 0, 0] == 1 and mask[0, 0, -1] == 0  # 1 = transparent
    Image.fromarray(rgba[..., :3], "RGB").save(tmp_path / "b.png")
    image, mask = core_nodes.load_image(tmp_path / "b.png")
    assert image.shape == (1, 40, 60, 3) and torch.equal(mask, torch.zeros(1, 64, 64))  # LoadImage's placeholder


SHIPPED = sorted((ROOT / "workflows" / "api").glob("*.json"))


def test_the_shipped_workflows_run_green_on_the_tiny_set(tmp_path, tiny_models, capsys):
    models = tmp_path / "models"  # the shared set is never written to: a copy, with the templates' file names
    shutil.copytree(tiny_models["root"], models)
    run_workflows.write_template_files(models)
    out = tmp_path / "out"
    assert run_workflows.main(["--models", str(models), "--quick", "--out", str(out)]) == 0, capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["workflows"]) == len(SHIPPED) == 18
    # every one runs, the official templates' counterparts (KSamplerSelect, the prompt enhancer's switch, which is off)
    # and the canny example (Canny) through demo/core_standins.py
    assert all(w["ok"] and w["images"] and not w["skipped"] for w in summary["workflows"]), summary
    printed = capsys.readouterr().out
    assert "18/18 workflows ok" in printed and "drew" not in printed  # the verdict is the toy's alone
    notes = {w["workflow"]: " ".join(w["notes"]) for w in summary["workflows"]}
    assert "node 12 (TextGenerate) feeds only a switch's branch that is off" in notes["official_image_edit"]
    assert "(PreviewAny) shows 'Replace costumes for the character'" in notes["official_image_edit"]
    edges = sorted((out / "controlnet_canny").glob("preview_6_*.png"))  # the Canny node's output, previewed
    assert len(edges) == 1 and Image.open(edges[0]).size == (512, 384)  # the example image's size


#: Workflows the toy test runs: each stand-in (Canny, KSamplerSelect, the switch and PreviewAny), the toy's own
#: inputs (the inpainting source's alpha, img2img's denoise) and the pixel-aligned edit's instruction.
TOY_CHECKED = ("controlnet_canny", "edit_pixel_aligned", "img2img", "inpaint_with_a_mask",
               "official_background_removal", "official_turbo_t2i")


def test_the_main_job_on_the_toy_draws_what_each_workflow_asks(tmp_path, capsys):
    out = tmp_path / "out"
    assert run_workflows.main(["--out", str(out), "--only", ",".join(TOY_CHECKED)]) == 0
    printed = capsys.readouterr().out
    results = {w["workflow"]: w for w in json.loads((out / "summary.json").read_text())["workflows"]}
    assert sorted(results) == sorted(TOY_CHECKED)
    for name, result in results.items():
        assert result["ok"] and result["drew"] == "yes", (name, result["drew_detail"], printed)
    assert results["official_background_removal"]["drew_detail"].startswith("asked transparent red center")
    (edges,) = (out / "controlnet_canny").glob("preview_6_*.png")  # Canny's outline of the toy's red circle
    assert 0.005 < (np.asarray(Image.open(edges))[..., 0] > 0).mean() < 0.05
    assert "6/6 workflows ok; 6/6 drew what they were asked" in printed
    assert printed.count(run_workflows.TOY_BANNER) == 2 and "38 of 40" in run_workflows.TOY_BANNER
    sheet = Image.open(out / "contact_sheet.png")
    assert sheet.size == (4 * 256, 2 * (256 + 56))  # 6 tiles of 4 a row, each with its caption


def test_own_words_and_seed_replace_every_prompt_and_seed_after_the_toys(tmp_path, capsys):
    """--prompt and --seed as the runner applies them (the toy test above runs the same chain end to end)."""
    overrides = run_workflows.chain(lambda workflow, class_type, kwargs: [], run_workflows.user_overrides("mine", 7))
    encode, sampler, loader = {"prompt": "a toy prompt"}, {"seed": 42}, {"model_name": "x"}
    assert overrides("img2img", "QI21TextEncode", encode) == ["prompt 'a toy prompt' -> 'mine' (--prompt)"]
    assert overrides("img2img", "QI21TurboSampler", sampler) == ["seed 42 -> 7 (--seed)"]
    assert overrides("img2img", "QI21ModelLoader", loader) == [] and (encode, sampler) == ({"prompt": "mine"},
                                                                                            {"seed": 7})
    assert run_workflows.chain(None, None) is None
    assert run_workflows.main(["--out", str(tmp_path), "--only", "img2img,no_such_workflow"]) == 1
    assert "no workflow named no_such_workflow; the choices: base_speed_lora" in capsys.readouterr().out
    assert run_workflows.main(["--out", str(tmp_path), "--only", "img2img", "--seed", "-1"]) == 1
    assert "--seed -1: a seed is between 0 and 2**64 - 1." in capsys.readouterr().out
