"""Reading and checking one safetensors file's header: the format level that `checkpoint.py` builds on.

Everything here reads only the header (8 bytes of length + JSON), so a wrong, truncated or foreign file is
refused before a single weight is allocated. The header is checked as completely as safetensors' own reader
checks it (offsets, sizes, coverage of the data), because that reader would otherwise fail later with a bare
`SafetensorError` that names no file; here every problem names the file, what is wrong and what to do.
Pickle-based checkpoints (`.ckpt`, `.pt`, `.bin`) are recognised by their first bytes and never unpickled; GGUF
files are named as such (the DiT loader reads them through `gguf.py`, before this module is reached).
"""

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit; anything larger is not a safetensors header
# A header is an object of tensor entries (objects holding short lists) plus a flat metadata object: 3 levels.
# Nesting is bounded before parsing, so a hostile header cannot drive the JSON parser into a RecursionError.
MAX_HEADER_DEPTH = 4

# Bits per element of every dtype safetensors defines (F4 and F6 pack several elements per byte).
DTYPE_BITS = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F6_E2M3": 6,
    "F6_E3M2": 6, "F4": 4, "C64": 64, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U64": 64, "U32": 32, "U16": 16,
    "U8": 8, "BOOL": 8,
}
#: The advice every damaged-file error ends with (safetensors and GGUF readers).
REDOWNLOAD = "The file is damaged or was written by a broken tool; download it again."
#: The most characters of any text taken from a file (a key, a metadata string) that a message quotes: a hostile
#: file's 16 MiB name would otherwise be copied whole into the error, the log and ComfyUI's /history.
SHOWN_CHARS = 120
#: The longest tensor name read (real ones are under 100 characters: `model.diffusion_model.transformer_blocks.59.
#: attn.to_out.0.weight_scale`), so every message that lists a few keys stays short.
MAX_KEY_CHARS = 1024


def shown(text, limit: int = SHOWN_CHARS) -> str:
    """`repr(text)` for a message, cut to about `limit` characters (the cut says how long the text was)."""
    text = str(text)
    if len(text) <= limit:
        return repr(text)
    return repr(text[:limit]) + f"... ({len(text):,} characters)"


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
    return None


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]")
_INNERMOST_PAIR = re.compile(rb"\{\}|\[\]")


def _too_deep(raw: bytes, max_depth: int) -> bool:
    """Whether the JSON text nests deeper than `max_depth`, found without recursion: strings are blanked, and
    innermost bracket pairs are removed once per level (each pass runs in the regex engine, not in Python)."""
    brackets = _NOT_BRACKET.sub(b"", _JSON_STRING.sub(b"", raw))
    for _ in range(max_depth):
        brackets, removed = _INNERMOST_PAIR.subn(b"", brackets)
        if not brackets or not removed:
            return False  # fully unwound, or unbalanced (the parser then reports it)
    return bool(brackets)


