"""The new features' inputs tried by a hostile client and a broken disk (issue "Reliability III").

Eighty hostile inputs against LoRA files, GGUF and quantized DiTs, SIGMAS, denoise and the node inputs found six
causes, one group of tests each:
1. a rank-0 LoRA pair with an alpha crashed with a raw ZeroDivisionError (alpha / rank);
2. NaN/inf inside weights (a LoRA matrix, an alpha that overflows the product, an fp8 `weight_scale`, a GGUF Q8_0
   block scale) was never checked at load: the run stopped at step 1 blaming fp16 on an fp32 model;
3. the GGUF tensor layout was trusted (overlapping offsets loaded and ran with a wrong result), a 3-D or 5-D
   `img_in.weight` failed to unpack in every DiT format, and a 16 MiB `general.architecture` was copied whole
   into the error;
4. GGUF metadata was parsed without limits: a 170-byte file declaring 2^40 array elements, or a valid 10 MB file
   with a 10M-element array, hung the server past 3 GiB;
5. denoise = 1e-9 asked for a 320 GB schedule;
6. an input the node does not have gave `TypeError: execute() got an unexpected keyword argument`.
"""

import math
import re
import shutil
import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import graph_fixtures as gf
from qi21.demo import tiny_checkpoints as tiny
from qi21.model.features.lora import apply_lora
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.lora import MAX_DELTA, LoraError, read_lora
from qi21.model.loaders.safetensors_io import SHOWN_CHARS, CheckpointError
from qi21.model.sampling.img2img import MAX_SCHEDULE_STEPS, denoise_tail, smallest_denoise
from qi21.model.sampling.loop import loaded_weights
from qi21.model.sampling.schedule import base_sigmas
from qi21.nodes import NODES
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler
from qi21.nodes.schedule import QI21Sigmas
from test_gguf import encode, write_gguf

Q = gguf.GGMLQuantizationType
NAN_F16 = np.array([np.nan], np.float16).view(np.uint8)


def refused(path, match, **kwargs) -> str:
    """`load_dit(path)` refuses with `match`, naming the file, leaving no model behind once the error is handled
    (ComfyUI formats it and drops it; its traceback's frames hold the half-built model until then); the message."""
    before = gf.live_models()
    with pytest.raises(CheckpointError, match=match) as info:
        load_dit(path, **kwargs)
    message = str(info.value)
    del info
    assert path.name in message and gf.live_models() == before
    return message


def dit_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny DiT under ComfyUI's keys, fp32 numpy (what the GGUF converters start from)."""
    state = tiny.comfy_dit_state_dict(tiny.dit_state_dict(tiny.TINY_DIT, seed))
    return {key: value.float().numpy() for key, value in state.items()}


def q8_gguf(path, arrays=None, **kwargs):
    return write_gguf(path, dit_arrays() if arrays is None else arrays, lambda key: "Q8_0", **kwargs)


# -- 1. rank 0 ------------------------------------------------------------------------------------------------------
def kohya_pair(module: str, down: torch.Tensor, up: torch.Tensor, alpha=None) -> dict:
    stem = "lora_unet_" + module.replace(".", "_")
    out = {stem + ".lora_down.weight": down, stem + ".lora_up.weight": up}
    if alpha is not None:
        out[stem + ".alpha"] = torch.tensor(float(alpha))
    return out


def test_a_rank_0_pair_is_refused_by_name(tmp_path):
    width = tiny.TINY_DIT.width
    path = tmp_path / "rank0.safetensors"
    save_file(kohya_pair("transformer_blocks.0.attn.to_q", torch.zeros(0, width), torch.zeros(width, 0), 8.0),
              str(path))
    with pytest.raises(LoraError, match=r"rank0.safetensors .*transformer_blocks.0.attn.to_q: .* rank 0"):
        read_lora(path, tiny.TINY_DIT)


# -- 2. non-finite weights --------------------------------------------------------------------------------------------
def small_pair(seed=0, rank=4):
    generator = torch.Generator().manual_seed(seed)
    width = tiny.TINY_DIT.width
    return (torch.randn(rank, width, generator=generator) / 8, torch.randn(width, rank, generator=generator) / 8)


