"""Load a Qwen-Image 2.1 DiT from a GGUF file (llama.cpp's format, as ComfyUI-GGUF's tools write it).

The file's header and tensor table are read with the `gguf` package's `GGUFReader` (imported only here, and
only when a GGUF file is loaded), which memory-maps the file. What the file is follows from its table alone,
with the safetensors loader's own rules (`dit_keys.py`): the key plan (ComfyUI names, fused `img_mlp.gate_up`,
with or without `model.diffusion_model.`), the config inferred from shapes, Base vs Turbo from the file name.
The file's structure is pre-scanned with bounds first (`gguf_scan.py`: metadata sizes, tensor layout, truncation),
so no file can make the package's reader walk gigabytes of metadata. A file of another architecture, a tensor
type we cannot dequantize or a truncated file is refused before any weight is allocated; NaN/inf in a tensor or a
block scale is refused as it is read (`finite.py`).

Then each tensor is copied out of the mapping into memory the model owns, one at a time (a file replaced or cut
while ComfyUI runs cannot crash the process), and the mapping is dropped. 2-D weights stay in their GGUF types
(`gguf_dequant.GGUFLinear`: uint8 blocks, dequantized per layer right before its matmul); 1-D tensors (norm
scales) are dequantized at load into the compute dtype (they are tiny and read as they are).
"""

from pathlib import Path

import numpy as np
import torch

from ..layers.gguf import FLOAT_TYPES, QUANT_TYPES, SUPPORTED_TYPES, GGUFLinear, block_scales, dequantize
from ..layers.linear import Linear
from ..transformer.dit import QwenImage21DiT
from .checkpoint import FLOAT_DTYPES, CheckpointError, TensorInfo, choose_dtype, rename_keys, shown
from .dit_keys import DiTSource, check_shapes, file_plan, infer_config, strip_prefix, variant_from_name
from .finite import check_finite
from .gguf_scan import GGUFScanError, scan_gguf
from .safetensors_io import REDOWNLOAD

ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."  # + tensor name: its shape before ComfyUI-GGUF flattened it to rows of 256
# general.architecture values of other image models (ComfyUI-GGUF's list) and of language models (llama.cpp's)
OTHER_IMAGE_ARCHS = {
    "flux": "Flux", "sd1": "Stable Diffusion 1.x", "sdxl": "Stable Diffusion XL", "sd3": "Stable Diffusion 3",
    "aura": "AuraFlow", "hidream": "HiDream", "cosmos": "Cosmos", "ltxv": "LTX-Video", "hyvid": "HunyuanVideo",
    "wan": "Wan", "lumina2": "Lumina 2", "chroma": "Chroma",
}
LANGUAGE_ARCHS = {"llama", "qwen", "qwen2", "qwen2vl", "qwen2moe", "qwen3", "qwen3vl", "qwen3moe", "t5", "t5encoder",
                  "gemma", "gemma2", "gemma3", "mistral", "phi3", "gpt2", "bert", "umt5"}
_PUT_HERE = ("Put Qwen-Image 2.1 DiT files (qwen_image_2.1_bf16.safetensors, or a GGUF of it such as "
             "qwen_image_2.1-Q4_K_M.gguf) in models/diffusion_models.")


def _import_gguf(where: str):
    try:
        import gguf
    except ImportError:
        raise ImportError(
            f"{where} is a GGUF file; reading it needs the gguf package (llama.cpp's GGUF reader), which is not "
            "installed. Install it with `pip install gguf` (inside ComfyUI: with ComfyUI's python) and restart."
        ) from None
    return gguf


def _open(gguf, path: Path):
    """The gguf package's reader over `path`, after the bounded pre-scan (gguf_scan.py) has checked the header, the
    metadata sizes and the tensor layout, so the package's reader never walks a metadata bomb or reads past the end."""
    where = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read this file ({error.strerror or error}).") from None
    if magic != b"GGUF":
        raise CheckpointError(f"{where} is not a GGUF file (it does not start with the GGUF magic). {REDOWNLOAD}")
    try:
        scan_gguf(path, {int(qtype): sizes for qtype, sizes in gguf.GGML_QUANT_SIZES.items()})
    except GGUFScanError as error:
        if error.architecture in LANGUAGE_ARCHS or (error.key or "").startswith("tokenizer."):
            raise CheckpointError(
                f"{where} is a language model GGUF (general.architecture = {shown(error.architecture)}, a tokenizer "
                f"in its metadata), not a Qwen-Image 2.1 DiT. {_PUT_HERE}"
            ) from None
        raise
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as error:  # the reader's own errors: a bad field, a duplicated name, text that is not UTF-8
        raise CheckpointError(
            f"{where}: the GGUF header or tensor table cannot be read ({type(error).__name__}: "
            f"{shown(str(error), 200)}); the file ({size:,} bytes) is cut short or damaged. Download it again."
        ) from None


