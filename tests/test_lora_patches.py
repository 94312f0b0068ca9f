"""Full-weight patches in LoRA files (model/loaders/lora_patches.py), as ComfyUI applies them: `.diff` (any shape, 1-D
included), `.diff_b`, `.set_weight`, next to low-rank pairs in one file, on every weight format.

The files are written the way ComfyUI's LoRA extraction writes them (`comfy_extras/nodes_lora_extract.py`, read for
the layout; the writer is `tiny_checkpoints.extracted_lora_state_dict`): `diffusion_model.` keys of ComfyUI's DiT
layout, a truncated-SVD `lora_up`/`lora_down` pair per 2-D weight, `.diff` for the norms (and, as one community
Turbo extract does, for `img_in`, `proj_out` and the timestep embedder's `linear_1`), `.diff_b` for biases, all fp16.
The oracle is diffusers' transformer with the merged weights `W + strength * delta` (delta = up @ down or the diff,
as the file stores them), set into its state dict independently of our code; fp32, <= 1e-5.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from diffusers import QwenImage21Transformer2DModel
from safetensors.torch import load_file, save_file

from dit_fixtures import reference_velocity
from qi21.demo import tiny_checkpoints as tiny
from qi21.model.features.lora import apply_lora
from qi21.model.layers.linear import Linear
from qi21.model.layers.lora import DeltaBranch, release_branches
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.lora import LoraError, read_lora
from test_lora import case_for, velocities

TOL = 1e-5
PREFIX = "diffusion_model."


# -- the files and the oracle -----------------------------------------------------------------------------------
def comfy_state(path) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model.diffusion_model."): v.float() for k, v in load_file(str(path)).items()}


def extract(tiny_models, kind: str = "standard", rank: int = 8) -> dict[str, torch.Tensor]:
    """Turbo - Base of the tiny set as ComfyUI's extraction writes it ("standard": pairs + `.diff` for 1-D weights
    and the three community full layers; "full_diff": its full_diff type, every weight a `.diff`)."""
    base, turbo = comfy_state(tiny_models["dit"]), comfy_state(tiny_models["turbo_dit"])
    full = tiny.TURBO_LORA_FULL if kind == "standard" else tuple(k.removesuffix(".weight") for k in base)
    return tiny.extracted_lora_state_dict(base, turbo, rank, full)


def write(path, tensors) -> str:
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def to_diffusers(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A ComfyUI-layout weight under diffusers' names (the fused gate_up is [gate_layer; proj])."""
    if key.endswith("img_mlp.gate_up.weight"):
        gate, up = tensor.chunk(2)
        stem = key[: -len("gate_up.weight")]
        return {stem + "gate_layer.weight": gate, stem + "proj.weight": up}
    return {key: tensor}


def file_deltas(tensors) -> dict[str, torch.Tensor]:
    """ComfyUI key (`<module>.weight`) -> the weight delta a file holds (up @ down, or the diff), fp32; sets apart."""
    deltas = {}
    for key, value in tensors.items():
        module = key.removeprefix(PREFIX)
        if module.endswith(".lora_up.weight"):
            stem = module.removesuffix(".lora_up.weight")
            deltas[stem + ".weight"] = value.float() @ tensors[PREFIX + stem + ".lora_down.weight"].float()
        elif module.endswith(".diff"):
            deltas[module.removesuffix(".diff") + ".weight"] = value.float()
    return deltas


def merged_reference(reference, weights: dict[str, torch.Tensor]):
    """A copy of diffusers' transformer holding `weights` (ComfyUI keys) instead of its own."""
    model = copy.deepcopy(reference)
    state = model.state_dict()
    for key, value in weights.items():
        for name, tensor in to_diffusers(key, value).items():
            assert state[name].shape == tensor.shape, name
            state[name] = tensor
    model.load_state_dict(state)
    return model.eval()


def merged(base: dict, deltas: dict, strength: float) -> dict:
    return {key: base[key] + strength * delta for key, delta in deltas.items()}


def assert_equals_reference(ours, expected_model, t=0.6):
    kwargs, prefixes, x = case_for(ours)
    t = torch.tensor([t])
    with torch.no_grad():
        expected = reference_velocity(expected_model, kwargs, t)
        for got in velocities(ours, kwargs, prefixes, x, t):
            torch.testing.assert_close(got, expected, rtol=0, atol=TOL)
    return expected


@pytest.fixture(scope="module")
def base_pair(tiny_models):
    """(diffusers' Base transformer, our Base DiT) of the tiny set, fp32."""
    reference = QwenImage21Transformer2DModel.from_pretrained(tiny_models["diffusers_base"], subfolder="transformer",
                                                              torch_dtype=torch.float32).eval()
    return reference, load_dit(tiny_models["dit"], weight_dtype="fp32")


