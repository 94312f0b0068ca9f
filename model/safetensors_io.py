"""Safe, lazy access to safetensors checkpoints, and telling what a checkpoint is before loading it.

Everything here reads only the header (8 bytes of length + JSON), so a wrong, truncated or foreign file is
refused before a single weight is allocated. Pickle-based checkpoints (`.ckpt`, `.pt`, `.bin`) are
recognised by their first bytes and never unpickled.
"""

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit; anything larger is not a safetensors header

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}


class CheckpointError(ValueError):
    """A checkpoint file or folder that cannot be loaded; the message names it and says what to do."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    file: Path


def _pickle_kind(first_bytes: bytes) -> str | None:
    if first_bytes.startswith(b"PK\x03\x04"):
        return "a PyTorch zip/pickle checkpoint (torch.save)"
    if first_bytes[:1] == b"\x80" and first_bytes[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle"
    if first_bytes.startswith(b"GGUF"):
        return "a GGUF file"
    return None


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Return `({name: TensorInfo}, metadata)` from a safetensors header, checking the file is complete."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found.")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        first = handle.read(8)
        kind = _pickle_kind(first)
        if kind is not None:
            raise CheckpointError(
                f"{path.name} is {kind}, not a safetensors file. This pack loads weights only from .safetensors "
                "(pickles can run code when loaded); use the .safetensors release of this model."
            )
        if len(first) < 8:
            raise CheckpointError(f"{path.name} is {size} bytes long: too short to be a safetensors file.")
        (header_len,) = struct.unpack("<Q", first)
        if header_len > MAX_HEADER_BYTES or header_len + 8 > size:
            raise CheckpointError(
                f"{path.name} is not a valid safetensors file (header length {header_len} for a {size}-byte file); "
                "it may be truncated or another format. Re-download it."
            )
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{path.name}: the safetensors header is not valid JSON ({error}); re-download it.")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: the safetensors header is not a JSON object; re-download it.")
    metadata = header.pop("__metadata__", None) or {}
    tensors, data_end = {}, 0
    for name, entry in header.items():
        try:
            dtype, shape, (_, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: malformed header entry for {name!r}; re-download the file.")
        tensors[name] = TensorInfo(dtype, shape, path)
        data_end = max(data_end, end)
    expected = 8 + header_len + data_end
    if size < expected:
        raise CheckpointError(
            f"{path.name} is truncated: its header describes {expected:,} bytes but the file has {size:,} "
            f"({100 * size / expected:.1f}%). The download was probably interrupted; download it again."
        )
    return tensors, metadata


def read_sharded_index(index_path: Path) -> list[Path]:
    """Shard files named by a `*.safetensors.index.json`, each checked to exist."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, KeyError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{index_path}: unreadable shard index ({error}).")
    shards = sorted({index_path.parent / name for name in weight_map.values()})
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise CheckpointError(
            f"{index_path.parent}: {len(missing)} of {len(shards)} shards listed in {index_path.name} are missing "
            f"({', '.join(missing)}). Finish the download of this folder."
        )
    return shards


def read_headers(files: list[Path]) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Merged header of several shards (all checked before anything is loaded)."""
    tensors, metadata = {}, {}
    for file in files:
        part, meta = read_header(file)
        tensors.update(part)
        metadata.update(meta)
    return tensors, metadata


# -- what is this file? -------------------------------------------------------------------------------------
def _has(keys, *needles) -> bool:
    return any(any(needle in key for needle in needles) for key in keys)


def identify_checkpoint(keys) -> str:
    """A short description of what a state dict holds, for error messages ("a Qwen-Image 1.x DiT", ...)."""
    keys = list(keys)
    if _has(keys, "txt_in.text_norm.weight") and _has(keys, "modulation.1.weight"):
        return "a Qwen-Image 2.1 DiT (transformer)"
    if _has(keys, "txt_norm.weight", "img_mod.1.weight", "add_q_proj"):
        return "a Qwen-Image 1.x DiT (60 double-stream blocks), not Qwen-Image 2.1"
    if _has(keys, "deepstack_merger_list", "visual.blocks.", "language_model.", "self_attn.q_proj", "embed_tokens"):
        return "a text encoder (Qwen-VL language model)"
    if _has(keys, "decoder.", "encoder.conv1", "encoder.conv_in", "quant_conv", "post_quant_conv"):
        return "a VAE"
    if _has(keys, "double_blocks.", "single_blocks."):
        return "a Flux-style DiT"
    if _has(keys, "model.diffusion_model.input_blocks", "input_blocks.", "down_blocks."):
        return "a Stable Diffusion UNet"
    if _has(keys, "lora_", ".lora.", "lora_A", "lora_down"):
        return "a LoRA"
    sample = ", ".join(sorted(keys)[:4])
    return f"an unrecognised checkpoint ({len(keys)} tensors, e.g. {sample})"


QUANTIZED_MARKERS = ("weight_scale", "comfy_quant", "scale_weight", "scaled_fp8", "input_scale")


def quantization_marker(keys, metadata: dict) -> str | None:
    """Name of the first quantization marker found (ComfyUI per-layer quantization), else None."""
    if "_quantization_metadata" in metadata:
        return "_quantization_metadata"
    for key in keys:
        for marker in QUANTIZED_MARKERS:
            if key.endswith(marker):
                return key
    return None
