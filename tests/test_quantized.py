"""ComfyUI's quantized checkpoints (int8 ConvRot, fp8, legacy scaled fp8, W4A8, ConvRot W4A4) through comfy-kitchen:
each loaded model against the same model built from comfy-kitchen's own dequantization of its weights, the bytes it
keeps, the DiT's row ranges over fused weights, the text encoder, the whole node graph, and every refusal.

Every file is written here by comfy-kitchen's own quantizers (`TensorWiseINT8Layout`, `TensorCoreFP8Layout`,
`AsymW4A8Int8Layout`, `TensorCoreConvRotW4A4Layout`) in the real key layout: `<layer>.weight` in the storage dtype,
its scales beside it, and the layer's description as a `<layer>.comfy_quant` JSON tensor or in the header's
`_quantization_metadata` (legacy files: a `scaled_fp8` marker with `scale_weight` / `scale_input`). The quantized
layers are the ones of the released `qwen_image_2.1_int8_convrot`: each block's to_q, to_k, to_v, to_out.0,
img_mlp.gate_up (one fused file tensor) and img_mlp.out; everything else stays float. The tiny DiT's block inputs are
64 and 192 wide, so ConvRot uses 64-wide Hadamard blocks here (256 in the release).

Tolerances: weight-only paths (fp8 on a CPU, layers marked `full_precision_matrix_mult`) must match within 1e-5 in
fp32. Paths that quantize activations too are compared relative to the output's largest magnitude, with bounds
about twice the worst measured on these models (max |diff| / max |reference| of the DiT velocity, fp32, CPU, three
seeds): int8 ConvRot 0.18-0.29% and int8 tensorwise 0.29-0.48% (bound 1%), W4A8 0.22-0.27% (bound 1%), ConvRot
W4A4 (4-bit activations) 3.2-5.7% (bound 12%); fp8 and full-precision int8 measured 0 exactly. Text encoder
(last hidden states, three prompts): int8 ConvRot 0.8-1.3%, W4A8 1.0-1.1% (bound 3%); computed in fp16 against the
fp32 dequantized model: W4A8 0.9% (bound 3%), a plain fp16 file 0.11% (bound 0.5%).
"""

import json
import re
import shutil
import sys

import comfy_kitchen as ck
import pytest
import torch
import torch.nn.functional as F
from comfy_kitchen.tensor import (
    AsymW4A8Int8Layout,
    TensorCoreConvRotW4A4Layout,
    TensorCoreFP8Layout,
    TensorCoreMXFP8Layout,
    TensorCoreNVFP4Layout,
    TensorWiseINT8Layout,
)
from safetensors.torch import load_file, save_file

import graph_fixtures as gf
from dit_fixtures import make_case
from qi21.demo import tiny_checkpoints as tiny
from qi21.model.layers import format_table, formats, kitchen as kitchen_layers, quant_tables
from qi21.model.layers.linear import Linear
from qi21.model.loaders import kitchen as quantized
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.safetensors_io import CheckpointError
from qi21.model.loaders.text_encoder import load_text_encoder
from qi21.model.sampling.schedule import TURBO_SIGMAS

GROUP = 64  # ConvRot block (a power of 4 dividing the tiny DiT's 64- and 192-wide inputs)
TE_GROUP = 16  # the tiny text encoder's linears take 16 or 32 inputs
BLOCK_LINEAR = re.compile(r"transformer_blocks\.\d+\.(attn\.to_[qkv]|attn\.to_out\.0|img_mlp\.gate_up|img_mlp\.out)"
                          r"\.weight")
TE_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
# measured relative error x ~2 (see the module docstring); None: weight-only, 1e-5 absolute
REL_BOUND = {"int8_convrot": 0.01, "int8": 0.01, "w4a8": 0.01, "w4a4": 0.12}


# -- writing quantized files ------------------------------------------------------------------------------------
def quantize(kind: str, weight: torch.Tensor, group: int = GROUP):
    """(tensors by role, description, the weight as comfy-kitchen dequantizes it in fp32) for one Linear weight."""
    w = weight.float()
    if kind in ("int8_convrot", "int8", "int8_full"):
        convrot = kind == "int8_convrot"
        q, p = TensorWiseINT8Layout.quantize(w, is_weight=True, per_channel=convrot, convrot=convrot,
                                             convrot_groupsize=group)
        description = {"format": "int8_tensorwise"}
        if convrot:
            description.update(convrot=True, convrot_groupsize=group)
        if kind == "int8_full":
            description["full_precision_matrix_mult"] = True
        return {"weight": q, "weight_scale": p.scale}, description, TensorWiseINT8Layout.dequantize(q, p).float()
    if kind in ("float8_e4m3fn", "float8_e5m2"):
        q, p = TensorCoreFP8Layout.quantize(w, dtype=getattr(torch, kind))
        roles = {"weight": q, "weight_scale": p.scale}
        if kind == "float8_e4m3fn":  # a calibrated activation scale, as fp8 files carry one
            roles["input_scale"] = torch.tensor(0.01)
        return roles, {"format": kind}, TensorCoreFP8Layout.dequantize(q, p).float()
    if kind == "w4a8":
        q, p = AsymW4A8Int8Layout.quantize(w, group_size=16, convrot_groupsize=group)
        roles = {"weight": q, "weight_s_rel": p.scale, "weight_s_channel": p.s_channel}
        if p.codebook is not None:
            roles["weight_codebook"] = p.codebook
        description = {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": group}
        return roles, description, AsymW4A8Int8Layout.dequantize(q, p).float()
    if kind == "nvfp4":  # block scales (fp8, swizzled) as `weight_scale`, the global scale as `weight_scale_2`
        q, p = TensorCoreNVFP4Layout.quantize(w)
        return ({"weight": q, "weight_scale": p.block_scale, "weight_scale_2": p.scale}, {"format": "nvfp4"},
                TensorCoreNVFP4Layout.dequantize(q, p).float())
    if kind == "mxfp8":  # E8M0 block scales (swizzled) stored as bytes, as ComfyUI reads them
        q, p = TensorCoreMXFP8Layout.quantize(w)
        return ({"weight": q, "weight_scale": p.scale.view(torch.uint8)}, {"format": "mxfp8"},
                TensorCoreMXFP8Layout.dequantize(q, p).float())
    if kind == "w4a4":
        q, p = TensorCoreConvRotW4A4Layout.quantize(w, convrot_groupsize=group, quant_group_size=64)
        return ({"weight": q, "weight_scale": p.scale}, {"format": "convrot_w4a4", "convrot_groupsize": group},
                TensorCoreConvRotW4A4Layout.dequantize(q, p).float())
    raise KeyError(kind)


def blob(description: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(description).encode("utf-8")), dtype=torch.uint8)