def _string_field(gguf, reader, key: str) -> str | None:
    field = reader.get_field(key)
    if field is None or list(field.types) != [gguf.GGUFValueType.STRING]:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def _orig_shape(gguf, reader, name: str, where: str) -> tuple[int, ...] | None:
    """The shape ComfyUI-GGUF recorded for a tensor it stored flattened (`comfy.gguf.orig_shape.<name>`)."""
    field = reader.get_field(ORIG_SHAPE_KEY + name)
    if field is None:
        return None
    integers = {gguf.GGUFValueType.INT32, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT64,
                gguf.GGUFValueType.UINT64}
    if len(field.types) != 2 or field.types[0] != gguf.GGUFValueType.ARRAY or field.types[1] not in integers:
        raise CheckpointError(f"{where}: {shown(ORIG_SHAPE_KEY + name)} is not an array of integers. {REDOWNLOAD}")
    return tuple(int(field.parts[index][0]) for index in field.data)


def _check_architecture(gguf, reader, names, where: str) -> str:
    """`general.architecture`, refused when it names another model; a Qwen-Image one is judged by its keys."""
    arch = _string_field(gguf, reader, "general.architecture")
    if arch is None:
        return "none"
    if arch in OTHER_IMAGE_ARCHS:
        raise CheckpointError(
            f"{where} is a GGUF of {OTHER_IMAGE_ARCHS[arch]} (general.architecture = {shown(arch)}), not a "
            f"Qwen-Image 2.1 DiT. {_PUT_HERE}"
        )
    is_llm = (arch in LANGUAGE_ARCHS or reader.get_field(f"{arch}.block_count") is not None
              or reader.get_field("tokenizer.ggml.model") is not None or any(n.startswith("blk.") for n in names))
    if is_llm:
        raise CheckpointError(
            f"{where} is a language model GGUF (general.architecture = {shown(arch)}, llama.cpp tensor names), not a "
            f"Qwen-Image 2.1 DiT. {_PUT_HERE}"
        )
    return arch


def _table(gguf, reader, path: Path) -> dict:
    """{file key: (type name, logical shape, bytes, mapped data)} of every tensor, shapes and types checked."""
    where = path.name
    if reader.byte_order != "I":
        raise CheckpointError(f"{where} is a big-endian GGUF; only little-endian files (what converters write) load.")
    table = {}
    for tensor in reader.tensors:
        qtype = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
        count = int(tensor.n_elements)
        shape = _orig_shape(gguf, reader, tensor.name, where) or tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if int(np.prod(shape, dtype=np.int64)) != count:
            raise CheckpointError(
                f"{where}: {shown(ORIG_SHAPE_KEY + tensor.name)} = {list(shape)[:8]} does not hold the tensor's "
                f"{count} elements. {REDOWNLOAD}"
            )
        table[tensor.name] = (qtype, shape, int(tensor.n_bytes), tensor.data)
    return table


def _check_types(table, keys: dict[str, str], where: str) -> None:
    unsupported = [(key, table[file_key][0]) for key, file_key in keys.items() if table[file_key][0] not in
                   SUPPORTED_TYPES]
    if unsupported:
        examples = "; ".join(f"{shown(key, 80)[1:-1]} is {qtype}" for key, qtype in unsupported[:3])
        raise CheckpointError(
            f"{where}: {len(unsupported)} tensors are stored in GGUF types this pack does not dequantize ({examples}). "
            f"Supported: {', '.join(SUPPORTED_TYPES)}. Use a file quantized to one of those (Q8_0 ... Q2_K)."
        )
    for key, file_key in keys.items():
        qtype, shape, _, _ = table[file_key]
        block = QUANT_TYPES[qtype][0] if qtype in QUANT_TYPES else 1
        if int(np.prod(shape, dtype=np.int64)) % block:
            raise CheckpointError(f"{where}: {key} ({qtype}, shape {list(shape)}) is not a whole number of "
                                  f"{block}-element blocks. {REDOWNLOAD}")


