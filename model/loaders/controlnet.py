"""Load the Qwen-Image 2.1 Fun ControlNet Union (a ComfyUI `model_patches` file) and apply it to a model copy.

Three layouts, told apart by their keys (docs/controlnet.md): alibaba-pai's original (split MLP `gate_layer` /
`proj`), Comfy-Org's bf16 repack (fused `gate_up`, gate first) and Comfy-Org's int8 ConvRot (the same keys, each
linear weight int8 with a per-row `weight_scale` and a `comfy_quant` description, run through `kitchen.py` as the
quantized DiT is). Keys are bare: `control_img_in.*` and `control_blocks.N.*`. The other patches of that folder
(Z-Image's Fun ControlNet, Qwen-Image 1.x's DiffSynth ControlNet, USO, Uni3C, ...) are refused by name.

As with the DiT, everything is checked from the headers before a weight is read, the net is built on the meta
device and each parameter is filled from the file, and nothing half-loaded survives an error.
"""

from pathlib import Path

import torch

from ..layers.kitchen import fp8_rowwise_linears
from ..transformer.controlnet import CONTROL_IN_DIM, ControlNetConfig, ControlPatch, FunControlNet
from .checkpoint import (
    FILE_DTYPES,
    FLOAT_DTYPES,
    CheckpointError,
    WeightReader,
    check_dtypes,
    choose_dtype,
    count_indexed,
    find_weights,
    identify_checkpoint,
    quantization_marker,
    read_weight_headers,
)
from .dit import FP8_FAST, FP8_PARAMS
from .lora import clone_tree

DETECT_KEYS = ("control_img_in.weight", "control_blocks.0.img_mlp.out.weight")  # what ComfyUI's loader tests
RELEASED = "qwen_image_2.1_fun_controlnet_union_bf16.safetensors (or its _int8_convrot twin)"
#: A key of each other model patch ComfyUI's ModelPatchLoader knows, and what that patch is.
OTHER_PATCHES = (
    ("control_all_x_embedder.", "the Z-Image Fun ControlNet (for Z-Image, not Qwen-Image 2.1)"),
    ("controlnet_blocks.0.y_rms.weight", "a Qwen-Image 1.x DiffSynth block-wise ControlNet (not Qwen-Image 2.1)"),
    ("feature_embedder.mid_layer_norm.bias", "the USO style projector (for Flux)"),
    ("controlnet_patch_embedding.weight", "the Uni3C ControlNet (for Wan video)"),
    ("lllite_conditioning1.conv1.weight", "an Anima ControlNet-LLLite"),
    ("audio_proj.proj1.weight", "the MultiTalk audio patch (for Wan video)"),
    ("attention_pooler.query_tokens", "an LTX duration head"),
    ("control_model.input_hint_block.0.weight", "SUPIR (for SDXL)"),
)


def _what_else(keys) -> str:
    for needle, what in OTHER_PATCHES:
        if any(needle in key for key in keys):
            return what
    return identify_checkpoint(keys)