def quantized_files(state: dict, kind: str, pick, group: int = GROUP, where: str = "tensor", prefix: str = "",
                    skip=()):
    """(quantized state dict, header metadata, dequantized reference state dict): the weights `pick` selects
    quantized as `kind`, the others fp32. `where`: "tensor" (`comfy_quant` tensors), "metadata"
    (`_quantization_metadata`) or "legacy" (`scaled_fp8` marker, `scale_weight`/`scale_input`)."""
    out, reference, layers = {}, {}, {}
    for key, value in state.items():
        name = prefix + key
        if not pick(key) or key in skip:
            out[name] = reference[name] = value.float().contiguous()
            continue
        roles, description, dequantized = quantize(kind, value, group)
        layer = name[: -len(".weight")]
        for role, tensor in roles.items():
            suffix = {"weight_scale": "scale_weight", "input_scale": "scale_input"}.get(role, role)
            out[f"{layer}.{suffix if where == 'legacy' else role}"] = tensor.contiguous()
        if where == "tensor":
            out[layer + ".comfy_quant"] = blob(description)
        layers[layer] = description
        reference[name] = dequantized
    metadata = {"format": "pt"}
    if where == "metadata":
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
    if where == "legacy":
        out[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out, metadata, reference


def dit_state(seed: int = 0) -> dict:
    return tiny.comfy_dit_state_dict(tiny.dit_state_dict(tiny.TINY_DIT, seed))


def write_dit(folder, name, kind, where="tensor", prefix="", skip=(), seed=0):
    """A quantized ComfyUI single file `name` and its dequantized fp32 twin; returns both paths and the tensors."""
    out, metadata, reference = quantized_files(dit_state(seed), kind, BLOCK_LINEAR.fullmatch, where=where,
                                               prefix=prefix, skip=skip)
    path, twin = folder / name, folder / ("dequantized_" + name)
    save_file(out, str(path), metadata=metadata)
    save_file(reference, str(twin), metadata={"format": "pt"})
    return path, twin, out


def velocity(model, seed=1):
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7), seed=seed, context_dim=model.config.context_in_dim)
    with torch.no_grad():
        return model(x.to(model.compute_dtype), 0.6, prefixes).float()


def assert_matches(got: torch.Tensor, expected: torch.Tensor, kind: str) -> float:
    """Weight-only: within 1e-5 absolute; activation-quantizing paths: within REL_BOUND of the largest value.
    Returns the measured relative error."""
    diff = (got - expected).abs().max().item()
    relative = diff / expected.abs().max().item()
    if REL_BOUND.get(kind) is None:
        assert diff <= 1e-5, f"{kind}: max |diff| {diff:.3g} > 1e-5"
    else:
        assert relative <= REL_BOUND[kind], f"{kind}: relative error {relative:.3g} > {REL_BOUND[kind]}"
    return relative


def payload(tensors: dict, loaded=lambda key: True) -> int:
    """Bytes of a file's model data: everything but the JSON descriptions and the legacy marker."""
    return sum(t.numel() * t.element_size() for key, t in tensors.items()
               if loaded(key) and not key.endswith("comfy_quant") and not key.endswith("scaled_fp8"))


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# -- the DiT ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, where, prefix", [
    pytest.param("int8_convrot", "tensor", "", id="int8 ConvRot, comfy_quant tensors"),
    pytest.param("int8_convrot", "metadata", "model.diffusion_model.", id="int8 ConvRot, header metadata, prefixed"),
    pytest.param("int8", "tensor", "model.diffusion_model.", id="int8 tensorwise, prefixed"),
    pytest.param("int8_full", "tensor", "", id="int8, full_precision_matrix_mult (weight-only)"),
    pytest.param("float8_e4m3fn", "tensor", "", id="fp8 e4m3fn with input_scale"),
    pytest.param("float8_e5m2", "metadata", "", id="fp8 e5m2, header metadata"),
    pytest.param("float8_e4m3fn", "legacy", "model.diffusion_model.", id="legacy scaled_fp8"),
    pytest.param("w4a8", "tensor", "", id="W4A8"),
    pytest.param("w4a4", "tensor", "", id="ConvRot W4A4"),
    pytest.param("nvfp4", "tensor", "", id="NVFP4"),
    pytest.param("mxfp8", "metadata", "model.diffusion_model.", id="MXFP8, header metadata, prefixed"),
])
def test_every_format_matches_its_dequantized_model_and_keeps_the_file_bytes(tmp_path, kind, where, prefix):
    """On a CPU the int8, W4A8, NVFP4 and MXFP8 layers are dequantized right before their GEMMs: equal to the
    dequantized model (<= 1e-5); the int8 kernels, asked for, stay within their activation-quantization bounds."""
    path, twin, tensors = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", kind, where, prefix)
    model, reference = load_dit(path), load_dit(twin)
    assert model.compute_dtype == torch.float32 and model.source.quantized
    assert isinstance(model.blocks[0].qkv, kitchen_layers.QuantLinear)
    assert type(model.modulation) is Linear and model.modulation.weight.dtype == torch.float32  # kept as stored
    assert parameter_bytes(model) == payload(tensors)  # nothing upcast, nothing left out
    if kind == "float8_e5m2":
        assert model.blocks[0].gate_up.weight_0.dtype == torch.float8_e5m2
    fmt = model.source.quantized[0]
    summary = kitchen_layers.gemm_summary(model, torch.device("cpu"))
    assert summary == {fmt: "kernel" if kind == "w4a4" else "dequantize"}
    expected = velocity(reference)
    assert_matches(velocity(model), expected, kind if kind in ("w4a4",) else "float8_e4m3fn")  # 1e-5 but W4A4
    if kind in ("int8_convrot", "int8", "w4a8"):
        kitchen_layers.set_gemm(model, "kernel")
        assert kitchen_layers.gemm_summary(model, "cpu") == {fmt: "kernel"}
        assert_matches(velocity(model), expected, kind)