@pytest.mark.parametrize("poison, alpha, match", [
    pytest.param("nan", None, r"lora_down.weight holds NaN or infinite values", id="NaN in down"),
    pytest.param("inf", 4.0, r"lora_up.weight holds NaN or infinite values", id="inf in up"),
    pytest.param(None, 1e30, r"scaled product .* reaches \d\.\d+e\+28, beyond 10000", id="alpha 1e30"),
])
def test_lora_matrices_and_their_scaled_product_are_checked_when_read(tmp_path, poison, alpha, match):
    down, up = small_pair()
    if poison == "nan":
        down[1, 2] = float("nan")
    elif poison == "inf":
        up[3, 0] = float("inf")
    path = tmp_path / "damaged_lora.safetensors"
    save_file(kohya_pair("transformer_blocks.1.attn.to_out.0", down, up, alpha), str(path))
    with pytest.raises(LoraError, match=match) as info:
        read_lora(path, tiny.TINY_DIT)
    assert "damaged_lora.safetensors" in str(info.value)


def test_a_strong_but_sane_lora_passes_the_product_check(tmp_path, tiny_models):
    """The bound is checked exactly before refusing: a large alpha whose product stays below MAX_DELTA loads."""
    down, up = small_pair(rank=8)
    alpha = 8 * 0.5 * MAX_DELTA / float((up @ down).abs().max())  # the exact product peaks at half the limit
    path = tmp_path / "strong.safetensors"
    save_file(kohya_pair("transformer_blocks.0.attn.to_v", down, up, alpha), str(path))
    (pair,) = read_lora(path, tiny.TINY_DIT).pairs
    assert math.isclose(pair.scale, alpha / 8, rel_tol=1e-6)
    assert read_lora(tiny_models["lora"], tiny.TINY_DIT).pairs  # the demo LoRA is far from any limit


def fp8_file(tmp_path, change):
    from test_quantized import write_dit

    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_fp8_scaled.safetensors", "float8_e4m3fn")
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_a_nan_fp8_weight_scale_or_weight_is_refused_by_key(tmp_path):
    key = "transformer_blocks.1.attn.to_k.weight_scale"
    path = fp8_file(tmp_path, lambda t: t.__setitem__(key, torch.full_like(t[key], float("nan"))))
    refused(path, rf"{key} \(float8_e4m3fn weight_scale\) holds NaN or infinite values")

    def nan_weight(tensors):
        weight = tensors["transformer_blocks.0.img_mlp.out.weight"]
        weight.view(torch.uint8)[3, 5] = 0x7F  # e4m3fn's NaN
    path = fp8_file(tmp_path, nan_weight)
    refused(path, r"transformer_blocks.0.img_mlp.out.weight \(float8_e4m3fn weight\) holds NaN")


def poke(path, tensor_name: str, at: int, data: bytes):
    """Write `data` at byte `at` of a GGUF tensor's data."""
    reader = gguf.GGUFReader(path)
    (tensor,) = [t for t in reader.tensors if t.name == tensor_name]
    start = int(tensor.data_offset)
    del tensor, reader
    with open(path, "r+b") as handle:
        handle.seek(start + at)
        handle.write(data)


@pytest.mark.parametrize("tensor, at, data, match", [
    pytest.param("transformer_blocks.0.attn.to_q.weight", 34 * 5, NAN_F16.tobytes(),
                 r"transformer_blocks.0.attn.to_q.weight \(its Q8_0 block scales\) holds NaN", id="Q8_0 d"),
    pytest.param("txt_in.in_layer.weight", 6, np.array([np.inf], np.float16).tobytes(),
                 r"txt_in.in_layer.weight holds NaN", id="F16 weight"),
    pytest.param("transformer_blocks.1.attn.norm_k.weight", 8, np.array([np.nan], np.float32).tobytes(),
                 r"transformer_blocks.1.attn.norm_k.weight holds NaN", id="F32 norm"),
])
def test_gguf_block_scales_and_float_tensors_are_checked_when_read(tmp_path, tensor, at, data, match):
    path = q8_gguf(tmp_path / "qwen_image_2.1-Q8_0.gguf")
    load_dit(path)  # the clean file loads
    poke(path, tensor, at, data)
    refused(path, match)