# -- exactness ----------------------------------------------------------------------------------------------------
def kohya(tensors) -> dict[str, torch.Tensor]:
    """The same file under kohya's names (`lora_unet_` + the module path with underscores)."""
    out = {}
    for key, value in tensors.items():
        module, dot, part = key.removeprefix(PREFIX).partition(".lora_")
        module, part = (module, "lora_" + part) if dot else key.removeprefix(PREFIX).rsplit(".", 1)
        out["lora_unet_" + module.replace(".", "_") + "." + part] = value
    return out


@pytest.mark.parametrize("kind", ["standard", "full_diff", "standard, kohya names"])
def test_a_comfyui_turbo_extract_on_base_equals_the_merged_weights(base_pair, tiny_models, tmp_path, kind):
    reference, ours = base_pair
    tensors = extract(tiny_models, kind.split(",")[0])
    assert any(k.endswith("norm_q.diff") for k in tensors) and any(k.endswith("text_norm.diff") for k in tensors)
    assert (kind == "full_diff") != any(k.endswith(".lora_up.weight") for k in tensors)
    path = write(tmp_path / "extract.safetensors", kohya(tensors) if "kohya" in kind else tensors)
    base = comfy_state(tiny_models["dit"])
    deltas = file_deltas(tensors)
    assert len(deltas) == len(base)  # every weight of the DiT is patched, norms included
    plain = None
    for strength in (1.0, 0.5):
        with_lora = apply_lora(ours, path, strength)
        assert with_lora.options.loras[0].notes == ()  # nothing ignored, nothing left out
        expected = assert_equals_reference(with_lora, merged_reference(reference, merged(base, deltas, strength)))
        plain = plain if plain is not None else assert_equals_reference(ours, reference)
        assert (expected - plain).abs().max() > 0.05  # the patch changes the output clearly
    fresh = load_dit(tiny_models["dit"], weight_dtype="fp32")  # the model it was given is unchanged
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), fresh.state_dict().values()))
    assert all(m.adapters == () for m in ours.modules() if isinstance(m, Linear))


def test_the_shipped_tiny_turbo_lora_is_such_an_extract(base_pair, tiny_models):
    """The tiny set's Turbo LoRA (the Base + Turbo LoRA workflow's file) on Base: the merged weights, and nearer
    the Turbo model than the Base one (rank 8 of random 64-wide differences: 0.34 of the way back, measured)."""
    reference, ours = base_pair
    tensors = load_file(str(tiny_models["turbo_lora"]))
    expected = assert_equals_reference(apply_lora(ours, tiny_models["turbo_lora"], 1.0),
                                       merged_reference(reference, merged(comfy_state(tiny_models["dit"]),
                                                                          file_deltas(tensors), 1.0)))
    turbo = QwenImage21Transformer2DModel.from_pretrained(tiny_models["diffusers_turbo"], subfolder="transformer",
                                                          torch_dtype=torch.float32).eval()
    kwargs, _, _ = case_for(ours)
    with torch.no_grad():
        to_turbo = (reference_velocity(turbo, kwargs, torch.tensor([0.6])) - expected).abs().max()
        from_base = (reference_velocity(reference, kwargs, torch.tensor([0.6])) - expected).abs().max()
    assert to_turbo < 0.5 * from_base


def test_bias_deltas_do_not_apply_as_in_comfyui_and_only_nonzero_ones_are_noted(base_pair, tiny_models, tmp_path):
    """Qwen-Image 2.1 has no biases (diffusers and ComfyUI build every Linear with bias=False): ComfyUI applies no
    `.diff_b`; neither do we. All-zero ones change nothing and need no note; a non-zero one is named."""
    reference, ours = base_pair
    tensors = extract(tiny_models)
    rows = {k.removesuffix(".lora_up.weight"): v.shape[0] for k, v in tensors.items() if k.endswith(".lora_up.weight")}
    zeros = {f"{stem}.diff_b": torch.zeros(n, dtype=torch.float16) for stem, n in rows.items()}
    expected_model = merged_reference(reference, merged(comfy_state(tiny_models["dit"]), file_deltas(tensors), 0.5))
    quiet = apply_lora(ours, write(tmp_path / "zero_bias.safetensors", {**tensors, **zeros}), 0.5)
    assert quiet.options.loras[0].notes == ()
    assert_equals_reference(quiet, expected_model)
    loud_key = PREFIX + "transformer_blocks.1.attn.to_out.0.diff_b"
    loud = apply_lora(ours, write(tmp_path / "bias.safetensors", {**tensors, **zeros, loud_key: torch.ones(64)}), 0.5)
    (note,) = loud.options.loras[0].notes
    assert "1 of its 17 bias deltas (.diff_b) are not zero (diffusion_model.transformer_blocks.1.attn.to_out.0" in note
    assert "not applied; ComfyUI does not apply them either" in note and "ignored" not in note
    assert_equals_reference(loud, expected_model)