def test_row_ranges_of_fused_weights_use_each_file_tensors_own_scales(tmp_path):
    """[q; k; v] is three file tensors (three scales), [gate; up] one: any row range, inside one segment or across
    two, equals comfy-kitchen's kernel on the whole file tensor cut to those rows, exactly."""
    state = dit_state()
    state["transformer_blocks.1.attn.to_k.weight"] *= 3  # so the three per-tensor scales differ
    state["transformer_blocks.1.attn.to_v.weight"] *= 0.5
    tensors, metadata, _ = quantized_files(state, "int8", BLOCK_LINEAR.fullmatch)
    save_file(tensors, str(tmp_path / "qwen_image_2.1_int8.safetensors"), metadata=metadata)
    model = load_dit(tmp_path / "qwen_image_2.1_int8.safetensors")
    width, hidden = model.config.width, model.config.mlp_hidden
    qkv, gate_up = model.blocks[1].qkv, model.blocks[1].gate_up
    qkv.gemm = gate_up.gemm = "kernel"  # comfy-kitchen's int8 GEMM, also on a CPU
    assert [(s.start, s.end) for s in qkv.segments] == [(0, width), (width, 2 * width), (2 * width, 3 * width)]
    scales = [tensors[f"transformer_blocks.1.attn.to_{x}.weight_scale"] for x in "qkv"]
    assert scales[0].numel() == 1 and len({s.item() for s in scales}) == 3  # really different scales
    x = torch.randn(7, width)

    def kernel(key):  # the file tensor's whole output
        return ck.int8_linear(x, tensors[key + ".weight"], tensors[key + ".weight_scale"], out_dtype=x.dtype)

    full = torch.cat([kernel(f"transformer_blocks.1.attn.to_{x_}") for x_ in "qkv"], dim=-1)
    for start, end in ((0, 2 * width), (2 * width, 3 * width), (width - 5, width + 9), (3, 17), (0, 3 * width)):
        torch.testing.assert_close(qkv.rows(x, start, end), full[:, start:end], rtol=0, atol=0)
    mlp = kernel("transformer_blocks.1.img_mlp.gate_up")
    for start, end in ((0, hidden), (hidden, 2 * hidden), (hidden - 4, hidden + 4)):
        torch.testing.assert_close(gate_up.rows(x, start, end), mlp[:, start:end], rtol=0, atol=0)
    params = TensorWiseINT8Layout.Params(scale=scales[1], orig_dtype=torch.float32, orig_shape=(width, width))
    dense = TensorWiseINT8Layout.dequantize(tensors["transformer_blocks.1.attn.to_k.weight"], params)
    torch.testing.assert_close(qkv.weight_rows(width + 2, width + 6, torch.float32), dense[2:6], rtol=0, atol=0)


def test_a_layer_the_file_keeps_in_float_stays_float_inside_a_fused_weight(tmp_path):
    skip = {f"transformer_blocks.{i}.attn.to_k.weight" for i in range(tiny.TINY_DIT.num_layers)}
    path, twin, tensors = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", "float8_e4m3fn", skip=skip)
    model = load_dit(path)
    assert [s.fmt for s in model.blocks[0].qkv.segments] == ["float8_e4m3fn", "float", "float8_e4m3fn"]
    assert parameter_bytes(model) == payload(tensors)
    assert_matches(velocity(model), velocity(load_dit(twin)), "float8_e4m3fn")


def test_bf16_layers_stay_bf16_and_base_and_turbo_come_from_the_name(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in dit_state().items()}
    out, metadata, _ = quantized_files(state, "int8_convrot", BLOCK_LINEAR.fullmatch)
    out = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 and not k.endswith("scale") else v
           for k, v in out.items()}
    for name, variant in (("qwen_image_2.1_int8_convrot.safetensors", "base"),
                          ("qwen_image_2.1_turbo_int8_convrot.safetensors", "turbo")):
        save_file(out, str(tmp_path / name), metadata=metadata)
        model = load_dit(tmp_path / name)
        assert model.source.variant == variant and model.source.quantized == ("int8_tensorwise",)
        assert model.compute_dtype == torch.bfloat16 and model.img_in.weight.dtype == torch.bfloat16
        assert model.blocks[0].down.weight_0.dtype == torch.int8 and model.blocks[0].down.weight.is_meta
        assert parameter_bytes(model) == payload(out)
        assert torch.isfinite(velocity(model)).all()