def infer_controlnet_config(tensors: dict, where: str) -> tuple[ControlNetConfig, bool]:
    """(config, fused MLP?) from the shapes, as ComfyUI's loader reads them; a CheckpointError for another file."""
    if not all(key in tensors for key in DETECT_KEYS):
        raise CheckpointError(f"{where} is {_what_else(tensors)}, not the Qwen-Image 2.1 Fun ControlNet Union. Put "
                              f"{RELEASED} in models/model_patches.")
    width, in_dim = tensors["control_img_in.weight"].shape
    if in_dim != CONTROL_IN_DIM:
        raise CheckpointError(f"{where}: control_img_in takes {in_dim} channels; the Qwen-Image 2.1 Fun ControlNet "
                              f"takes {CONTROL_IN_DIM} (64 control + 1 mask + 64 inpaint latent channels).")
    fused = "control_blocks.0.img_mlp.gate_up.weight" in tensors
    if fused:
        hidden = tensors["control_blocks.0.img_mlp.gate_up.weight"].shape[0] // 2
    elif "control_blocks.0.img_mlp.proj.weight" in tensors:
        hidden = tensors["control_blocks.0.img_mlp.proj.weight"].shape[0]
    else:
        raise CheckpointError(f"{where}: control block 0 has neither img_mlp.gate_up nor img_mlp.gate_layer/proj; the "
                              "file is incomplete. Download it again.")
    blocks = 0
    while f"control_blocks.{blocks}.after_proj.weight" in tensors:
        blocks += 1
    head_dim = tensors.get("control_blocks.0.attn.norm_q.weight")
    if blocks == 0 or head_dim is None:
        raise CheckpointError(f"{where}: no control block with an after_proj and attn.norm_q; the file is incomplete.")
    head_dim = head_dim.shape[0]
    if width % head_dim or hidden % width:
        raise CheckpointError(f"{where}: width {width}, head size {head_dim} and MLP size {hidden} do not fit "
                              "together.")
    if count_indexed(tensors, r"control_blocks\.(\d+)\.") != blocks:
        raise CheckpointError(f"{where}: control blocks are numbered with gaps (after_proj found for {blocks}); the "
                              "file is damaged. Download it again.")
    return ControlNetConfig(num_blocks=blocks, num_heads=width // head_dim, head_dim=head_dim,
                            mlp_ratio=hidden // width), fused


def controlnet_plan(config: ControlNetConfig, fused: bool) -> dict[str, list[str]]:
    """Our parameter name -> the file keys concatenated (along rows) to make it."""
    plan = {"control_img_in.weight": ["control_img_in.weight"], "control_img_in_bias": ["control_img_in.bias"]}
    for i in range(config.num_blocks):
        src, dst = f"control_blocks.{i}.", f"blocks.{i}."
        plan[dst + "qkv.weight"] = [src + f"attn.to_{x}.weight" for x in "qkv"]
        plan[dst + "norm_q"] = [src + "attn.norm_q.weight"]
        plan[dst + "norm_k"] = [src + "attn.norm_k.weight"]
        plan[dst + "to_out.weight"] = [src + "attn.to_out.0.weight"]
        plan[dst + "gate_up.weight"] = ([src + "img_mlp.gate_up.weight"] if fused
                                        else [src + "img_mlp.gate_layer.weight", src + "img_mlp.proj.weight"])
        plan[dst + "down.weight"] = [src + "img_mlp.out.weight"]
        for proj in ("after_proj",) + (("before_proj",) if i == 0 else ()):
            plan[dst + proj + ".weight"] = [src + proj + ".weight"]
            plan[dst + proj + "_bias"] = [src + proj + ".bias"]
    return plan


def _check_shapes(plan, tensors, config: ControlNetConfig, where: str) -> None:
    needed = {key for keys in plan.values() for key in keys}
    missing, unexpected = sorted(needed - tensors.keys()), sorted(tensors.keys() - needed)
    if missing:
        raise CheckpointError(f"{where}: {len(missing)} control net tensors are missing (e.g. "
                              f"{', '.join(missing[:3])}); the file is incomplete. Download it again.")
    if unexpected:
        raise CheckpointError(f"{where}: {len(unexpected)} tensors the Fun ControlNet does not have (e.g. "
                              f"{', '.join(unexpected[:3])}); this is not the Qwen-Image 2.1 Fun ControlNet Union.")
    with torch.device("meta"):
        reference = FunControlNet(config).state_dict()
    for name, keys in plan.items():
        got = (sum(tensors[k].shape[0] for k in keys), *tensors[keys[0]].shape[1:])
        if got != tuple(reference[name].shape):
            raise CheckpointError(f"{where}: {keys[0]} has shape {list(tensors[keys[0]].shape)}, expected rows of "
                                  f"{list(reference[name].shape)}.")


def load_controlnet(path, weight_dtype: str = "default", device="cpu") -> FunControlNet:
    """Load a Fun ControlNet Union file (any of the three layouts); `net.source` is its name, `net.layout` which."""
    weights = find_weights(path, "model_patches", "a Fun ControlNet .safetensors file")
    where = Path(weights.path).name
    tensors, metadata = read_weight_headers(weights)
    quant = None
    if quantization_marker(tensors, metadata) is not None:
        from .kitchen import plan_quantization  # comfy-kitchen is imported only for quantized files

        with WeightReader(tensors) as blobs:
            quant = plan_quantization(tensors, metadata, blobs.read, where,
                                      "qwen_image_2.1_fun_controlnet_union_bf16.safetensors")
        logical = quant.logical(tensors)
    else:
        logical = tensors
    config, fused = infer_controlnet_config(logical, where)
    plan = controlnet_plan(config, fused)
    _check_shapes(plan, logical, config, where)
    check_dtypes(logical, {key: tuple(FILE_DTYPES) for keys in plan.values() for key in keys}, where, "control net")
    fast = weight_dtype == FP8_FAST  # its blocks' linears in fp8 rowwise, as the DiT's (loaders/dit.py)
    if fast and quant is not None:
        raise ValueError(f"{where} is already quantized; weight_dtype {FP8_FAST} applies to the bf16 file only. Use "
                         "default, bf16, fp16 or fp32.")
    compute = choose_dtype("bf16" if fast else weight_dtype, logical["control_img_in.weight"].dtype, FLOAT_DTYPES,
                           "control net")
    device = torch.device(device)
    with torch.device("meta"):
        net = FunControlNet(config, dtype=compute)
    try:
        if quant is not None:
            quant.check_targets(net, plan)
        with WeightReader(tensors) as reader:
            for name, keys in plan.items():
                if quant is not None and quant.fill_linear(net, name, keys, reader.read, compute, device):
                    continue
                module_name, _, attr = name.rpartition(".")
                module = net.get_submodule(module_name) if module_name else net
                target = torch.empty(getattr(module, attr).shape, dtype=compute, device=device)
                row = 0
                for key in keys:
                    part = reader.read(key)
                    target[row : row + part.shape[0]].copy_(part)
                    row += part.shape[0]
                    del part
                setattr(module, attr, torch.nn.Parameter(target, requires_grad=False))
        if fast:
            fp8_rowwise_linears(net, FP8_PARAMS.fullmatch)
    except BaseException:
        del net  # nothing half-loaded stays alive, also on KeyboardInterrupt
        raise
    net.compute_dtype = compute
    net.source = where
    net.layout = ("comfy int8" if quant is not None else "comfy") if fused else "alibaba"
    return net.eval()


def attach_controlnet(model, net: FunControlNet, hint_for, strength: float = 1.0, start_percent: float = 0.0,
                      end_percent: float = 1.0, inputs: tuple[str, ...] = ("control_image",)):
    """(`model` with the control net's blocks as a new model object sharing every weight with `model`, which is never
    changed; the `ControlPatch` that runs them), or (`model`, None) for strength 0 or no input, as ComfyUI core does.
    `hint_for(grid)` builds the control latent `(h*w, 129)` for a target grid. The mechanism only:
    `features/control.apply_controlnet` records the patch on the copy's options record."""
    strength, start_percent, end_percent = float(strength), float(start_percent), float(end_percent)
    if not all(map(lambda v: v == v and abs(v) != float("inf"), (strength, start_percent, end_percent))):
        raise ValueError("strength, start_percent and end_percent must be finite numbers.")
    if not 0.0 <= start_percent <= end_percent <= 1.0:
        raise ValueError(f"start_percent {start_percent} and end_percent {end_percent}: use 0 <= start <= end <= 1 "
                         "(the share of the schedule, from its first step, where the control applies).")
    if strength == 0.0 or not inputs:
        return model, None
    if "control_net" in model._modules:
        raise ValueError("this model already has a Fun ControlNet applied; apply one per model (the control net "
                         "takes a control image and an inpaint mask together).")
    layers = net.check_fits(model.config, net.source or "the control net")
    new = clone_tree(model)
    stream_net = net
    if model.blocks[0].compiled is not None:  # the control blocks run the model's compiled forward (compiled.py);
        stream_net = clone_tree(net)  # set on a copy: the loaded net may also serve an uncompiled model
        for block in stream_net.blocks:
            block.compiled = model.blocks[0].compiled
    new.add_module("control_net", stream_net)  # counted, moved and offloaded with the model (the copy's own child list)
    new.manager = None  # the host's memory handle (ComfyUI's patcher) belongs to the original object
    # prefix caches are keyed by the model the control was applied to (kept_entries.cache_owner): a new control image
    # reuses its prefix, and the steps outside the window share plain caches with that model's runs
    new.cache_base = model
    patch = ControlPatch(net, strength, start_percent, end_percent, hint_for, layers, name=net.source or "",
                         inputs=tuple(inputs))
    return new, patch
