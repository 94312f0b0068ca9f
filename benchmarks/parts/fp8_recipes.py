"""fp8 recipes to measure `fp8_e4m3fn_fast` against (benchmarks only; the pack ships the per-row recipe alone).

- `scale_one(model)`: an emulation of ComfyUI core's `fp8_e4m3fn_fast` on a bf16 file, on a model loaded with
  `weight_dtype="fp8_e4m3fn"` (block weights cast to e4m3 with scale 1, as core's loader does): each block linear's
  activations clamped to +-448 and cast to e4m3 with scale 1 (one scale for the whole tensor), then multiplied with
  the fp8 weight. fp8 x fp8 products are exact in fp32, so a float GEMM of the cast values is what `_scaled_mm` with
  unit scales computes, up to the accumulation order.
- `every_linear_fp8(model)`: a `fp8_e4m3fn_fast` model with its other Linears (embeddings, modulation, output head)
  in fp8 rowwise too: the measurement behind keeping them in bf16.
- `fp8_except(model, keep)`: a float model with its block linears fp8 rowwise, the q and k rows too, except the
  layers whose weight names match the regular expression `keep` (left in the model's dtype): the measurement behind
  the recipe's one exception (`keep=None`: every block linear in fp8, the recipe before q and k stayed in bf16).
- `merged_lora_fp8(model, lora, strength)`: a float model with a LoRA merged into its weights, then the block linears
  quantized (the alternative to the LoRA branch beside the fp8 GEMM).
"""

import re

import torch
import torch.nn.functional as F

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from qi21.model.layers.kitchen import QuantLinear, fp8_rowwise_linears
from qi21.model.layers.linear import Linear
from qi21.model.loaders.dit import FP8_PARAMS

E4M3_MAX = 448.0


class ScaleOneLinear(Linear):
    """Core's fp8 GEMM on one layer: activations clamped and cast to e4m3 with scale 1, times the layer's fp8 weight
    (the `inner` QuantLinear of the loader's fp8_e4m3fn, scale 1)."""

    def __init__(self, inner: QuantLinear):
        torch.nn.Module.__init__(self)
        self.inner = inner
        self.adapters = inner.adapters

    @property
    def weight(self):
        return self.inner.weight

    def project(self, x, start, end):
        cast = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        weight = self.inner.weight_rows(start, end, torch.float32)
        return F.linear(cast, weight).to(x.dtype)


def scale_one(model):
    """`model` (loaded with weight_dtype fp8_e4m3fn) with its fp8 block linears running core's scale-1 recipe."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear) and FP8_PARAMS.fullmatch(f"{name}.weight"):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, ScaleOneLinear(module))
    return model


def every_linear_fp8(model):
    """`model` (loaded with fp8_e4m3fn_fast) with every other Linear in fp8 rowwise as well."""
    fp8_rowwise_linears(model, lambda name: True)
    return model


def fp8_except(model, keep: str | None = None):
    """`model` (a float load) with its block linears fp8 rowwise, q and k rows included, but those matching `keep`."""
    skip = re.compile(keep) if keep else None
    fp8_rowwise_linears(model, lambda name: bool(FP8_PARAMS.fullmatch(name)) and not (skip and skip.search(name)),
                        kept_rows=lambda name, rows: 0)
    return model


def merged_lora_fp8(model, lora_path, strength: float):
    """`model` (a float load) with the LoRA merged into its weights, then its block linears quantized per channel."""
    from qi21.model.features.lora import apply_lora

    with_lora = apply_lora(model, lora_path, strength)
    for name, module in list(with_lora.named_modules()):
        if isinstance(module, Linear) and not isinstance(module, QuantLinear) and module.adapters:
            eye = torch.eye(module.weight.shape[1], dtype=torch.float32)
            merged = module.weight.float() + sum(a(eye, 0, module.out_features) for a in module.adapters).T
            fresh = Linear(module.weight.shape[1], module.weight.shape[0], dtype=module.weight.dtype)
            fresh.weight.data = merged.to(module.weight.dtype)
            parent, _, leaf = name.rpartition(".")
            setattr(with_lora.get_submodule(parent) if parent else with_lora, leaf, fresh)
    fp8_rowwise_linears(with_lora, FP8_PARAMS.fullmatch)
    return with_lora
