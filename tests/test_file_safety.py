"""What a loaded model must not depend on, and what a damaged file must not slip past.

1. A loaded model owns its memory: no parameter is a view of the safetensors file's memory map, so replacing or
   truncating the file while ComfyUI runs cannot change the weights (or kill the process with SIGBUS). The
   test rewrites the file in place with other bytes of the same size (a truncation would kill pytest itself)
   and checks no parameter changed, and that none lies inside a mapping of the file.
2. Every stored dtype is checked against what that tensor may be: integer data relabelled in the header is
   refused by file, tensor and dtype instead of decoding to a black image.
3. Every header problem safetensors' own reader would report as a bare `SafetensorError` (or worse, a
   `RecursionError`) is a CheckpointError naming the file, what is wrong and what to do.
"""

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qi21.model.loaders.checkpoint import CheckpointError
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.safetensors_io import read_header
from qi21.model.loaders.text_encoder import load_text_encoder
from qi21.model.loaders.vae import load_vae


@pytest.fixture(scope="module")
def models(tiny_models):
    """The shared tiny set (conftest.py); never written to here: tests that break a file break a copy."""
    return tiny_models


def _load(kind, path, models, **kwargs):
    if kind == "text_encoder":
        return load_text_encoder(path, fallback_tokenizer_dir=models["tokenizer"], **kwargs).model
    return {"dit": load_dit, "vae": load_vae}[kind](path, **kwargs)


def _split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _join(path: Path, header: dict, payload: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)
    return path


# -- 1. a loaded model owns its memory ---------------------------------------------------------------------------
def _file_mappings(path: Path) -> list[tuple[int, int]]:
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].removesuffix(" (deleted)") == str(path):
            begin, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((begin, end))
    return spans


# (component, its single file in the tiny set, a weight_dtype that needs no conversion of that file)
NO_CONVERSION = [("dit", "dit", "default"), ("vae", "vae", "default"), ("vae", "vae", "bf16"),
                 ("text_encoder", "text_encoder", "default"), ("text_encoder", "text_encoder", "bf16")]


@pytest.mark.parametrize("kind, name, weight_dtype", NO_CONVERSION)
def test_a_loaded_model_does_not_live_on_the_file(models, tmp_path, kind, name, weight_dtype):
    path = tmp_path / models[name].name
    shutil.copy(models[name], path)
    model = _load(kind, path, models, weight_dtype=weight_dtype)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}  # the tiny files are bf16: nothing converted
    if Path("/proc/self/maps").is_file():
        spans = _file_mappings(path)
        inside = [n for n, p in params.items() if any(b <= p.data_ptr() < e for b, e in spans)]
        assert inside == [], f"parameters still in the file's memory map: {inside[:3]}"
    before = {n: p.detach().clone() for n, p in params.items()}
    header, payload = _split(path)
    with open(path, "r+b") as handle:  # same inode, same size: a live mapping would show the new bytes
        handle.seek(path.stat().st_size - len(payload))
        handle.write(bytes(b ^ 0x5A for b in payload))
    changed = [n for n, p in params.items()
               if not torch.equal(p.detach().view(torch.int16), before[n].view(torch.int16))]  # bitwise
    assert changed == [], f"rewriting the file changed the loaded weights: {changed[:3]}"


# -- 2. stored dtypes -------------------------------------------------------------------------------------------
def _relabel(source: Path, target: Path, keys, new_dtype: str) -> Path:
    """The same bytes, with the header claiming `new_dtype` (same element size) for `keys`."""
    header, payload = _split(source)
    for key in keys:
        header[key]["dtype"] = new_dtype
    return _join(target, header, payload)


def test_integer_data_in_a_vae_is_refused_not_decoded_black(models, tmp_path):
    """The diffusers VAE is fp32; relabelled as I32 it used to load (ints cast to floats) and decode black."""
    source = models["diffusers_base"] / "vae" / "diffusion_pytorch_model.safetensors"
    header, _ = _split(source)
    path = _relabel(source, tmp_path / "qwen_image_2.1_vae_bf16.safetensors",
                    [k for k in header if k != "__metadata__"], "I32")
    with pytest.raises(CheckpointError) as error:
        load_vae(path)
    message = str(error.value)
    for fragment in (path.name, "are stored in a dtype a weight of theirs cannot have", "is I32 (expected BF16 or F16 "
                     "or F32)", "download it again"):
        assert fragment in message, message
    assert re.search(r"(decoder|encoder|quant_conv|post_quant_conv)\.\S+ in qwen_image_2\.1_vae_bf16\.safetensors "
                     r"is I32", message)


@pytest.mark.parametrize("kind, name, key", [
    ("dit", "dit", "transformer_blocks.0.attn.to_q.weight"),
    ("dit", "dit", "txt_in.text_norm.weight"),
    ("vae", "vae", "decoder.head.2.weight"),
    ("text_encoder", "text_encoder", "model.layers.0.mlp.down_proj.weight"),
])
def test_every_loader_refuses_a_weight_stored_as_integers(models, tmp_path, kind, name, key):
    header, _ = _split(models[name])
    key = next(k for k in header if k.endswith(key))  # with the file's own prefix, if any
    path = _relabel(models[name], tmp_path / models[name].name, [key], "I16")  # bf16 -> int16: same size
    name, tail = re.escape(path.name), re.escape(key.split(".", 1)[1])
    with pytest.raises(CheckpointError, match=rf"{name}: 1 .* tensors .*{tail} in {name} is I16 \(expected BF16 or "
                                              r"F16 or F32"):
        _load(kind, path, models, weight_dtype="fp32")


