"""Loading the DiT from files written in both real layouts, and refusing everything else clearly.

The files are generated here from a tiny random model: the diffusers folder by diffusers' own
`save_pretrained` (sharded, with its index), the ComfyUI single file with the fused `img_mlp.gate_up`
[gate; up] and bare or `model.diffusion_model.` keys.
"""

import copy
import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

import graph_fixtures as gf
from dit_fixtures import make_case, tiny_pair
from qi21.model.loaders import dit as dit_loading
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.dit_keys import infer_config
from qi21.model.loaders.safetensors_io import CheckpointError


def comfy_state_dict(reference, prefix=""):
    sd = {k: v.clone() for k, v in reference.state_dict().items()}
    for i in range(len(reference.transformer_blocks)):
        p = f"transformer_blocks.{i}.img_mlp."
        sd[p + "gate_up.weight"] = torch.cat([sd.pop(p + "gate_layer.weight"), sd.pop(p + "proj.weight")])
    return {prefix + k: v for k, v in sd.items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    reference, ours = tiny_pair()
    root = tmp_path_factory.mktemp("dit")
    save_file(comfy_state_dict(reference), root / "qwen_image_2.1_bf16.safetensors")
    save_file(comfy_state_dict(reference, "model.diffusion_model."), root / "qwen_image_2.1_turbo_bf16.safetensors")
    save_file(comfy_state_dict(reference), root / "my_merge.safetensors")
    for name, sigmas in (("Qwen-Image-2.1", None), ("Qwen-Image-2.1-Turbo", [1.0, 0.978453, 0.95418])):
        repo = root / name
        reference.save_pretrained(repo / "transformer", max_shard_size="150KB", safe_serialization=True)
        index = {"_class_name": "QwenImage21Pipeline", "transformer": ["diffusers", "QwenImage21Transformer2DModel"]}
        if sigmas:
            index["sample_sigmas"] = sigmas
        (repo / "model_index.json").write_text(json.dumps(index))
    return root, ours


def velocity(model):
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7))
    with torch.no_grad():
        return model(x.to(model.compute_dtype), 0.6, prefixes).float()


@pytest.mark.parametrize("name, layout, variant", [
    pytest.param("qwen_image_2.1_bf16.safetensors", "comfyui", "base", id="single file"),
    pytest.param("qwen_image_2.1_turbo_bf16.safetensors", "comfyui", "turbo",
                 id="single file, model.diffusion_model. prefix, turbo by name"),
    pytest.param("my_merge.safetensors", "comfyui", "unknown", id="single file of unknown variant"),
    pytest.param("Qwen-Image-2.1", "diffusers", "base", id="diffusers repository"),
    pytest.param("Qwen-Image-2.1-Turbo", "diffusers", "turbo", id="diffusers repository, turbo"),
    pytest.param("Qwen-Image-2.1/transformer", "diffusers", "base", id="diffusers transformer folder"),
])
def test_every_layout_loads_and_reproduces_the_model(files, name, layout, variant):
    root, ours = files
    model = load_dit(root / name)
    assert (model.source.layout, model.source.variant) == (layout, variant)
    assert model.config == ours.config
    assert len(list((root / "Qwen-Image-2.1" / "transformer").glob("*.safetensors"))) > 1  # really sharded
    torch.testing.assert_close(velocity(model), velocity(ours), rtol=0, atol=0)


def test_bf16_and_fp8_loads_equal_the_fp32_model_rounded_the_same_way(files):
    """bf16 and fp8 loads equal our fp32 model rounded the same way, exactly: the mapping survives the cast."""
    root, ours = files
    bf16 = load_dit(root / "qwen_image_2.1_bf16.safetensors", weight_dtype="bf16")
    assert bf16.blocks[0].qkv.weight.dtype == torch.bfloat16 and bf16.compute_dtype == torch.bfloat16
    fp8 = load_dit(root / "qwen_image_2.1_bf16.safetensors", weight_dtype="fp8_e4m3fn")
    assert fp8.blocks[0].gate_up.weight.dtype == torch.float8_e4m3fn
    assert fp8.modulation.weight.dtype == torch.bfloat16 and fp8.compute_dtype == torch.bfloat16

    rounded = copy.deepcopy(ours).to(torch.bfloat16)
    rounded.compute_dtype = torch.bfloat16
    torch.testing.assert_close(velocity(bf16), velocity(rounded), rtol=0, atol=0)
    exact = dict(ours.named_parameters())
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if dit_loading.FP8_PARAMS.fullmatch(name):  # the file is fp32 here: one rounding, fp32 -> fp8
                param.copy_(exact[name].to(torch.float8_e4m3fn).to(torch.bfloat16))
    out = velocity(fp8)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, velocity(rounded), rtol=0, atol=0)
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        load_dit(root / "qwen_image_2.1_bf16.safetensors", weight_dtype="int4")


