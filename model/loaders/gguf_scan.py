"""A bounded first pass over a GGUF file's header, metadata and tensor table, before the `gguf` package parses it.

The `gguf` package's reader walks metadata arrays one element at a time and builds Python objects for each, and a
read past the end of the file returns an empty array instead of failing: a 170-byte file that declares an array of
2^40 elements, or a valid 10 MB file holding a 10-million-element array, kept a server busy for minutes while its
memory grew past 3 GiB. This pass reads the same structure (llama.cpp's `gguf.cpp` layout: magic, version, tensor
count, metadata count, each key/value, each tensor's name, dimensions, type and offset) with small reads and seeks,
and refuses the file as soon as something cannot fit:

- every length and count is checked against the bytes left in the file before anything is read or skipped;
- the metadata may hold at most `MAX_ITEMS` values in all (array elements counted one by one): a Qwen-Image 2.1 DiT
  GGUF holds a few hundred (ComfyUI-GGUF's `comfy.gguf.orig_shape.*` arrays have at most 4 elements), a language
  model's vocabulary some 150,000, which the loader refuses anyway; no array nests another;
- tensors: at most `MAX_TENSORS`, at most 4 dimensions (ggml's limit), a known type, whole blocks, offsets a
  multiple of `general.alignment` (a power of two, default 32), in table order, disjoint, and inside the file.

Nothing here allocates more than a string's first `MAX_SHOWN_BYTES`; the pass costs milliseconds on a real file.
The gguf package is not imported here: its table of type sizes is handed in by the loader.
"""

import struct
from dataclasses import dataclass
from pathlib import Path

from .safetensors_io import CheckpointError, shown

MAX_ITEMS = 1 << 16
MAX_TENSORS = 1 << 16
MAX_KEY_BYTES = 65535  # gguf.cpp's own limit on a key
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_SHOWN_BYTES = 4096  # of a metadata string kept for messages (general.architecture)
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
SUPPORTED_VERSIONS = (2, 3)

# GGUF value types: id -> (name, size in bytes or None for a string/array), as the format defines them.
VALUE_TYPES = {0: ("UINT8", 1), 1: ("INT8", 1), 2: ("UINT16", 2), 3: ("INT16", 2), 4: ("UINT32", 4), 5: ("INT32", 4),
               6: ("FLOAT32", 4), 7: ("BOOL", 1), 8: ("STRING", None), 9: ("ARRAY", None), 10: ("UINT64", 8),
               11: ("INT64", 8), 12: ("FLOAT64", 8)}
STRING, ARRAY, UINT32 = 8, 9, 4
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # an empty name, no dimensions, the type and the offset
_MIN_KV = 8 + 4 + 1  # an empty key, the type and the smallest value


class GGUFScanError(CheckpointError):
    """A GGUF file refused by the pre-scan; `architecture` is its general.architecture when read before that."""

    def __init__(self, message: str, architecture: str | None = None, key: str | None = None):
        super().__init__(message)
        self.architecture, self.key = architecture, key


@dataclass(frozen=True)
class ScannedTensor:
    name: str
    dims: tuple[int, ...]  # as stored (innermost first)
    type_id: int
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFScan:
    """What the pre-scan found: the alignment, where the data section starts, the tensors and the architecture."""

    alignment: int
    data_start: int
    tensors: tuple[ScannedTensor, ...]
    architecture: str | None


class _Cursor:
    """Little-endian reads from a file handle that never run past the end: each read is checked against `size`."""

    def __init__(self, handle, size: int, where: str):
        self.handle, self.size, self.where, self.offset = handle, size, where, 0
        self.architecture = None

    def left(self) -> int:
        return self.size - self.offset

    def fail(self, problem: str, key: str | None = None):
        raise GGUFScanError(
            f"{self.where}: the GGUF header or tensor table cannot be read ({problem}); the file ({self.size:,} bytes) "
            "is cut short or damaged. Download it again.", self.architecture, key)

    def need(self, count: int, what: str) -> None:
        if count > self.left():
            self.fail(f"{what} needs {count:,} bytes at offset {self.offset:,}, but only {self.left():,} are left")

    def read(self, count: int, what: str) -> bytes:
        self.need(count, what)
        data = self.handle.read(count)
        self.offset += count
        return data

    def skip(self, count: int, what: str) -> None:
        self.need(count, what)
        self.offset += count
        self.handle.seek(self.offset)

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.read(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.read(8, what))[0]

    def string(self, what: str, keep: int = 0) -> bytes:
        """A GGUF string: its first `keep` bytes are returned, the rest skipped."""
        length = self.u64(f"the length of {what}")
        self.need(length, f"{what} ({length:,} bytes)")
        head = self.read(min(length, keep), what) if keep else b""
        self.skip(length - len(head), what)
        return head