def parse_json_object(raw: bytes, where: str, what: str, max_depth: int) -> dict:
    """`raw` parsed as a JSON object, nesting bounded before parsing; any problem is a CheckpointError."""
    if _too_deep(raw, max_depth):
        raise CheckpointError(f"{where}: the {what} nests deeper than {max_depth} levels, which no valid one does. "
                              f"{REDOWNLOAD}")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise CheckpointError(f"{where}: the {what} is not valid JSON ({error}). {REDOWNLOAD}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: the {what} is a JSON {type(data).__name__}, expected an object. {REDOWNLOAD}")
    return data


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(name: str, entry, path: Path) -> tuple[TensorInfo, int, int]:
    """One tensor's header entry, checked: (info, first byte, end byte) relative to the data section."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) \
            or not isinstance(entry.get("shape"), list) or not all(_is_count(d) for d in entry["shape"]) \
            or not isinstance(entry.get("data_offsets"), list) or len(entry["data_offsets"]) != 2 \
            or not all(_is_count(o) for o in entry["data_offsets"]):
        raise CheckpointError(
            f"{path.name}: malformed header entry for tensor {shown(name)} (expected a dtype, a shape of non-negative "
            f"integers and two non-negative data offsets). {REDOWNLOAD}"
        )
    dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    if begin > end:
        raise CheckpointError(f"{path.name}: tensor {shown(name)} has reversed data offsets [{begin}, {end}]. "
                              f"{REDOWNLOAD}")
    if dtype not in DTYPE_BITS:
        raise CheckpointError(
            f"{path.name}: tensor {shown(name)} has dtype {shown(dtype)}, which safetensors does not define "
            f"(expected one of {', '.join(DTYPE_BITS)}). {REDOWNLOAD}"
        )
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits != 8 * (end - begin):
        raise CheckpointError(
            f"{path.name}: tensor {shown(name)} is {dtype} of shape {list(shape)}, {bits / 8:g} bytes, but its data "
            f"offsets span {end - begin} bytes. {REDOWNLOAD}"
        )
    return TensorInfo(dtype, shape, path), begin, end


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Return `({name: TensorInfo}, metadata)` from a safetensors header, checking the file is complete."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found.")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        first = handle.read(8)
        if first.startswith(b"GGUF"):
            raise CheckpointError(
                f"{path.name} is a GGUF file, not a safetensors file. GGUF is read for the Qwen-Image 2.1 DiT only "
                "(Qwen-Image 2.1 Model Loader, models/diffusion_models); use the .safetensors release of this model."
            )
        kind = _pickle_kind(first)
        if kind is not None:
            raise CheckpointError(
                f"{path.name} is {kind}, not a safetensors file. This pack loads weights only from .safetensors "
                "(pickles can run code when loaded); use the .safetensors release of this model."
            )
        (header_len,) = struct.unpack("<Q", first) if len(first) == 8 else (None,)
        if header_len is None or header_len > MAX_HEADER_BYTES or header_len + 8 > size:
            # the first 8 bytes of a safetensors file give its header's length; here they cannot be one
            raise CheckpointError(
                f"{path.name} is not a safetensors file: its first bytes do not give the length of a header that "
                f"fits in its {size:,} bytes. It is another format, or was cut short inside its header; download "
                "it again, or use the .safetensors release of this model."
            )
        header = parse_json_object(handle.read(header_len), path.name, "safetensors header", MAX_HEADER_DEPTH)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path.name}: the header's __metadata__ is not a map of strings. {REDOWNLOAD}")
    tensors, spans = {}, []
    for name, entry in header.items():
        if len(name) > MAX_KEY_CHARS:  # every later message may quote a key: none is longer than this
            raise CheckpointError(f"{path.name}: tensor name {shown(name)} is longer than any weight's name "
                                  f"({MAX_KEY_CHARS:,} characters at most). {REDOWNLOAD}")
        tensors[name], begin, end = _entry(name, entry, path)
        spans.append((begin, end, name))
    # Tensors must tile the data section exactly, in offset order: no gap, no overlap (what safetensors checks).
    data_end = 0
    for begin, end, name in sorted(spans):
        if begin != data_end:
            problem = ("overlaps the tensor before it" if begin < data_end
                       else f"leaves a gap of {begin - data_end} bytes")
            raise CheckpointError(
                f"{path.name}: the data of tensor {shown(name)} (offsets [{begin}, {end}]) {problem}. {REDOWNLOAD}"
            )
        data_end = end
    expected = 8 + header_len + data_end
    if size < expected:
        raise CheckpointError(
            f"{path.name} is truncated: its header describes {expected:,} bytes but the file has {size:,} "
            f"({100 * size / expected:.1f}%). The download was probably interrupted; download it again."
        )
    if size > expected:
        raise CheckpointError(
            f"{path.name}: {size - expected:,} bytes follow the last tensor that its header does not describe. "
            f"{REDOWNLOAD}"
        )
    return tensors, metadata
