"""The checkpoint toolkit the DiT, VAE and text-encoder loaders share.

`safetensors_io.py` reads and checks one file's header (the format). This module works at the level a loader thinks
in: where a component's weights are (a single file, or a diffusers folder with its optional shard index and
`config.json`), reading any JSON file of a checkpoint, the precision to load in, which stored dtypes a tensor may
have, and reading tensors one at a time into memory the model owns. Each loader (`dit.py`, `vae.py`,
`text_encoder.py`) keeps only what is its own: how its files are recognised, its key map, and how its config follows
from shapes and `config.json`. The file layouts themselves are described in docs/checkpoints.md.
"""

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch

from .safetensors_io import CheckpointError, TensorInfo, parse_json_object, read_header, shown

__all__ = [  # the header-level names are re-exported so loaders import their plumbing from one place
    "FILE_DTYPES",
    "FLOAT_DTYPES",
    "FP8_FILE_DTYPES",
    "TORCH_DTYPES",
    "WEIGHT_DTYPES",
    "CheckpointError",
    "TensorInfo",
    "WeightFiles",
    "WeightReader",
    "check_dtypes",
    "choose_dtype",
    "cpu_has_native_bf16",
    "count_indexed",
    "default_weight_dtype",
    "find_weights",
    "identify_checkpoint",
    "infos_of",
    "quantization_marker",
    "read_header",
    "read_json",
    "read_shard_index",
    "read_weight_headers",
    "rename_keys",
    "shown",
]

# config.json, model_index.json and shard indexes are kilobytes (a 100-shard index a few hundred); a file far
# larger, or nested deeper, is not one of them and is refused before parsing.
MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 64

# The weight_dtype names of all three loaders ("default" = the file's own float type) and their torch dtypes.
# fp8_e4m3fn_fast (DiT and control net only) stores like fp8_e4m3fn and also multiplies in fp8 (layers/fast_gemm.py).
WEIGHT_DTYPES = ("default", "bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e4m3fn_fast")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8_e4m3fn": torch.float8_e4m3fn,
                "fp8_e4m3fn_fast": torch.float8_e4m3fn}