def _value(cursor: _Cursor, type_id: int, key: str, budget: list[int], in_array: bool = False) -> bytes | None:
    """Skip (or, for a string, keep the head of) one value of `type_id`; `budget` counts the items left."""
    if type_id not in VALUE_TYPES:
        cursor.fail(f"metadata {shown(key)} has value type {type_id}, which GGUF does not define", key)
    name, size = VALUE_TYPES[type_id]
    if type_id == STRING:
        return cursor.string(f"metadata {shown(key)}", MAX_SHOWN_BYTES)
    if type_id != ARRAY:
        cursor.skip(size, f"metadata {shown(key)}")
        return None
    if in_array:
        cursor.fail(f"metadata {shown(key)} is an array of arrays, which GGUF readers do not support", key)
    item_type = cursor.u32(f"the item type of {shown(key)}")
    count = cursor.u64(f"the length of {shown(key)}")
    if item_type not in VALUE_TYPES:
        cursor.fail(f"metadata {shown(key)} is an array of value type {item_type}, which GGUF does not define", key)
    item_size = VALUE_TYPES[item_type][1] or 8  # a string is at least its 8-byte length
    if count > cursor.left() // item_size:
        cursor.fail(f"metadata {shown(key)} declares {count:,} elements of {VALUE_TYPES[item_type][0]}, which need "
                    f"at least {count * item_size:,} bytes; {cursor.left():,} are left in the file", key)
    budget[0] -= count
    if budget[0] < 0:
        raise GGUFScanError(
            f"{cursor.where}: metadata {shown(key)} is an array of {count:,} elements; the metadata of a "
            f"Qwen-Image 2.1 DiT GGUF holds a few hundred values in all, and this pack reads at most {MAX_ITEMS:,}. "
            "This is not a Qwen-Image 2.1 DiT file (a language model's vocabulary?), or it is damaged.",
            cursor.architecture, key)
    if VALUE_TYPES[item_type][1] is not None:
        cursor.skip(count * item_size, f"metadata {shown(key)}")
    else:
        for _ in range(count):
            _value(cursor, item_type, key, budget, in_array=True)
    return None