def test_fp8_is_accepted_only_where_the_dit_may_have_it(models, tmp_path):
    state = load_file(models["dit"])
    gemm = next(k for k in state if k.endswith("transformer_blocks.0.attn.to_q.weight"))
    norm = next(k for k in state if k.endswith("transformer_blocks.0.attn.norm_q.weight"))
    fp8 = dict(state, **{gemm: state[gemm].to(torch.float8_e4m3fn)})
    save_file(fp8, tmp_path / "qwen_image_2.1_fp8_e4m3fn.safetensors")
    model = load_dit(tmp_path / "qwen_image_2.1_fp8_e4m3fn.safetensors", weight_dtype="fp32")
    assert torch.equal(model.blocks[0].qkv.weight[: state[gemm].shape[0]], state[gemm].to(torch.float8_e4m3fn).float())
    save_file(dict(fp8, **{norm: state[norm].to(torch.float8_e4m3fn)}), tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match=r"norm_q\.weight in bad\.safetensors is F8_E4M3 \(expected BF16 or "
                                              r"F16 or F32\)"):
        load_dit(tmp_path / "bad.safetensors")


# -- 3. header errors name the file ------------------------------------------------------------------------------
def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _nested_header(path: Path, depth: int) -> Path:
    raw = b'{"a": ' + b"[" * depth + b"]" * depth + b"}"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


BAD_HEADERS = {
    # name: (header, payload bytes, what the message must say)
    "reversed offsets": ({"w": _entry(shape=(0,), offsets=(8, 0))}, 8, r"'w' has reversed data offsets \[8, 0\]"),
    "offset past the end": ({"w": _entry(shape=(4,), offsets=(0, 16))}, 8, r"is truncated: .*download it again"),
    "size does not match the shape": ({"w": _entry(shape=(3,))}, 8, r"'w' is F32 of shape \[3\], 12 bytes, but its "
                                                                      r"data offsets span 8 bytes"),
    "gap": ({"w": _entry(shape=(1,), offsets=(4, 8))}, 8, r"'w' \(offsets \[4, 8\]\) leaves a gap of 4 bytes"),
    "overlap": ({"v": _entry(), "w": _entry()}, 8, r"'w' \(offsets \[0, 8\]\) overlaps the tensor before it"),
    "bytes after the data": ({"w": _entry()}, 12, r"4 bytes follow the last tensor"),
    "unknown dtype": ({"w": _entry(dtype="Q7", shape=(8,))}, 8, r"'w' has dtype 'Q7', which safetensors does not "
                                                                 r"define"),
    "negative shape": ({"w": _entry(shape=(-2,))}, 8, r"malformed header entry for tensor 'w'"),
    "metadata not strings": ({"__metadata__": {"a": 1}, "w": _entry()}, 8, r"__metadata__ is not a map of strings"),
}


@pytest.mark.parametrize("problem", BAD_HEADERS)
def test_header_problems_are_named_with_the_file(tmp_path, problem):
    from safetensors import safe_open

    header, payload, says = BAD_HEADERS[problem]
    path = _join(tmp_path / "model.safetensors", header, bytes(payload))
    with pytest.raises(CheckpointError, match=says) as error:
        read_header(path)
    assert str(error.value).startswith("model.safetensors")
    with pytest.raises(Exception):  # noqa: B017 - safetensors refuses the same file too (naming no file)
        safe_open(str(path), framework="pt").get_tensor("w")


def test_a_deeply_nested_header_is_refused_before_parsing(tmp_path):
    path = _nested_header(tmp_path / "deep.safetensors", 100_000)
    with pytest.raises(CheckpointError, match=r"deep\.safetensors: the safetensors header nests deeper than 4 levels"):
        read_header(path)


def test_a_file_that_does_not_start_with_a_header_length_is_not_a_safetensors_file(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_bytes(b"hello world, this is text and not weights\n")
    with pytest.raises(CheckpointError) as error:
        read_header(path)
    message = str(error.value)
    assert message.startswith("notes.safetensors is not a safetensors file") and "download it again" in message
    length = struct.unpack("<Q", b"hello wo")[0]
    assert f"{length}" not in message and f"{length:,}" not in message  # no meaningless number
    huge = tmp_path / "huge.safetensors"  # a plausible length, larger than the file
    huge.write_bytes(struct.pack("<Q", 4096) + b"{}")
    with pytest.raises(CheckpointError, match=r"huge\.safetensors is not a safetensors file"):
        read_header(huge)


@pytest.mark.parametrize("kind", ["dit", "vae", "text_encoder"])
def test_every_loader_reports_a_bad_header_by_file_name(models, tmp_path, kind):
    reversed_offsets = _join(tmp_path / "broken.safetensors", {"w": _entry(shape=(0,), offsets=(8, 0))}, bytes(8))
    with pytest.raises(CheckpointError, match=r"broken\.safetensors: tensor 'w' has reversed data offsets"):
        _load(kind, reversed_offsets, models)
    deep = _nested_header(tmp_path / "deep.safetensors", 100_000)
    with pytest.raises(CheckpointError, match=r"deep\.safetensors: .*nests deeper"):
        _load(kind, deep, models)