# Stored dtypes a model computes in, and the fp8 ones a loader may accept where it says so.
FILE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
FP8_FILE_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
#: What the text encoder, the VAE, the control net and a GGUF DiT compute in (the DiT also holds fp8 weights).
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SAFETENSORS_NAMES = {
    dtype: name for name, dtype in {
        **FILE_DTYPES, **FP8_FILE_DTYPES, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
        "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    }.items()
}
MEMORY = Path("<memory>")  # the `file` of tensors handed over in a state dict


# -- JSON files ----------------------------------------------------------------------------------------------------
def read_json(path: Path, what: str) -> dict:
    """The JSON object in `path` (a config.json, model_index.json, shard index or processor settings file).

    Every failure (unreadable, too large, not JSON, too deeply nested, not an object) is a CheckpointError naming
    the file; `what` says which kind of file it should have been.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {size:,} bytes, far too large for a {what}; this is not one.")
        raw = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read this {what} ({error.strerror or error}).") from None
    return parse_json_object(raw, str(path), what, MAX_JSON_DEPTH)


# -- where the weights are -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightFiles:
    """Where one component's weights are, as `find_weights` resolved it."""

    path: Path  # what the caller named
    files: tuple[Path, ...]  # safetensors files to read: one, or the shards of `index`
    folder: Path  # the component folder (a single file's own folder)
    root: Path  # a diffusers model root (holding model_index.json); for a single file, its folder
    config: Path | None  # the component's config.json (never for a single file)
    index: Path | None  # the shard index, if sharded
    weight_map: dict | None  # {tensor name: shard file name} from the index

    @property
    def single_file(self) -> bool:
        return self.files == (self.path,)  # a folder is never its own weights file

    @property
    def model_index(self) -> Path | None:
        """The diffusers `model_index.json` above the component folder, if there is one."""
        found = self.root / "model_index.json"
        return found if not self.single_file and found.is_file() else None


# Names diffusers and transformers give a component's weights; preferred when a folder holds other files too.
STANDARD_STEMS = ("diffusion_pytorch_model", "model")


def find_weights(path, component: str, expected: str) -> WeightFiles:
    """A single file, a diffusers model root (weights in `component/` below it), or the component folder itself.

    `expected` completes the error for a folder without weights ("a diffusers Qwen-Image-2.1 vae/ folder (...)").
    Any file is accepted as a single file: the header check names pickles, GGUF and truncated files.
    """
    path = Path(path)
    if path.is_file():
        return WeightFiles(path, (path,), path.parent, path.parent, None, None, None)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder.")
    if (path / component).is_dir():
        root, folder = path, path / component
    elif (path / "model_index.json").is_file():
        raise CheckpointError(f"{path}: a diffusers folder without {component}/; finish the download.")
    else:
        root, folder = path.parent, path
    index = _shard_index(folder)
    if index is not None:
        files, weight_map = read_shard_index(index)
    else:
        files, weight_map = (_weights_file(folder, expected),), None
    config = folder / "config.json"
    return WeightFiles(path, tuple(files), folder, root, config if config.is_file() else None, index, weight_map)


def _pick(found: list[Path], suffix: str) -> Path | None:
    """The one file, or the one with a standard name among several (diffusers folders may add variants)."""
    if len(found) == 1:
        return found[0]
    standard = [file for file in found if file.name in {stem + suffix for stem in STANDARD_STEMS}]
    return standard[0] if len(standard) == 1 else None


def _shard_index(folder: Path) -> Path | None:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if not indexes:
        return None
    index = _pick(indexes, ".safetensors.index.json")
    if index is None:
        raise CheckpointError(
            f"{folder}: {len(indexes)} shard indexes ({', '.join(i.name for i in indexes)}); expected one. Keep the "
            "model's own index (diffusion_pytorch_model.safetensors.index.json or model.safetensors.index.json)."
        )
    return index


def _weights_file(folder: Path, expected: str) -> Path:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors weights found. Expected {expected}.")
    file = _pick(files, ".safetensors")
    if file is None:
        raise CheckpointError(
            f"{folder}: {len(files)} .safetensors files ({', '.join(f.name for f in files[:4])}) and no shard index; "
            f"expected {expected}."
        )
    return file


def read_shard_index(index: Path) -> tuple[list[Path], dict[str, str]]:
    """(shard files, weight map) of a `*.safetensors.index.json`, every shard checked to exist beside it."""
    weight_map = read_json(index, "shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(
            f"{index}: no weight_map of tensor names to shard files in this shard index; download it again."
        )
    outside = sorted({name for name in weight_map.values() if Path(name).name != name or name in ("", ".", "..")})
    if outside:  # a shard is a file beside its index, never a path that could point elsewhere
        raise CheckpointError(f"{index}: shard names must be plain file names beside the index, not {outside[:3]}.")
    shards = sorted({index.parent / name for name in weight_map.values()})
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise CheckpointError(
            f"{index.parent}: {len(missing)} of {len(shards)} shards listed in {index.name} are missing "
            f"({', '.join(missing)}). Finish the download of this folder."
        )
    return shards, weight_map


def read_weight_headers(weights: WeightFiles) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Merged headers of all the files (each checked before anything is loaded), shards against their index."""
    tensors, metadata = {}, {}
    for file in weights.files:
        part, meta = read_header(file)
        twice = sorted(part.keys() & tensors.keys())
        if twice:
            raise CheckpointError(
                f"{weights.folder}: {twice[0]} is in both {tensors[twice[0]].file.name} and {file.name}; shards must "
                "not repeat tensors. Download the folder again."
            )
        tensors.update(part)
        metadata.update(meta)
    if weights.weight_map is not None:
        elsewhere = [f"{name} (index: {shard}, found: {tensors[name].file.name if name in tensors else 'nowhere'})"
                     for name, shard in weights.weight_map.items()
                     if name not in tensors or tensors[name].file.name != shard]
        if elsewhere:
            raise CheckpointError(
                f"{weights.index}: {len(elsewhere)} tensors are not in the shard this index names, e.g. "
                f"{'; '.join(elsewhere[:3])}. The index and the shards are from different downloads; download the "
                "folder again."
            )
    return tensors, metadata


def infos_of(state_dict: dict[str, torch.Tensor]) -> dict[str, TensorInfo]:
    """TensorInfo for tensors already in memory, with the dtype named as a safetensors header names it."""
    return {key: TensorInfo(_SAFETENSORS_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape), MEMORY)
            for key, t in state_dict.items()}


# -- precision ------------------------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, value in TORCH_DTYPES.items() if value == dtype), str(dtype))


def choose_dtype(weight_dtype, file_dtype: str, supported: tuple[torch.dtype, ...], component: str) -> torch.dtype:
    """The dtype to load weights in.

    `weight_dtype`: a name from WEIGHT_DTYPES or a torch dtype; "default" (or None) is the file's own float type
    (`file_dtype`, a safetensors dtype name), bf16 for anything else (an fp8 file). `supported` lists what the
    `component` can load as; anything else is a ValueError naming the choices.
    """
    if isinstance(weight_dtype, torch.dtype):
        chosen = weight_dtype
    elif weight_dtype in (None, "default"):
        chosen = FILE_DTYPES.get(file_dtype, torch.bfloat16)
    elif weight_dtype in TORCH_DTYPES:
        chosen = TORCH_DTYPES[weight_dtype]
    else:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES} or a torch dtype; got {weight_dtype!r}.")
    if chosen not in supported:
        raise ValueError(
            f"weight_dtype {_dtype_name(chosen)} is not supported for the {component}; use default, "
            + ", ".join(_dtype_name(dtype) for dtype in supported) + "."
        )
    return chosen


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX, as torch's cpuinfo reads the CPU's flags).
    oneDNN then runs bf16 GEMMs faster than fp32 (6.5x for the DiT's shapes on an AMX Xeon, issue 66 reports);
    without them (AVX2, plain AVX-512) bf16 is emulated op by op, several times slower than fp32 (docs/nodes.md,
    `benchmarks/speed.py cpu-dtype`). The CPU does not change while the process runs: read once."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if callable(check))  # an older torch without them: not native


def default_weight_dtype(weight_dtype, device) -> str | torch.dtype:
    """What a loader's `weight_dtype` "default" means on the device the model computes on: the file's own dtype
    (`choose_dtype`'s "default") on a GPU and on a CPU with native bf16, fp32 on any other CPU, as ComfyUI core
    computes there. Any other choice is returned as it is."""
    if weight_dtype in (None, "default") and torch.device(device).type == "cpu" and not cpu_has_native_bf16():
        return "fp32"
    return weight_dtype


def check_dtypes(tensors: dict[str, TensorInfo], allowed: dict[str, tuple[str, ...]], where: str,
                 component: str) -> None:
    """Refuse any tensor stored in a dtype it may not have (`allowed`: {file key: dtype names}).

    Converting would "work" (an integer tensor becomes a float one), but it means the header lies about the data:
    the model would run on garbage and produce a black or noisy image with no error.
    """
    wrong = [(key, tensors[key], ok) for key, ok in allowed.items() if tensors[key].dtype not in ok]
    if wrong:
        examples = "; ".join(f"{key} in {info.file.name} is {info.dtype} (expected {' or '.join(ok)})"
                             for key, info, ok in wrong[:3])
        raise CheckpointError(
            f"{where}: {len(wrong)} {component} tensors are stored in a dtype a weight of theirs cannot have: "
            f"{examples}. The file is damaged or is not a weights file for this model; download it again."
        )


# -- names ----------------------------------------------------------------------------------------------------------
def count_indexed(names, pattern: str) -> int:
    """How many numbered items (layers, blocks, stages) `pattern`'s first group counts: 1 + the largest, or 0."""
    found = {int(m.group(1)) for name in names if (m := re.match(pattern, name))}
    return max(found) + 1 if found else 0


def rename_keys(keys, rename, where: str) -> dict[str, str]:
    """{new name: file key} for every key `rename` maps (None skips a key); two keys onto one name are refused."""
    names = {}
    for key in keys:
        name = rename(key)
        if name is None:
            continue
        if name in names:
            raise CheckpointError(f"{where}: both {shown(names[name])} and {shown(key)} map to "
                                  f"{shown(name)}; mixed key layouts.")
        names[name] = key
    return names


# -- reading tensors ------------------------------------------------------------------------------------------------
class WeightReader:
    """Tensors read one at a time, by file key: from their files, each opened once (lazily) with safetensors'
    `safe_open`, or from a state dict already in memory. Use it as a context manager, or call `close`.
    """

    def __init__(self, tensors: dict[str, TensorInfo], state_dict: dict[str, torch.Tensor] | None = None):
        self._tensors, self._state_dict, self._handles = tensors, state_dict, {}

    def read(self, key: str) -> torch.Tensor:
        """The tensor as stored. From a file it is a view of the file's memory map: convert or copy it at once."""
        if self._state_dict is not None:
            return self._state_dict[key]
        file = self._tensors[key].file
        if file not in self._handles:
            # looked up on the module at each open, so a wrapped safe_open (tests) is the one used
            self._handles[file] = safetensors.safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file].get_tensor(key)

    def load(self, key: str, dtype: torch.dtype, device) -> torch.Tensor:
        """The tensor in `dtype` on `device`, always in memory of its own (`copy=True`): without a conversion,
        `.to` would return the mapped view itself, and a model living on a mapping crashes the process (SIGBUS)
        or silently changes when the file is replaced or truncated while ComfyUI runs."""
        return self.read(key).to(device=device, dtype=dtype, copy=True)

    def close(self) -> None:
        self._handles.clear()  # dropping a handle unmaps its file; tensors already loaded own their memory

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


# -- what is this file? ---------------------------------------------------------------------------------------------
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
    sample = ", ".join(shown(key, 60) for key in sorted(keys)[:4])
    return f"an unrecognised checkpoint ({len(keys)} tensors, e.g. {sample})"


QUANTIZED_MARKERS = ("weight_scale", "comfy_quant", "scale_weight", "scaled_fp8", "input_scale", "weight_s_rel",
                     "weight_s_channel")


def quantization_marker(keys, metadata: dict) -> str | None:
    """Name of the first quantization marker found (ComfyUI per-layer quantization), else None. The DiT and
    text-encoder loaders then read the file through `quantized.plan_quantization`."""
    if "_quantization_metadata" in metadata:
        return "_quantization_metadata"
    for key in keys:
        for marker in QUANTIZED_MARKERS:
            if key.endswith(marker):
                return key
    return None