def test_the_nan_message_names_what_is_loaded_instead_of_guessing_fp16(tmp_path, tiny_models):
    plain = load_dit(tiny_models["dit"], "fp32")
    what, advice = loaded_weights(plain)
    assert what == f"{tiny.DIT_FILE} (float32 compute)" and "download the model file again" in advice
    assert "fp16" not in advice
    what, advice = loaded_weights(load_dit(tiny_models["dit"], "fp16"))
    assert "(float16 compute)" in what and "weight_dtype bf16 or fp32" in advice
    with_lora = apply_lora(plain, tiny_models["lora"], 1.5)
    what, advice = loaded_weights(with_lora)
    assert f"with LoRA {tiny.SPEED_LORA_FILE} at strength 1.5" in what and "without the LoRA" in advice
    what, advice = loaded_weights(load_dit(q8_gguf(tmp_path / "qwen_image_2.1-Q8_0.gguf")))
    assert "(GGUF F16, Q8_0, bfloat16 compute)" in what and "try the bf16 file" in advice


# -- 3. GGUF layout, ranks, file text in messages ------------------------------------------------------------------
def tensor_info_offset_at(path, name: str) -> tuple[int, int]:
    """(file position of tensor `name`'s offset field, its offset) in the tensor table."""
    reader = gguf.GGUFReader(path)
    (tensor,) = [t for t in reader.tensors if t.name == name]
    field = tensor.field
    position = field.offset + sum(int(part.nbytes) for part in field.parts[:5])
    value = int(field.parts[5][0])
    del tensor, field, reader
    return position, value


def set_offset(path, name: str, offset: int) -> None:
    position, _ = tensor_info_offset_at(path, name)
    with open(path, "r+b") as handle:
        handle.seek(position)
        handle.write(struct.pack("<Q", offset))