def test_a_lora_runs_on_a_quantized_model(tmp_path, tiny_models):
    from qi21.model.features.lora import apply_lora

    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", "int8_convrot")
    model = load_dit(path)
    with_lora = apply_lora(model, tiny_models["lora"], 0.8)
    assert velocity(with_lora).sub(velocity(model)).abs().max() > 0
    assert all(a is b for a, b in zip(model.parameters(), with_lora.parameters()))


def test_one_fp8_path_for_the_own_option_and_fp8_files_without_comfy_kitchen(tiny_models, tmp_path, monkeypatch):
    """weight_dtype fp8_e4m3fn on a float file and an fp8 file make the same fp8 QuantLinear, in plain torch: the
    same layers whether comfy-kitchen is installed or not, equal to the model on the fp8-rounded weights."""
    path, twin, _ = write_dit(tmp_path, "qwen_image_2.1_fp8.safetensors", "float8_e4m3fn")
    model, from_file = load_dit(tiny_models["dit"], weight_dtype="fp8_e4m3fn"), load_dit(path)
    qkv = model.blocks[0].qkv
    assert isinstance(qkv, kitchen_layers.QuantLinear) and qkv.segments[0].fmt == "float8_e4m3fn"
    assert qkv.weight.dtype == torch.float8_e4m3fn  # the single segment's data is the layer's `weight`
    assert [s.fmt for s in from_file.blocks[0].qkv.segments] == ["float8_e4m3fn"] * 3
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # as if not installed
    without = load_dit(tiny_models["dit"], weight_dtype="fp8_e4m3fn")
    assert type(without.blocks[0].qkv) is type(qkv) and without.blocks[0].qkv.weight.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(velocity(model), velocity(without), rtol=0, atol=0)
    assert_matches(velocity(load_dit(path)), velocity(load_dit(twin)), "float8_e4m3fn")  # no comfy-kitchen either
    monkeypatch.undo()
    rounded = load_dit(tiny_models["dit"], weight_dtype="fp32")
    for name, module in rounded.named_modules():
        if isinstance(getattr(model.get_submodule(name), "segments", None), list):
            module.weight.data = module.weight.data.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    rounded.compute_dtype = torch.bfloat16
    reference = velocity(rounded.to(torch.bfloat16))
    assert (velocity(model) - reference).abs().max() <= 1e-2 * reference.abs().max()  # both bf16 compute


# -- the text encoder ------------------------------------------------------------------------------------------------
def te_state() -> dict:
    config = tiny.tiny_text_encoder_config()
    return {tiny.comfy_text_encoder_key(k): v for k, v in tiny.text_encoder_state_dict(config, 3).items()}


def write_te(folder, name, kind, where="tensor"):
    """`qwen3vl_8b_int8_convrot` (LM linears, token table and LM head int8 ConvRot, vision tower float),
    `qwen3vl_8b_w4a8` (LM linears W4A8) or `qwen3vl_8b_fp8_scaled` (`where="legacy"`: LM linears, LM head and
    vision linears fp8 with `scale_weight`, a `scaled_fp8` marker) at toy size, with a dequantized twin."""
    if kind == "int8_convrot":
        pick = lambda key: bool(TE_LINEAR.fullmatch(key)) or key in ("model.embed_tokens.weight", "lm_head.weight")  # noqa: E731
    elif where == "legacy":
        pick = lambda key: bool(TE_LINEAR.fullmatch(key) or VISION_LINEAR.search(key)) or key == "lm_head.weight"  # noqa: E731
    else:
        pick = TE_LINEAR.fullmatch
    out, metadata, reference = quantized_files(te_state(), kind, pick, group=TE_GROUP, where=where)
    path, twin = folder / name, folder / ("dequantized_" + name)
    save_file(out, str(path), metadata=metadata)
    save_file(reference, str(twin), metadata={"format": "pt"})
    return path, twin, out


VISION_LINEAR = re.compile(r"visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])\.weight$")
LOADED_TE = re.compile(r"model\.(layers|embed_tokens|visual)\.")  # the final norm and the LM head are never loaded


@pytest.mark.parametrize("kind, name", [("int8_convrot", "qwen3vl_8b_int8_convrot.safetensors"),
                                        ("w4a8", "qwen3vl_8b_w4a8.safetensors")])
def test_text_encoder_formats_match_their_dequantized_model(tmp_path, tiny_models, kind, name):
    path, twin, tensors = write_te(tmp_path, name, kind)
    encoder = load_text_encoder(path, tokenizer_dir=tiny_models["tokenizer"])
    reference = load_text_encoder(twin, tokenizer_dir=tiny_models["tokenizer"])
    language = encoder.model.language_model
    assert isinstance(language.layers[0].mlp.down_proj, kitchen_layers.QuantLinear)
    assert type(encoder.model.visual.blocks[0].attn.qkv) is torch.nn.Linear  # the vision tower stays float
    if kind == "int8_convrot":
        assert isinstance(language.embed_tokens, kitchen_layers.QuantEmbedding)
    assert encoder.dtype == torch.float32 and encoder.device.type == "cpu"
    assert parameter_bytes(encoder.model) == payload(tensors, lambda key: bool(LOADED_TE.match(key)))
    bound = 0.03
    for prompt in ("a red fox in the snow", "two cats"):
        got, expected = encoder.encode(prompt).embeds, reference.encode(prompt).embeds
        assert (got - expected).abs().max() / expected.abs().max() <= bound