def test_set_weight_replaces_a_norm_and_rows_of_a_fused_weight_over_an_earlier_lora(base_pair, tmp_path):
    """`.set_weight` as ComfyUI's "set" patch: the weight becomes the tensor (strength does not scale it) after
    whatever an earlier LoRA did to that weight; here block 0's to_k (rows W..2W of our fused qkv, which an earlier
    LoRA also patches on its q rows) and the text norm."""
    reference, ours = base_pair
    width = ours.config.width
    generator = torch.Generator().manual_seed(5)
    down, up = torch.randn(4, width, generator=generator) / 8, torch.randn(width, 4, generator=generator) / 2
    first = write(tmp_path / "first.safetensors", {PREFIX + "transformer_blocks.0.attn.to_q.lora_down.weight": down,
                                                   PREFIX + "transformer_blocks.0.attn.to_q.lora_up.weight": up,
                                                   PREFIX + "transformer_blocks.0.attn.to_k.lora_down.weight": down,
                                                   PREFIX + "transformer_blocks.0.attn.to_k.lora_up.weight": up})
    new_k = torch.randn(width, width, generator=generator) / 8
    new_norm = 0.3 * torch.randn(ours.config.context_in_dim, generator=generator)
    second = write(tmp_path / "set.safetensors", {PREFIX + "transformer_blocks.0.attn.to_k.set_weight": new_k,
                                                  PREFIX + "txt_in.text_norm.set_weight": new_norm,
                                                  PREFIX + "proj_out.diff": torch.randn(64, width) / 8})
    base = {k: v.detach().float() for k, v in reference.state_dict().items()}
    weights = {"transformer_blocks.0.attn.to_q.weight": base["transformer_blocks.0.attn.to_q.weight"] + 0.7 * up @ down,
               "transformer_blocks.0.attn.to_k.weight": new_k, "txt_in.text_norm.weight": new_norm,
               "proj_out.weight": base["proj_out.weight"] + 0.3 * load_file(second)[PREFIX + "proj_out.diff"]}
    chained = apply_lora(apply_lora(ours, first, 0.7), second, 0.3)
    assert type(chained.blocks[0].qkv) is Linear and chained.blocks[0].qkv.adapters == ()  # one dense copy
    assert chained.blocks[0].qkv.weight is not ours.blocks[0].qkv.weight
    assert_equals_reference(chained, merged_reference(reference, weights))


def test_within_one_module_a_full_patch_replaces_the_pair_as_in_comfyui(base_pair, tmp_path):
    reference, ours = base_pair
    width = ours.config.width
    diff = torch.randn(width, width) / 8
    tensors = {PREFIX + "transformer_blocks.1.attn.to_out.0.lora_down.weight": torch.randn(4, width),
               PREFIX + "transformer_blocks.1.attn.to_out.0.lora_up.weight": torch.randn(width, 4),
               PREFIX + "transformer_blocks.1.attn.to_out.0.diff": diff}
    model = apply_lora(ours, write(tmp_path / "both.safetensors", tensors), 1.0)
    (note,) = model.options.loras[0].notes
    assert "low-rank pairs replaced by a full-weight patch of the same module (as in ComfyUI)" in note
    key = "transformer_blocks.1.attn.to_out.0.weight"
    assert_equals_reference(model, merged_reference(reference, {key: reference.state_dict()[key] + diff}))


@pytest.mark.parametrize("tensors, match", [
    ({PREFIX + "img_in.diff": torch.randn(64, 63)}, r"img_in.diff is F32 \[64, 63\], expected a float tensor of "
                                                    r"shape \[64, 64\] \(the weight of img_in\)"),
    ({PREFIX + "transformer_blocks.0.attn.norm_k.diff": torch.randn(31)}, r"expected a float tensor of shape \[32\]"),
    ({PREFIX + "txt_in.text_norm.lora_down.weight": torch.randn(2, 48),
      PREFIX + "txt_in.text_norm.lora_up.weight": torch.randn(48, 2)}, "norm scale .1-D.: a low-rank pair cannot"),
    ({PREFIX + "proj_out.diff": torch.full((64, 64), float("nan"))}, "proj_out.diff holds NaN"),
])
def test_a_patch_that_does_not_fit_is_refused_before_any_change(base_pair, tmp_path, tensors, match):
    _, ours = base_pair
    with pytest.raises(LoraError, match=match):
        apply_lora(ours, write(tmp_path / "bad.safetensors", tensors), 1.0)
    assert all(m.adapters == () for m in ours.modules() if isinstance(m, Linear))