def scan_gguf(path: Path, type_sizes: dict[int, tuple[int, int]]) -> GGUFScan:
    """Check a GGUF file's structure with bounds (see the module docstring); raises GGUFScanError naming the file.

    `type_sizes`: ggml type id -> (elements per block, bytes per block), the gguf package's `GGML_QUANT_SIZES`.
    """
    where = path.name
    size = path.stat().st_size
    with open(path, "rb") as handle:
        cursor = _Cursor(handle, size, where)
        if cursor.read(4, "the magic") != b"GGUF":
            cursor.fail("it does not start with the GGUF magic")
        version = cursor.u32("the version")
        if version & 0xFFFF == 0 and version:
            raise GGUFScanError(f"{where} is a big-endian GGUF; only little-endian files (what converters write) load.")
        if version not in SUPPORTED_VERSIONS:
            cursor.fail(f"GGUF version {version}; readers handle versions 2 and 3")
        tensor_count = cursor.u64("the tensor count")
        kv_count = cursor.u64("the metadata count")
        if tensor_count > min(MAX_TENSORS, cursor.left() // _MIN_TENSOR_INFO):
            cursor.fail(f"it declares {tensor_count:,} tensors; at most {MAX_TENSORS:,} are read and "
                        f"{cursor.left():,} bytes are left for their table")
        if kv_count > min(MAX_ITEMS, cursor.left() // _MIN_KV):
            cursor.fail(f"it declares {kv_count:,} metadata entries; at most {MAX_ITEMS:,} are read and "
                        f"{cursor.left():,} bytes are left for them")
        budget, alignment = [MAX_ITEMS - kv_count], DEFAULT_ALIGNMENT
        for index in range(kv_count):
            key_bytes = cursor.string(f"metadata key {index}", MAX_KEY_BYTES + 1)
            if len(key_bytes) > MAX_KEY_BYTES:
                cursor.fail(f"metadata key {index} is longer than GGUF's {MAX_KEY_BYTES:,}-byte limit")
            key = key_bytes.decode("utf-8", errors="replace")
            type_id = cursor.u32(f"the value type of {shown(key)}")
            if key == "general.alignment":
                if type_id != UINT32:
                    cursor.fail(f"general.alignment has value type {VALUE_TYPES.get(type_id, (type_id,))[0]}; the "
                                "format stores it as UINT32", key)
                alignment = cursor.u32("general.alignment")
                if alignment == 0 or alignment & (alignment - 1):
                    cursor.fail(f"general.alignment = {alignment}; it must be a power of two", key)
                continue
            head = _value(cursor, type_id, key, budget)
            if key == "general.architecture" and head is not None:
                cursor.architecture = head.decode("utf-8", errors="replace")
        infos = []
        for index in range(tensor_count):
            name = cursor.string(f"the name of tensor {index}", MAX_KEY_BYTES + 1).decode("utf-8", errors="replace")
            if len(name) > MAX_KEY_BYTES:
                cursor.fail(f"tensor {index}'s name is longer than {MAX_KEY_BYTES:,} bytes")
            n_dims = cursor.u32(f"the dimension count of {shown(name)}")
            if n_dims > MAX_DIMS:
                cursor.fail(f"tensor {shown(name)} has {n_dims:,} dimensions; GGUF tensors have at most {MAX_DIMS}")
            dims = tuple(cursor.u64(f"the dimensions of {shown(name)}") for _ in range(n_dims))
            type_id = cursor.u32(f"the type of {shown(name)}")
            offset = cursor.u64(f"the offset of {shown(name)}")
            infos.append((name, dims, type_id, offset))
    data_start = -(-cursor.offset // alignment) * alignment
    return GGUFScan(alignment, data_start, _check_layout(infos, type_sizes, alignment, data_start, size, where),
                    cursor.architecture)


def _check_layout(infos, type_sizes, alignment: int, data_start: int, size: int, where: str):
    """Each tensor's byte size, and the table's layout: aligned, in order, disjoint, inside the file."""
    tensors, end, previous = [], 0, None
    for name, dims, type_id, offset in infos:
        if type_id not in type_sizes:
            raise GGUFScanError(f"{where}: tensor {shown(name)} has ggml type {type_id}, which the installed gguf "
                                "package does not know. The file is damaged, or needs a newer gguf package "
                                "(`pip install -U gguf`).")
        block, block_bytes = type_sizes[type_id]
        elements = 1
        for dim in dims:
            elements *= dim
        if elements > size * 8 or (dims and dims[0] % block):  # more elements than bits in the file, or part-blocks
            raise GGUFScanError(f"{where}: tensor {shown(name)} has dimensions {list(dims)}, which do not fit its type "
                                f"({block}-element blocks) or the file. The file is damaged; download it again.")
        nbytes = elements // block * block_bytes
        if offset % alignment:
            raise GGUFScanError(f"{where}: tensor {shown(name)} starts at data offset {offset:,}, not a multiple "
                                f"of the file's alignment ({alignment}). The file is damaged; download it again.")
        if offset < end:
            raise GGUFScanError(
                f"{where}: tensor {shown(name)} (data offset {offset:,}) overlaps {shown(previous)} (which ends at "
                f"{end:,}); GGUF tensors are stored one after another. The file is damaged or was written by a "
                "broken tool; download it again.")
        end, previous = offset + nbytes, name
        tensors.append(ScannedTensor(name, dims, type_id, offset, nbytes))
    needed = data_start + end
    if tensors and needed > size:
        raise GGUFScanError(
            f"{where} is truncated: its tensor table describes {needed:,} bytes but the file has {size:,} "
            f"({100 * size / needed:.1f}%). The download was probably interrupted; download it again.")
    return tuple(tensors)