def load_gguf_dit(path, weight_dtype: str = "default", device="cpu", attention: str = "auto") -> QwenImage21DiT:
    """Load a Qwen-Image 2.1 DiT GGUF file; `model.source.layout` is "gguf".

    `weight_dtype` picks the compute dtype: "default" (bf16), "bf16", "fp16" or "fp32" (or a torch dtype); the
    weights stay in the file's types whatever it is. fp8_e4m3fn is refused: a GGUF file is already quantized.
    """
    path = Path(path)
    where = path.name
    compute = choose_dtype(weight_dtype, "GGUF", FLOAT_DTYPES,
                           "GGUF DiT, whose weights stay in the file's quantized types")
    gguf = _import_gguf(where)
    reader = _open(gguf, path)
    table = None
    try:
        table = _table(gguf, reader, path)
        arch = _check_architecture(gguf, reader, table.keys(), where)
        keys = rename_keys(table, strip_prefix, where)  # {key without the ComfyUI prefix: key in the file}
        tensors = {key: TensorInfo(table[file_key][0], table[file_key][1], path) for key, file_key in keys.items()}
        config = infer_config(tensors, f"{where} (GGUF, general.architecture = {shown(arch)})")
        plan = file_plan(config, "transformer_blocks.0.img_mlp.gate_up.weight" in tensors)
        check_shapes(plan, tensors, config, where)
        _check_types(table, keys, where)

        backend = "sdpa" if attention == "auto" else attention
        with torch.device("meta"):
            model = QwenImage21DiT(config, dtype=compute, attention=backend)
        try:
            _fill(model, plan, {key: table[file_key] for key, file_key in keys.items()}, compute,
                  torch.device(device), where)
        except BaseException:
            del model  # nothing half-loaded stays alive, also on KeyboardInterrupt
            raise
    finally:
        del table, reader  # the tensors' views and the reader hold the file's mapping: drop them now
    model.compute_dtype = compute
    model.source = DiTSource(path, "gguf", *variant_from_name(path))
    return model.eval()


def _owned(target: torch.Tensor, source: np.ndarray) -> None:
    """Copy a mapped tensor's bytes into `target` (memory of its own, on its device)."""
    data = np.ascontiguousarray(source).reshape(-1).view(np.uint8)
    if target.device.type == "cpu":
        np.copyto(target.view(torch.uint8).numpy().reshape(-1), data)
    else:
        target.view(torch.uint8).view(-1).copy_(torch.from_numpy(data.copy()))


def _fill(model: QwenImage21DiT, plan, entries: dict, compute: torch.dtype, device: torch.device, where: str) -> None:
    """Each Linear of the plan becomes a GGUFLinear over the file's bytes; 1-D tensors are dequantized. Every
    tensor's floats (a float type's values, a quantized type's block scales) are checked for NaN/inf as read."""
    for name, keys in plan.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, Linear):
            out_features, in_features = module.weight.shape
            layer = GGUFLinear(in_features, out_features, compute)
            start = 0
            while start < len(keys):  # adjacent parts of one type share a segment (same blocks, same rows)
                qtype = entries[keys[start]][0]
                stop = start + 1
                while stop < len(keys) and entries[keys[stop]][0] == qtype:
                    stop += 1
                layer.add_segment(qtype, _segment(entries, keys[start:stop], qtype, in_features, device, where))
                start = stop
            parent_name, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        else:
            (key,) = keys
            qtype, shape, nbytes, data = entries[key]
            raw = torch.empty(nbytes, dtype=torch.uint8)
            _owned(raw, data)
            values = dequantize(qtype, raw).view(getattr(module, attr).shape)
            del raw
            check_finite(values, key, where)
            values = values.to(device=device, dtype=compute)
            setattr(module, attr, torch.nn.Parameter(values, requires_grad=False))
    left = [name for name, param in model.named_parameters() if param.is_meta]
    if left:
        raise RuntimeError(f"GGUF loader: parameters left unfilled: {left[:3]}")  # a bug of ours, never a file's


def _segment(entries: dict, keys: list[str], qtype: str, in_features: int, device: torch.device,
             where: str) -> torch.Tensor:
    """The parts `keys` (one GGUF type) concatenated along rows, in the type's storage layout."""
    if qtype in FLOAT_TYPES:
        rows = sum(entries[key][1][0] for key in keys)
        target = torch.empty(rows, in_features, dtype=FLOAT_TYPES[qtype], device=device)
        row = 0
        for key in keys:
            part_rows = entries[key][1][0]
            _owned(target[row : row + part_rows], entries[key][3])
            check_finite(target[row : row + part_rows], key, where)
            row += part_rows
        return target
    block, size = QUANT_TYPES[qtype]
    blocks = sum(entries[key][2] // size for key in keys)
    target = torch.empty(blocks, size, dtype=torch.uint8, device=device)
    first = 0
    for key in keys:
        count = entries[key][2] // size
        _owned(target[first : first + count], entries[key][3])
        check_finite(block_scales(qtype, target[first : first + count]), f"{key} (its {qtype} block scales)", where)
        first += count
    return target

