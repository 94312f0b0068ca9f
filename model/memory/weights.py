"""What the weights take: stored bytes counted from the real tensors (so fp8, int8 and GGUF weights count at their
stored size), per streamable layer and for the rest, and the same table for a model that is not loaded."""

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.formats import FORMATS
from ..transformer.dit import DiTConfig, QwenImage21DiT
from .slots import STREAM_SLOTS, slot_layout


def tensor_bytes(tensors) -> int:
    """Stored bytes of `tensors` (parameters and buffers; meta tensors and repeats of one tensor count nothing)."""
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None or tensor.is_meta or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total



def bytes_on(tensors, device: torch.device) -> int:
    """What `tensors` hold on `device`, each counted once: a weight still waiting on its file is a one-element
    placeholder of its shape, so its storage, not its shape, says what it holds."""
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is not None and id(tensor) not in seen and tensor.device == device:
            seen.add(id(tensor))
            total += min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes())
    return total


def module_tensors(module: nn.Module):
    """Every parameter and buffer of `module` and its submodules (each once)."""
    return [*module.parameters(), *module.buffers()]



@dataclass(frozen=True)
class LayeredWeights:
    """Stored bytes of a model that runs a list of layers one after another: each layer's (what can be streamed,
    as the slot it would need) and everything else (always resident)."""

    layers: tuple[int, ...]
    other: int
    label: str = ""

    @property
    def total(self) -> int:
        return self.other + sum(self.layers)

    def streamed_bytes(self, streamed) -> int:
        return sum(self.layers[i] for i in streamed)

    def device_bytes(self, streamed) -> int:
        """Weights on the device with `streamed` layers streamed: the rest, plus the slots they cycle through."""
        streamed = tuple(streamed)
        slots = sorted((self.layers[i] for i in streamed), reverse=True)[:STREAM_SLOTS]
        return self.total - self.streamed_bytes(streamed) + sum(slots) if streamed else self.total



def layered_weights(root: nn.Module, layers, label: str = "") -> LayeredWeights:
    """`LayeredWeights` of a built model, from its real tensors (a layer counts as the slot it would need)."""
    per_layer = tuple(slot_layout(_unique(module_tensors(layer)))[1] for layer in layers)
    inside = {id(t) for layer in layers for t in module_tensors(layer)}
    other = tensor_bytes(t for t in module_tensors(root) if id(t) not in inside)
    return LayeredWeights(per_layer, other, label)



def _unique(tensors) -> list:
    seen, out = set(), []
    for tensor in tensors:
        if not tensor.is_meta and id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(tensor)
    return out



def weight_format(model: nn.Module) -> str:
    """A short name of how the DiT's block weights are stored: bf16, fp8, int8, gguf Q4_K, ..."""
    block = model.blocks[0]
    segments = getattr(block.qkv, "segments", None) or ()
    kinds = [getattr(seg, "qtype", None) or getattr(seg, "fmt", None) for seg in segments]
    if any(kinds):  # GGUF (qtype) or ComfyUI's quantized files (fmt)
        prefix = "gguf " if hasattr(segments[0], "qtype") else ""
        return prefix + "/".join(dict.fromkeys(FORMATS[k].label if k in FORMATS else k for k in kinds
                                               if k and k != "float"))
    dtype = next((t.dtype for t in module_tensors(block.qkv)), torch.float32)
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8",
            torch.int8: "int8"}.get(dtype, str(dtype).replace("torch.", ""))



def run_layers(model: QwenImage21DiT) -> list[nn.Module]:
    """The blocks one step runs, in the order it runs them: the DiT's, and on a Fun ControlNet copy each control
    block right after its base block (transformer/controlnet.py). What the planner counts and streaming streams,
    so a control net's blocks are streamed like the DiT's when they do not fit."""
    control = model.options.control if model.options is not None else None  # the record says (features/record.py)
    if control is None:
        return list(model.blocks)
    base = len(model.blocks)
    net_blocks = model.control_net.blocks  # the copy's own child (what its forward runs)
    return [model.blocks[i] if i < base else net_blocks[i - base] for i in control.read_order(base)]


def dit_weights(model: QwenImage21DiT) -> LayeredWeights:
    return layered_weights(model, run_layers(model), weight_format(model))



#: Stored bytes of a block's linear weights, by format label: (per weight element, per output row). The float
#: dtypes, then every quantized format of the registry (int8 adds one fp32 scale per row, NVFP4 an fp8 scale per 16
#: elements, ...).
LINEAR_ITEMSIZE = {"fp32": (4, 0), "bf16": (2, 0), "fp16": (2, 0),
                   **{fmt.label: (fmt.element_bytes, fmt.row_bytes) for fmt in FORMATS.values()}}



def synthetic_dit_weights(config: DiTConfig | None = None, fmt: str = "bf16") -> LayeredWeights:
    """`LayeredWeights` of a DiT of `config` stored as `fmt` (block linears in `fmt`, the rest in bf16; fp32 keeps
    everything in fp32), computed on the meta device: for the tables and tests, no weights needed."""
    if fmt not in LINEAR_ITEMSIZE:
        raise ValueError(f"fmt must be one of {tuple(LINEAR_ITEMSIZE)}, got {fmt!r}.")
    with torch.device("meta"):
        model = QwenImage21DiT(config or DiTConfig(), dtype=torch.bfloat16)
    other_size = 4 if fmt == "fp32" else 2
    layers = []
    element, row = LINEAR_ITEMSIZE[fmt]
    for block in model.blocks:
        size = 0
        for name, param in block.named_parameters():
            if name.endswith(".weight") and param.ndim == 2:
                size += math.ceil(param.numel() * element) + param.shape[0] * row
            else:
                size += param.numel() * other_size
        layers.append(size)
    inside = {id(p) for block in model.blocks for p in block.parameters()}
    other = sum(p.numel() * other_size for p in model.parameters() if id(p) not in inside)
    return LayeredWeights(tuple(layers), other, fmt)