@pytest.mark.parametrize("marker", ["scaled_fp8", "model.scaled_fp8"])
def test_legacy_scaled_fp8_text_encoder_loads_and_matches_its_dequantized_model(tmp_path, tiny_models, marker):
    """`qwen3vl_8b_fp8_scaled.safetensors`-style: a `scaled_fp8` marker (bare, or under a prefix as ComfyUI's text
    encoder loader looks for it), fp8 weights with `scale_weight` / `scale_input`; weight-only, so equal to the
    dequantized model within 1e-5."""
    path, twin, tensors = write_te(tmp_path, "qwen3vl_8b_fp8_scaled.safetensors", "float8_e4m3fn", where="legacy")
    if marker != "scaled_fp8":
        tensors[marker] = tensors.pop("scaled_fp8")
        save_file(tensors, str(path))
    assert marker in tensors and any(key.endswith(".scale_weight") for key in tensors)
    reference = load_text_encoder(twin, tokenizer_dir=tiny_models["tokenizer"])
    encoder = load_text_encoder(path, tokenizer_dir=tiny_models["tokenizer"])
    assert isinstance(encoder.model.language_model.layers[0].mlp.down_proj, kitchen_layers.QuantLinear)
    assert isinstance(encoder.model.visual.blocks[0].attn.qkv, kitchen_layers.QuantLinear)  # with its bias
    assert parameter_bytes(encoder.model) == payload(tensors, lambda key: bool(LOADED_TE.match(key)))
    from PIL import Image

    image = Image.fromarray((torch.rand(256, 256, 3) * 255).to(torch.uint8).numpy())  # the vision tower runs too
    for prompt, images in (("a red fox in the snow", ()), ("two cats", [image])):
        got, expected = encoder.encode(prompt, images).embeds, reference.encode(prompt, images).embeds
        assert (got - expected).abs().max() <= 1e-5


def test_fp16_text_encoder_files_and_fp16_compute_stay_close_to_fp32(tmp_path, tiny_models):
    """An fp16 file, and a quantized file computing in fp16, both against fp32."""
    path, twin, _ = write_te(tmp_path, "qwen3vl_8b_w4a8.safetensors", "w4a8")
    fp16_file = tmp_path / "qwen3vl_8b_fp16.safetensors"
    save_file({k: v.half() for k, v in load_file(str(twin)).items()}, str(fp16_file))
    reference = load_text_encoder(twin, tokenizer_dir=tiny_models["tokenizer"]).encode("a red fox").embeds
    for file, default, bound in ((fp16_file, torch.float16, 0.005), (path, torch.float32, 0.03)):
        assert load_text_encoder(file, tokenizer_dir=tiny_models["tokenizer"]).dtype == default  # the file's own
        half = load_text_encoder(file, weight_dtype="fp16", tokenizer_dir=tiny_models["tokenizer"])
        got = half.encode("a red fox").embeds
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        assert (got.float() - reference).abs().max() / reference.abs().max() <= bound