def test_gguf_tensors_must_be_disjoint_in_order_and_aligned(tmp_path):
    path = q8_gguf(tmp_path / "qwen_image_2.1-Q8_0.gguf")
    _, to_q = tensor_info_offset_at(path, "transformer_blocks.0.attn.to_q.weight")
    set_offset(path, "transformer_blocks.0.attn.to_k.weight", to_q)  # to_k reads to_q's bytes
    refused(path, r"tensor 'transformer_blocks.0.attn.to_k.weight' \(data offset [\d,]+\) overlaps "
                  r"'transformer_blocks.0.attn.to_q.weight'")
    path = q8_gguf(tmp_path / "qwen_image_2.1-Q8_0.gguf")
    _, to_v = tensor_info_offset_at(path, "transformer_blocks.0.attn.to_v.weight")
    set_offset(path, "transformer_blocks.0.attn.to_v.weight", to_v + 2)
    refused(path, r"'transformer_blocks.0.attn.to_v.weight' starts at data offset [\d,]+, not a multiple of the "
                  r"file's alignment \(32\)")
    path = tmp_path / "qwen_image_2.1-aligned-Q8_0.gguf"  # another alignment, as the format allows
    writer = gguf.GGUFWriter(path, arch="qwen_image")
    writer.add_custom_alignment(256)
    for key, array in dit_arrays().items():
        data, qtype = encode(array, "Q8_0", np.random.default_rng(0))
        writer.add_tensor(key, data, raw_dtype=Q[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_dit(path).source.layout == "gguf"
    name = "transformer_blocks.0.attn.to_v.weight"
    set_offset(path, name, tensor_info_offset_at(path, name)[1] + 32)
    refused(path, r"not a multiple of the file's alignment \(256\)")


def write_with_img_in(tmp_path, fmt: str, shape):
    """A DiT in `fmt` whose img_in.weight has `shape` (its elements kept, so only the rank is wrong)."""
    arrays = dit_arrays()
    arrays["img_in.weight"] = arrays["img_in.weight"].reshape(shape)
    if fmt == "gguf":
        path = tmp_path / "qwen_image_2.1-F16.gguf"
        writer = gguf.GGUFWriter(path, arch="qwen_image")
        for key, array in arrays.items():
            data, qtype = encode(array, "F16" if array.ndim > 1 else "F32", np.random.default_rng(0))
            writer.add_tensor(key, data, raw_dtype=Q[qtype])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path
    if fmt == "quantized":
        from test_quantized import BLOCK_LINEAR, quantized_files

        state = {key: torch.from_numpy(value) for key, value in arrays.items()}
        out, metadata, _ = quantized_files(state, "int8", BLOCK_LINEAR.fullmatch)
        path = tmp_path / "qwen_image_2.1_int8.safetensors"
        save_file(out, str(path), metadata=metadata)
        return path
    path = tmp_path / "qwen_image_2.1_bf16.safetensors"
    save_file({key: torch.from_numpy(value).bfloat16() for key, value in arrays.items()}, str(path))
    return path


@pytest.mark.parametrize("fmt, shape", [("safetensors", (64, 2, 2, 4, 4)), ("safetensors", (64 * 64,)),
                                        ("quantized", (64, 4, 16)), ("gguf", (64, 4, 16)), ("gguf", (64, 2, 2, 4, 4))],
                         ids=["safetensors 5-D", "safetensors 1-D", "quantized 3-D", "gguf 3-D", "gguf 5-D"])
def test_every_tensors_rank_is_checked_before_its_shape_is_unpacked(tmp_path, fmt, shape):
    path = write_with_img_in(tmp_path, fmt, shape)
    if fmt == "gguf" and len(shape) > 4:
        refused(path, r"'img_in.weight' has 5 dimensions; GGUF tensors have at most 4")
    else:
        refused(path, rf"'img_in.weight' has {len(shape)} dimensions .*; in a Qwen-Image 2.1 DiT it has 2")


def test_the_diffusers_layout_checks_ranks_too(tmp_path, tiny_models):
    folder = tmp_path / "Qwen-Image-2.1"
    shutil.copytree(tiny_models["diffusers_base"], folder)
    for shard in (folder / "transformer").glob("*.safetensors"):
        tensors = load_file(str(shard))
        if "proj_out.weight" in tensors:
            tensors["proj_out.weight"] = tensors["proj_out.weight"][:, :, None]
            save_file(tensors, str(shard))
    refused(folder, r"'proj_out.weight' has 3 dimensions")


def test_text_from_a_file_is_cut_in_every_message(tmp_path):
    long_arch = "x" * (1 << 20)
    path = q8_gguf(tmp_path / "qwen_image_2.1-Q8_0.gguf", arrays={"some.weight": np.ones((64, 64), np.float32)},
                   arch=long_arch)
    message = refused(path, r"general.architecture = 'x{120}'\.\.\. \(1,048,576 characters\)")
    assert len(message) < 1000
    long_key = "k" * (1 << 20) + ".weight"
    path = tmp_path / "qwen_image_2.1_bf16.safetensors"
    save_file({long_key: torch.zeros(2), "img_in.weight": torch.zeros(2, 2)}, str(path))
    assert len(refused(path, r"\(1,048,583 characters\)")) < 1000
    arrays = dit_arrays()
    arrays["k" * 60_000 + ".weight"] = np.ones(4, np.float32)  # GGUF names stop at 65,535 bytes
    path = q8_gguf(tmp_path / "extra-Q8_0.gguf", arrays=arrays)
    assert len(refused(path, r"tensors that a Qwen-Image 2.1 DiT does not have")) < 1000
    assert SHOWN_CHARS <= 120


# -- 4. GGUF metadata bombs --------------------------------------------------------------------------------------
def header(tensor_count: int, kv_count: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count)


def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def array_entry(key: bytes, count: int, item_type: int = 0) -> bytes:
    return gguf_string(key) + struct.pack("<IIQ", 9, item_type, count)


def bounded_load(path, match):
    """The refusal within a second and with a few MiB of Python allocations at most: (seconds, peak bytes)."""
    refused(path, match)  # the message, and nothing left behind
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(CheckpointError):
            load_dit(path)
    finally:
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert seconds < 1.0 and peak < 16 << 20, (seconds, peak)
    return seconds, peak


@pytest.mark.parametrize("body, match", [
    pytest.param(header(0, 1) + array_entry(b"general.bomb", 1 << 40), r"declares 1,099,511,627,776 elements",
                 id="170 bytes, 2^40 elements"),
    pytest.param(header(0, 1) + array_entry(b"tokens", 1 << 30, 8), r"declares 1,073,741,824 elements of STRING",
                 id="2^30 strings"),
    pytest.param(header(0, 1 << 50), r"declares [\d,]+ metadata entries", id="2^50 entries"),
    pytest.param(header(1 << 40, 0), r"declares [\d,]+ tensors", id="2^40 tensors"),
    pytest.param(header(0, 1) + gguf_string(b"general.name") + struct.pack("<IQ", 8, 1 << 62),
                 r"needs 4,611,686,018,427,387,904 bytes at offset 56, but only 114 are left", id="2^62-byte string"),
    pytest.param(header(0, 1) + array_entry(b"nested", 1, 9) + struct.pack("<IQ", 0, 1),
                 r"array of arrays", id="nested arrays"),
])
def test_metadata_that_cannot_fit_the_file_is_refused_at_once(tmp_path, body, match):
    path = tmp_path / "bomb.gguf"
    path.write_bytes(body.ljust(170, b"\0"))
    bounded_load(path, match)


def test_a_valid_file_with_a_10m_element_array_is_refused_within_a_second(tmp_path):
    path = tmp_path / "qwen_image_2.1-Q8_0.gguf"
    count = 10_000_000
    with open(path, "wb") as handle:
        handle.write(header(0, 2) + gguf_string(b"general.architecture") + struct.pack("<I", 8)
                     + gguf_string(b"qwen_image") + array_entry(b"general.padding", count))
        handle.write(bytes(count))
    assert path.stat().st_size > count
    bounded_load(path, r"'general.padding' is an array of 10,000,000 elements; .* reads at most 65,536")


def test_a_language_model_vocabulary_is_still_named_as_such(tmp_path):
    path = tmp_path / "Qwen3-8B-Q4_K_M.gguf"
    entries = [gguf_string(b"general.architecture") + struct.pack("<I", 8) + gguf_string(b"qwen3"),
               array_entry(b"tokenizer.ggml.tokens", 150_000, 8) + gguf_string(b"a") * 150_000]
    path.write_bytes(header(0, len(entries)) + b"".join(entries))
    refused(path, r"language model GGUF \(general.architecture = 'qwen3'")


# -- 5. tiny denoise ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [1, 40, 200])
def test_a_tiny_denoise_is_refused_before_any_schedule_is_built(steps):
    built = []

    def full_schedule(n):
        built.append(n)
        return base_sigmas(n, 1024, 1024)

    for denoise in (1e-9, 5e-324, smallest_denoise(steps) * 0.99):
        with pytest.raises(ValueError, match=rf"the smallest denoise for {steps} steps is {smallest_denoise(steps):g}"):
            denoise_tail(full_schedule, steps, denoise)
    assert built == []
    tail = denoise_tail(full_schedule, steps, smallest_denoise(steps))  # the bound itself runs, distinct in fp32
    assert len(built) == 1 and MAX_SCHEDULE_STEPS - 1 <= built[0] <= MAX_SCHEDULE_STEPS  # float rounding of n
    assert tail.numel() == steps + 1 and bool((tail[1:] < tail[:-1]).all())


def test_the_nodes_name_the_smallest_denoise_when_validating():
    problem = QI21Sigmas.validate_inputs(schedule="base", steps=40, width=0, height=0, denoise=1e-9)
    assert "smallest denoise for 40 steps is 4e-05" in problem
    assert QI21Sigmas.validate_inputs(schedule="turbo", steps=40, width=0, height=0, denoise=1e-9) is True
    assert "smallest denoise" in QI21Sampler.validate_inputs(steps=1, cfg=1.0, denoise=1e-9)
    assert QI21Sampler.validate_inputs(steps=1, cfg=1.0, denoise=1e-9, sigmas=None) is True  # linked sigmas rule
    assert QI21TurboSampler.validate_inputs(denoise=1e-9) is True  # the stored grid's tail: one step


# -- 6. inputs the node does not have ----------------------------------------------------------------------------
@pytest.mark.parametrize("node", NODES, ids=lambda n: n.__name__)
def test_an_unknown_linked_input_is_named_when_validating_and_when_running(node):
    schema = node.define_schema()
    message = rf"{schema.display_name} \({schema.node_id}\) has no input 'guider'; its inputs are"
    if "validate_inputs" in vars(node):  # ComfyUI hands a linked unknown input to the validator as None
        inputs = {spec.id: None for spec in schema.inputs}
        problem = node.validate_inputs(**inputs, guider=None)
        assert problem is not True and re.search(message, problem), problem
    with pytest.raises(ValueError, match=message):
        node.execute(**{spec.id: None for spec in schema.inputs if not spec.optional}, guider=object())
