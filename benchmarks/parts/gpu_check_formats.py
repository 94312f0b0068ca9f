"""gpu_check.py's `formats` section: every weight format against a plain model holding its own dequantized weights.

One random model (bf16-rounded, `check.format_layers` blocks at the check's width) is written as users get it: the
bf16 ComfyUI file, ComfyUI quantized files made by comfy-kitchen's own quantizers (int8 ConvRot, fp8, W4A8:
benchmarks/variants.py quantized), GGUF Q8_0 and Q4_K (variants.py gguf) and a rank-32 LoRA on every block
linear (variants.py lora). Each loads as the nodes load it (on a GPU the int8 / fp8 / W4A8 layers run
comfy-kitchen's kernels; on a CPU they are dequantized per layer). Its "twin" is a plain `QwenImage21DiT` in the same
compute dtype whose every linear holds that model's own dequantized weight (a LoRA merged in), so the difference is
what the fast path itself changes; the bf16 file's row is the scale of plain bf16 rounding. Prefill and cached step
are timed next to diffusers' bf16 transformer on the same weights.
"""

import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

import variants
from parts.gpu_check_common import Check, dit_calls, rel_diff, table
from qi21.model.features.lora import apply_lora
from qi21.model.layers.kitchen import gemm_summary
from qi21.model.layers.linear import Linear
from qi21.model.loaders.dit import load_dit
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.transformer.dit import QwenImage21DiT

KITCHEN = ("int8_convrot", "fp8", "w4a8")
GGUF = ("Q8_0", "Q4_K")
LORA_RANK = 32


def dense_twin(model: QwenImage21DiT, dtype: torch.dtype) -> QwenImage21DiT:
    """A plain DiT whose every `Linear` holds `model`'s weight as its own layer dequantizes it, plus each adapter's
    term (a LoRA's `up @ down * scale`, read by running the adapter on the identity), in fp32, then `dtype`."""
    device = next(model.parameters()).device
    twin = QwenImage21DiT(model.config, device=device, dtype=dtype).eval()
    twin.compute_dtype = dtype
    sources = dict(model.named_modules())
    with torch.no_grad():
        for name, module in twin.named_modules():
            source = sources[name]
            if isinstance(module, Linear):
                rows = source.out_features
                weight = source.weight_rows(0, rows, torch.float32).clone()
                if source.adapters:
                    eye = torch.eye(weight.shape[1], device=device, dtype=torch.float32)
                    for adapter in source.adapters:
                        term = adapter(eye, 0, rows)
                        if term is not None:
                            weight += term.float().T
                module.weight.copy_(weight)
            else:
                for key, param in module.named_parameters(recurse=False):
                    param.copy_(getattr(source, key))
    return twin


def write_files(folder: Path, ours: QwenImage21DiT, config) -> dict[str, tuple[Path, str]]:
    """{name: (file, what it is)} of the model in every format."""
    tensors = {key: value.float().cpu() for key, value in variants.comfy_tensors(ours).items()}
    files = {"bf16 file": (folder / "qwen_image_2.1_bf16.safetensors", "bf16")}
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(files["bf16 file"][0]))
    for kind in KITCHEN:
        path = variants.quantized_file(tensors, kind, folder / f"qwen_image_2.1_{kind}.safetensors")
        files[kind] = (path, "comfy-kitchen")
    for qtype in GGUF:
        files[qtype] = (variants.write_gguf(folder / f"qwen_image_2.1-{qtype}.gguf", tensors, qtype), "GGUF")
    return files


def run(check: Check) -> list[dict]:
    reference, ours = check.pair(check.format_layers)
    _, prefix, target, kwargs = check.case(1)
    weight_dtype = "bf16" if check.dtype == torch.bfloat16 else "fp32"
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        files = write_files(folder, ours, ours.config)
        lora_file = variants.write_lora(folder / "lora.safetensors", ours.config, LORA_RANK)
        with torch.inference_mode():
            our_prefill, our_step, their_prefill, their_step = dit_calls(check, reference, ours, prefix, target, kwargs)
            base = {"prefill": check.median_ms(their_prefill), "cached": check.median_ms(their_step)}
            our_prefill()  # the caches the two cached steps read (diffusers' is filled by its timed prefills)
            drift = rel_diff(our_step(), their_step())
            rows.append({"model": "diffusers bf16", "kind": "-", "gemm": "-", "prefill_ms": base["prefill"],
                         "cached_ms": base["cached"], "rel_diff_vs_twin": None,
                         "note": f"ours vs diffusers {drift:.2e}"})
            models = [(name, kind, lambda path=path: load_dit(path, weight_dtype=weight_dtype, device=check.device))
                      for name, (path, kind) in files.items()]
            models.append((f"LoRA r{LORA_RANK} on the bf16 file", "LoRA",
                           lambda: apply_lora(load_dit(files["bf16 file"][0], weight_dtype=weight_dtype,
                                                       device=check.device), lora_file, 1.0)))
            for name, kind, load in models:
                try:
                    rows.append(time_model(check, name, kind, load(), prefix, target))
                except Exception as error:  # one format failing leaves the others' rows
                    rows.append({"model": name, "kind": kind, "gemm": "FAILED", "prefill_ms": None, "cached_ms": None,
                                 "rel_diff_vs_twin": None, "note": f"{type(error).__name__}: {error}"[:200]})
                if check.cuda:
                    torch.cuda.empty_cache()
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    table(f"formats: each model vs its dequantized twin, and its speed next to diffusers' bf16 "
          f"({check.format_layers} blocks at width {ours.config.width}, 1 reference, {check.size}x{check.size}, ms)",
          ["model", "file", "GEMM", "prefill ms", "cached step ms", "cached / diffusers bf16",
           "rel. diff vs its twin (cached step)", "note"],
          [[r["model"], r["kind"], r["gemm"], fmt(r["prefill_ms"], ".2f"), fmt(r["cached_ms"], ".2f"),
            "-" if r["cached_ms"] is None else f"{r['cached_ms'] / base['cached']:.3f}",
            fmt(r["rel_diff_vs_twin"], ".2e"), r["note"]] for r in rows])
    return rows


def time_model(check: Check, name: str, kind: str, model, prefix, target) -> dict:
    t = torch.tensor([0.8], device=check.device)
    cache = PrefixKVCache()

    def prefill():
        return model(target, t, [prefix], cache=cache, mode="prefill")

    def step():
        return model(target, t, [prefix], cache=cache, mode="cached")

    prefill_ms = check.median_ms(prefill)
    cached_ms = check.median_ms(step)
    got = step()
    twin = dense_twin(model, check.dtype)
    twin_cache = PrefixKVCache()
    twin(target, t, [prefix], cache=twin_cache, mode="prefill")
    expected = twin(target, t, [prefix], cache=twin_cache, mode="cached")
    gemm = ", ".join(f"{f} {m}" for f, m in gemm_summary(model, check.device).items()) or "dense"
    if kind == "GGUF":
        gemm = f"dequantized per layer ({check.dtype})".replace("torch.", "")
    return {"model": name, "kind": kind, "gemm": gemm, "prefill_ms": prefill_ms, "cached_ms": cached_ms,
            "rel_diff_vs_twin": rel_diff(got, expected), "note": ""}