# -- the whole graph -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantized_root(tiny_models, tmp_path_factory):
    """The tiny set plus `qwen_image_2.1_turbo_int8_convrot` and `qwen3vl_8b_w4a8` as the loaders' models root."""
    from qi21.nodes import bridge

    root = tmp_path_factory.mktemp("quantized_models")
    for folder in ("vae", "diffusers", "loras"):
        (root / folder).symlink_to(tiny_models["root"] / folder, target_is_directory=True)
    for folder in ("diffusion_models", "text_encoders"):
        (root / folder).mkdir()
        for entry in (tiny_models["root"] / folder).iterdir():
            (root / folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    state = {k: v for k, v in tiny.comfy_dit_state_dict(tiny.dit_state_dict(tiny.TINY_DIT, 1)).items()}
    out, metadata, _ = quantized_files(state, "int8_convrot", BLOCK_LINEAR.fullmatch)
    dit = root / "diffusion_models" / "qwen_image_2.1_turbo_int8_convrot.safetensors"
    save_file({k: v.to(torch.bfloat16) if v.dtype == torch.float32 and not k.endswith("scale") else v
               for k, v in out.items()}, str(dit), metadata=metadata)
    write_te(root / "text_encoders", "qwen3vl_8b_w4a8.safetensors", "w4a8")
    (root / "text_encoders" / "dequantized_qwen3vl_8b_w4a8.safetensors").unlink()
    shutil.copytree(tiny_models["tokenizer"], root / "text_encoders" / "qwen3vl_8b_w4a8_tokenizer")
    bridge.set_models_root(root)
    yield root
    bridge.set_models_root(None)


def test_whole_graph_on_an_int8_dit_and_a_w4a8_text_encoder(quantized_root):
    from qi21.nodes import bridge
    from qi21.nodes.conditioning import QI21TextEncode
    from qi21.nodes.decode import QI21VAEDecode
    from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
    from qi21.nodes.samplers import QI21TurboSampler

    assert "qwen_image_2.1_turbo_int8_convrot.safetensors" in bridge.model_choices("diffusion_models")
    assert "qwen3vl_8b_w4a8.safetensors" in bridge.model_choices("text_encoders")
    model = QI21ModelLoader.execute("qwen_image_2.1_turbo_int8_convrot.safetensors", "default")[0]
    encoder = QI21TextEncoderLoader.execute("qwen3vl_8b_w4a8.safetensors", "default")[0]
    vae = QI21VAELoader.execute(tiny.VAE_FILE, "default")[0]
    assert model.source.variant == "turbo" and isinstance(model.blocks[0].gate_up, kitchen_layers.QuantLinear)
    assert isinstance(encoder.model.language_model.layers[0].self_attn.q_proj, kitchen_layers.QuantLinear)
    positive = QI21TextEncode.execute(encoder, "a watercolour fox", None)[0]
    out = QI21TurboSampler.execute(model, positive, 7, 256, 256, 1)
    latent, report = out[0], out.ui["qi21_report"][0]
    assert latent["samples"].shape == (1, 64, 16, 16) and torch.isfinite(latent["samples"]).all()
    assert report["steps"] == 8
    assert report["quantized_gemm"] == {"int8_tensorwise": "dequantize"}  # a CPU: no int8 GEMM
    rgb, mask, rgba = QI21VAEDecode.execute(vae, latent).args
    assert rgba.shape == (1, 256, 256, 4) and torch.isfinite(rgba).all()


# -- the Turbo grid of a diffusers folder -----------------------------------------------------------------------------
def test_turbo_sigmas_come_from_the_diffusers_folder(tiny_models, tmp_path):
    turbo = load_dit(tiny_models["diffusers_turbo"])
    assert turbo.source.variant == "turbo" and turbo.source.sigmas == tuple(TURBO_SIGMAS)
    assert load_dit(tiny_models["diffusers_base"]).source.sigmas is None
    assert load_dit(tiny_models["dit"]).source.sigmas is None  # a single file has no schedule
    repo = tmp_path / "Qwen-Image-2.1-Turbo-custom"
    shutil.copytree(tiny_models["diffusers_turbo"], repo)
    index = json.loads((repo / "model_index.json").read_text())
    del index["sample_sigmas"]
    (repo / "model_index.json").write_text(json.dumps(index))
    scheduler = json.loads((repo / "scheduler" / "scheduler_config.json").read_text())
    (repo / "scheduler" / "scheduler_config.json").write_text(json.dumps(dict(scheduler,
                                                                             sample_sigmas=[1.0, 0.9, 0.5, 0.0])))
    source = load_dit(repo).source
    assert source.sigmas == (1.0, 0.9, 0.5) and source.variant == "turbo"
    (repo / "model_index.json").write_text(json.dumps(dict(index, sample_sigmas=[1.0, 1.5, "x"])))
    with pytest.raises(CheckpointError, match="model_index.json: sample_sigmas must be a list of decreasing"):
        load_dit(repo)


# -- refusals --------------------------------------------------------------------------------------------------------
def refuse(path, match, error=CheckpointError, **kwargs):
    """`load_dit(path)` fails with `match` in a message naming the file, and leaves no model behind."""
    before = gf.live_models()
    with pytest.raises(error, match=match) as info:
        load_dit(path, **kwargs)
    assert path.name in str(info.value)
    assert gf.live_models() == before
    return str(info.value)


def rewrite(path, change, metadata=None):
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata=metadata or {"format": "pt"})
    return path


def test_missing_or_misshaped_scales_are_refused_by_name_before_any_weight_moves(tmp_path, monkeypatch):
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", "int8_convrot")
    reads = []
    original = quantized._read_roles
    monkeypatch.setattr(quantized, "_read_roles", lambda *a: reads.append(a) or original(*a))
    rewrite(path, lambda t: t.pop("transformer_blocks.1.attn.to_v.weight_scale"))
    refuse(path, r"the int8_tensorwise layer transformer_blocks\.1\.attn\.to_v has no "
                 r"transformer_blocks\.1\.attn\.to_v\.weight_scale.*download it again, or use "
                 r"qwen_image_2.1_int8_convrot")
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", "int8_convrot")
    rewrite(path, lambda t: t.update({"transformer_blocks.0.img_mlp.out.weight_scale": torch.ones(65, 1)}))
    refuse(path, r"transformer_blocks\.0\.img_mlp\.out\.weight_scale is F32 \[65, 1\], but a int8_tensorwise layer "
                 r"needs one fp32 scale for the tensor or one per row \(64\)")
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_w4a8.safetensors", "w4a8")
    rewrite(path, lambda t: t.update({"transformer_blocks.0.attn.to_q.weight_s_rel": torch.ones(64, 3)}))
    refuse(path, r"to_q\.weight_s_rel is F32 \[64, 3\], but a asym_w4a8_int8 layer needs fp8 or fp32 group scales "
                 r"of shape \[64, 4\]")
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_fp8.safetensors", "float8_e4m3fn")
    rewrite(path, lambda t: t.update({"transformer_blocks.0.attn.to_k.weight_scale": torch.ones(64)}))
    refuse(path, r"to_k\.weight_scale is F32 \[64\], but a float8_e4m3fn layer needs one fp32 scale for the whole "
                 "tensor")
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_scaled_fp8.safetensors", "float8_e4m3fn", where="legacy")
    rewrite(path, lambda t: t.pop("transformer_blocks.1.img_mlp.out.scale_weight"))
    refuse(path, r"transformer_blocks\.1\.img_mlp\.out\.weight is a scaled-fp8 weight \(the file has a scaled_fp8 "
                 r"marker\) without its transformer_blocks\.1\.img_mlp\.out\.scale_weight")
    assert reads == []  # no quantized layer was read from any of them


def test_a_scale_without_a_description_is_refused(tmp_path):
    state = dit_state()
    state["transformer_blocks.0.attn.to_q.weight_scale"] = torch.ones(64, 1)
    save_file(state, str(tmp_path / "qwen_image_2.1_int8_convrot.safetensors"))
    refuse(tmp_path / "qwen_image_2.1_int8_convrot.safetensors",
           r"to_q\.weight_scale is a quantization scale, but the file describes no quantization")