def expect_error(path, match):
    before = gf.live_models()
    with pytest.raises(CheckpointError, match=match) as info:
        load_dit(path)
    assert path.name in str(info.value)
    assert gf.live_models() == before  # nothing half-loaded stays behind


def test_qwen_image_1x_is_named(tmp_path):
    path = tmp_path / "qwen_image_edit_2509_bf16.safetensors"
    save_file({"txt_norm.weight": torch.ones(8), "img_in.weight": torch.ones(4, 64),
               "transformer_blocks.0.img_mod.1.weight": torch.ones(8, 4)}, path)
    expect_error(path, "Qwen-Image 1.x")


def test_vae_and_text_encoder_in_the_model_loader_are_named(tmp_path):
    vae = tmp_path / "qwen_image_2.1_vae_bf16.safetensors"
    save_file({"encoder.conv1.weight": torch.ones(2, 2), "decoder.head.0.gamma": torch.ones(2)}, vae)
    expect_error(vae, "a VAE")
    encoder = tmp_path / "qwen3vl_8b_bf16.safetensors"
    save_file({"model.embed_tokens.weight": torch.ones(2, 2),
               "model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2)}, encoder)
    expect_error(encoder, "text encoder")


def test_truncated_file_is_refused(files, tmp_path):
    data = (files[0] / "qwen_image_2.1_bf16.safetensors").read_bytes()
    path = tmp_path / "qwen_image_2.1_bf16.safetensors"
    path.write_bytes(data[: len(data) * 2 // 3])
    expect_error(path, "truncated")


def test_pickle_is_never_unpickled(tmp_path, monkeypatch):
    path = tmp_path / "qwen_image_2.1.ckpt"
    torch.save({"img_in.weight": torch.ones(2)}, path)
    legacy = tmp_path / "qwen_image_2.1.pt"
    legacy.write_bytes(pickle.dumps({"img_in.weight": [1.0]}, protocol=2))

    def forbidden(*args, **kwargs):
        raise AssertionError("a pickle was loaded")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    expect_error(path, "not a safetensors file")
    expect_error(legacy, "not a safetensors file")


def test_missing_shard_is_named(files, tmp_path):
    import shutil

    repo = tmp_path / "Qwen-Image-2.1"
    shutil.copytree(files[0] / "Qwen-Image-2.1", repo)
    shard = sorted((repo / "transformer").glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_dit(repo)


def test_quantized_file_is_refused_with_advice(files, tmp_path):
    sd = comfy_state_dict(tiny_pair()[0])
    sd["transformer_blocks.0.attn.to_q.weight_scale"] = torch.ones(64, 1)
    path = tmp_path / "qwen_image_2.1_int8_convrot.safetensors"
    save_file(sd, path)
    expect_error(path, "quantized")


def test_interrupted_load_leaves_nothing_behind(files, monkeypatch):
    monkeypatch.setattr("safetensors.safe_open", gf.safe_open_failing_at(10, KeyboardInterrupt))
    before = gf.live_models()
    with pytest.raises(KeyboardInterrupt):
        load_dit(files[0] / "qwen_image_2.1_bf16.safetensors")
    assert gf.live_models() == before


def test_config_is_inferred_from_shapes(files):
    from qi21.model.loaders.safetensors_io import read_header

    tensors, _ = read_header(files[0] / "qwen_image_2.1_bf16.safetensors")
    assert infer_config(tensors) == files[1].config