# -- every weight format --------------------------------------------------------------------------------------
def load_format(tiny_models, tmp_path, fmt: str):
    if fmt == "gguf Q8_0":
        from test_gguf import single_type, write_gguf

        tensors = {k: v.numpy() for k, v in comfy_state(tiny_models["dit"]).items()}
        return load_dit(write_gguf(tmp_path / "qwen_image_2.1-Q8_0.gguf", tensors, single_type("Q8_0")),
                        weight_dtype="fp32")
    if fmt == "int8 ConvRot (comfy-kitchen)":
        from test_quantized import write_dit

        path, _, _ = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", "int8_convrot")
        return load_dit(path, weight_dtype="fp32")
    return load_dit(tiny_models["dit"], weight_dtype=fmt)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "fp8_e4m3fn", "int8 ConvRot (comfy-kitchen)", "gguf Q8_0"])
def test_every_weight_format_takes_the_deltas_without_touching_its_weights(tiny_models, tmp_path, fmt):
    model = load_format(tiny_models, tmp_path, fmt)
    strength = 0.5
    lora = read_lora(tiny_models["turbo_lora"], model.config)
    with_lora = apply_lora(model, tiny_models["turbo_lora"], strength)
    norms = {p.param: p for p in lora.patches if p.param is not None}
    assert set(norms) == {"txt_in.text_norm.weight"} | {f"blocks.{i}.norm_{x}" for i in range(2) for x in "qk"}
    originals, copies = dict(model.named_parameters()), dict(with_lora.named_parameters())
    assert originals.keys() == copies.keys()
    for name, param in originals.items():
        if name in norms:  # a patched copy of the small tensor, rounded to its stored dtype; the original kept
            expected = (param.float() + strength * norms[name].tensor.float()).to(param.dtype)
            assert copies[name] is not param and torch.equal(copies[name], expected)
        else:
            assert copies[name] is param
    dtype = model.compute_dtype
    for linear in ("img_in", "proj_out", "time_embed.linear_1"):
        (patch,) = [p for p in lora.patches if p.target is not None and p.target.linear == linear]
        base, patched = model.get_submodule(linear), with_lora.get_submodule(linear)
        assert type(patched) is type(base) and isinstance(patched.adapters[-1], DeltaBranch)
        x = torch.randn(3, patch.tensor.shape[1]).to(dtype)
        expected = base.rows(x, 0, base.out_features) + F.linear(x, (strength * patch.tensor.float()).to(dtype))
        torch.testing.assert_close(patched.rows(x, 0, base.out_features), expected, rtol=0, atol=0)
    kwargs, prefixes, latents = case_for(model)
    with torch.no_grad():
        out, plain = with_lora(latents, torch.tensor([0.5]), prefixes), model(latents, torch.tensor([0.5]), prefixes)
    assert out.dtype == dtype and torch.isfinite(out).all() and (out - plain).abs().max() > 0
    release_branches(with_lora)  # what the sampler's unload hook calls: the dense copies go
    assert all(not a._plans for m in with_lora.modules() for a in getattr(m, "adapters", ()))

    # a .set_weight on block 0's to_k (rows W..2W of the fused qkv) over it: one dense Linear, the other rows the
    # stored weight as it dequantizes plus the Turbo LoRA's branches on them, the set rows the file's tensor
    width = model.config.width
    new_k = torch.randn(width, width) / 8
    set_path = write(tmp_path / "set.safetensors", {PREFIX + "transformer_blocks.0.attn.to_k.set_weight": new_k})
    replaced = apply_lora(with_lora, set_path, 1.0)
    dense, before = replaced.blocks[0].qkv, with_lora.blocks[0].qkv
    assert type(dense) is Linear and dense.adapters == () and model.blocks[0].qkv is not dense
    expected = before.weight_rows(0, 3 * width, torch.float32)
    for adapter in before.adapters:
        expected = expected + adapter.dense(0, 3 * width, "cpu")
    expected[width : 2 * width] = new_k
    torch.testing.assert_close(dense.weight.float(), expected.to(dense.weight.dtype).float(), rtol=0, atol=0)


def test_full_weight_patches_on_a_deferred_dit_merge_with_the_file_weights(tiny_models, tmp_path):
    """A DiT loaded for a GPU waits on its file (placeholders, model/loaders/deferred.py): a `.diff` / `.set_weight`
    patch must merge with the file's weight, not the placeholder's zeros; the result equals the eagerly loaded one."""
    path = write(tmp_path / "extract.safetensors", extract(tiny_models, "full_diff"))
    eager = apply_lora(load_dit(tiny_models["dit"], weight_dtype="fp32"), path, 0.5)
    deferred = apply_lora(load_dit(tiny_models["dit"], weight_dtype="fp32", defer=True), path, 0.5)
    deferred.file_weights.materialize(lambda param: "cpu")
    for (name, a), (_, b) in zip(eager.named_parameters(), deferred.named_parameters()):
        assert torch.equal(a, b), name