def test_tensor_cores_only_on_blackwell_and_int8_kernels_only_on_cuda(monkeypatch):
    """The automatic choice per format and device, and what a setting may force (the Blackwell GEMMs cannot run
    elsewhere, so forcing them falls back to dequantizing)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    mode = format_table.gemm_mode
    monkeypatch.setattr(formats, "blackwell", lambda device: torch.device(device).type == "cuda")  # a Blackwell GPU
    for name in ("nvfp4", "mxfp8"):
        assert mode(formats.FORMATS[name], {}, cpu) == "dequantize" == mode(formats.FORMATS[name], {}, cpu, "kernel")
        assert mode(formats.FORMATS[name], {}, cuda) == "kernel"
        assert mode(formats.FORMATS[name], {}, cuda, "dequantize") == "dequantize"
    monkeypatch.setattr(formats, "blackwell", lambda device: False)  # an older GPU
    nvfp4 = formats.FORMATS["nvfp4"]
    assert mode(nvfp4, {}, cuda) == "dequantize" == mode(nvfp4, {}, cuda, "kernel")
    int8 = formats.FORMATS["int8_tensorwise"]
    assert (mode(int8, {}, cpu), mode(int8, {}, torch.device("mps")), mode(int8, {}, cuda)) == \
        ("dequantize", "dequantize", "kernel")
    assert mode(int8, {}, cpu, "kernel") == "kernel" and mode(int8, {}, cuda, "dequantize") == "dequantize"
    assert mode(int8, {"full_precision": True}, cuda, "kernel") == "dequantize"
    assert mode(formats.FORMATS["float8_e4m3fn"], {}, cuda, "kernel") == "dequantize"  # weight-only everywhere


def test_convrot_w4a4_without_a_backend_is_refused(tmp_path):
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_convrot_w4a4.safetensors", "w4a4")
    ck.disable_backend("eager")  # as on an install whose backends lack the W4A4 GEMM
    try:
        refuse(path, r"quantized as convrot_w4a4 .*no comfy-kitchen backend available here runs it .*compute "
                     r"capability 7\.5 .*Use qwen_image_2\.1_int8_convrot")
    finally:
        ck.enable_backend("eager")


def test_unknown_formats_and_quantized_norms_are_refused(tmp_path):
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_int3.safetensors", "int8")
    rewrite(path, lambda t: t.update({"transformer_blocks.0.attn.to_q.comfy_quant": blob({"format": "int3_magic"})}))
    refuse(path, r"to_q is quantized as 'int3_magic', a format this pack does not know")
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_norm.safetensors", "int8")
    rewrite(path, lambda t: t.update({
        "transformer_blocks.0.attn.norm_q.weight": torch.ones(32, 2, dtype=torch.int8),
        "transformer_blocks.0.attn.norm_q.weight_scale": torch.tensor(1.0),
        "transformer_blocks.0.attn.norm_q.comfy_quant": blob({"format": "int8_tensorwise"})}))
    refuse(path, "norm_q")


def test_fp8_option_on_a_quantized_file_is_refused(tmp_path):
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", "int8_convrot")
    refuse(path, "already quantized .*weight_dtype fp8_e4m3fn does not apply", ValueError, weight_dtype="fp8_e4m3fn")


def test_missing_comfy_kitchen_says_how_to_install_and_is_imported_only_for_quantized_files(
        tmp_path, tiny_models, monkeypatch):
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", "int8_convrot")
    te_path, _, _ = write_te(tmp_path, "qwen3vl_8b_w4a8.safetensors", "w4a8")
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # importing it now fails, as when it is not installed
    load_dit(tiny_models["dit"])  # plain files never need it
    load_text_encoder(tiny_models["text_encoder"])
    message = refuse(path, "comfy-kitchen package, which cannot be imported", ImportError)
    assert 'pip install "comfy-kitchen' in message and "int8_tensorwise" in message
    with pytest.raises(ImportError, match=r"qwen3vl_8b_w4a8\.safetensors is a quantized checkpoint \(asym_w4a8_int8\)"):
        load_text_encoder(te_path, tokenizer_dir=tiny_models["tokenizer"])


def test_a_quantized_embedding_or_a_missing_scale_in_a_text_encoder_is_refused_by_key(tmp_path, tiny_models):
    path, _, _ = write_te(tmp_path, "qwen3vl_8b_w4a8.safetensors", "w4a8")
    tensors = load_file(str(path))
    roles, description, _ = quantize("w4a8", tensors.pop("model.embed_tokens.weight"), TE_GROUP)
    tensors.update({f"model.embed_tokens.{role}": t for role, t in roles.items()})
    tensors["model.embed_tokens.comfy_quant"] = blob(description)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight is quantized as asym_w4a8_int8, which this "
                                              r"pack runs only for Linear layers"):
        load_text_encoder(path, tokenizer_dir=tiny_models["tokenizer"])
    path, _, _ = write_te(tmp_path, "qwen3vl_8b_int8_convrot.safetensors", "int8_convrot")
    rewrite(path, lambda t: t.pop("model.layers.2.mlp.up_proj.weight_scale"))
    with pytest.raises(CheckpointError, match=r"qwen3vl_8b_int8_convrot\.safetensors: the int8_tensorwise layer "
                                              r"model\.layers\.2\.mlp\.up_proj has no .*use qwen3vl_8b_int8_convrot"):
        load_text_encoder(path, tokenizer_dir=tiny_models["tokenizer"])


def test_an_interrupted_quantized_load_leaves_nothing_behind(tmp_path, monkeypatch):
    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", "int8_convrot")
    monkeypatch.setattr("safetensors.safe_open", gf.safe_open_failing_at(30, KeyboardInterrupt))
    before = gf.live_models()
    with pytest.raises(KeyboardInterrupt):
        load_dit(path)
    assert gf.live_models() == before


def test_dequantized_rows_match_comfy_kitchen_for_every_format():
    """`weight_rows` of a lone segment equals comfy-kitchen's dequantization of the whole tensor cut to the rows."""
    weight = torch.randn(48, 128) / 8
    for kind in ("int8_convrot", "int8", "float8_e4m3fn", "float8_e5m2", "w4a8", "w4a4", "nvfp4", "mxfp8"):
        roles, description, dense = quantize(kind, weight)
        fmt = description["format"]
        options = {"full_precision": False, "convrot": description.get("convrot", False),
                   "convrot_groupsize": description.get("convrot_groupsize", 256),
                   "group_size": description.get("group_size", 16), "quant_group_size": 64, "linear_dtype": "int4"}
        layer = kitchen_layers.QuantLinear(128, 48, torch.float32)
        layer.add_segment(fmt, roles, options)
        torch.testing.assert_close(layer.weight_rows(5, 29, torch.float32), dense[5:29], rtol=0, atol=1e-6)
        x = torch.randn(3, 128)
        expected = F.linear(x, dense[5:29])
        if kind != "w4a4":  # every other format is dequantized on a CPU
            torch.testing.assert_close(layer.rows(x, 5, 29), expected, rtol=0, atol=1e-5)
        if REL_BOUND.get(kind) is not None:
            layer.gemm = "kernel"
            assert_matches(layer.rows(x, 5, 29), expected, kind)


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp8"])
def test_block_scaled_rows_are_cut_at_whole_tiles_of_the_swizzled_scales(kind):
    """NVFP4 / MXFP8 block scales are stored in 128-row tiles: any row range (inside a tile, across tiles, the
    ragged last tile) equals comfy-kitchen's dequantization of the whole tensor cut to those rows, exactly."""
    weight = torch.randn(320, 96) / 8
    roles, description, dense = quantize(kind, weight)
    layer = kitchen_layers.QuantLinear(96, 320, torch.float32)
    layer.add_segment(description["format"], roles, {"full_precision": False})
    for start, end in ((0, 320), (5, 29), (100, 300), (128, 256), (250, 320), (256, 320), (127, 129)):
        torch.testing.assert_close(layer.weight_rows(start, end, torch.float32), dense[start:end], rtol=0, atol=0)
    x = torch.randn(4, 96)
    torch.testing.assert_close(layer.rows(x, 100, 300), F.linear(x, dense[100:300]), rtol=0, atol=1e-5)
    if kind == "nvfp4":  # AWQ-style smoothing: the inputs are multiplied by `pre_quant_scale` first
        smooth = torch.rand(96) + 0.5
        layer = kitchen_layers.QuantLinear(96, 320, torch.float32)
        layer.add_segment("nvfp4", {**roles, "pre_quant_scale": smooth}, {"full_precision": False})
        torch.testing.assert_close(layer.rows(x, 100, 300), F.linear(x * smooth, dense[100:300]), rtol=0, atol=1e-5)
        torch.testing.assert_close(layer.weight_rows(0, 320, torch.float32), dense * smooth, rtol=0, atol=0)


def test_byte_tables_equal_torch_conversions_pair_by_pair_and_byte_by_byte():
    """The dequantization tables (quant_tables.py) against torch's own fp8 conversion and the E2M1 code values, for an
    even number of bytes a row (looked up two at a time) and an odd one (one at a time)."""
    data = torch.arange(256, dtype=torch.uint8).repeat(3, 2)  # every byte, 512 a row
    for kind, fp8 in (("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        expected = data.view(fp8).float()
        table = quant_tables.byte_table(kind, torch.float32, "cpu")
        for cols in (512, 511):
            got = quant_tables.by_table(data[:, :cols], table)
            assert torch.equal(got.isnan(), expected[:, :cols].isnan())
            assert torch.equal(got.nan_to_num(), expected[:, :cols].nan_to_num())
    e2m1 = torch.tensor(quant_tables.E2M1)
    expected = torch.stack((e2m1[data.long() >> 4], e2m1[data.long() & 15]), dim=-1).view(3, -1)  # high nibble first
    for cols in (512, 511):
        got = quant_tables.by_table(data[:, :cols], quant_tables.byte_table("e2m1", torch.float32, "cpu"))
        assert torch.equal(got, expected[:, : 2 * cols])


def test_convrot_input_rotation_equals_the_published_hadamard_blocks():
    """`rotate_inputs` (two small Kronecker factors) against `x @ H` block by block, H the Kronecker power of H4 over
    sqrt(g); H orthonormal and symmetric (the quantizer and its inverse are the same transform)."""
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
    x = torch.randn(5, 3, 512, dtype=torch.float64)
    for group, power in ((4, 1), (16, 2), (64, 3), (256, 4)):
        h = torch.ones(1, 1, dtype=torch.float64)
        for _ in range(power):
            h = torch.kron(h, h4)
        h = h / group**0.5
        torch.testing.assert_close(h @ h, torch.eye(group, dtype=torch.float64))
        expected = (x.reshape(-1, group) @ h).reshape(x.shape)
        torch.testing.assert_close(quant_tables.rotate_inputs(x, group), expected, rtol=0, atol=1e-12)
