"""Tiny Fun ControlNet Union files in the three released layouts, and a tiny 4-block DiT to apply them to.

The control net has 2 blocks for the DiT's 4 (injection after base blocks 0 and 2, as 16 for 32), width 64 (2
heads of 32), MLP ratio 3 and the real 129 input channels. Every weight is random, biases and after_proj included
(the release initialises after_proj near zero; a zero skip would hide a wrong one).
"""

import json

import torch
from diffusers import QwenImage21Transformer2DModel
from safetensors.torch import save_file

from dit_fixtures import TINY
from qi21.model.loaders.dit_keys import convert_state_dict
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT

BLOCKS, WIDTH, HEAD_DIM, HIDDEN, IN_DIM = 2, 64, 32, 192, 129
GROUP = 64  # ConvRot block: a power of 4 dividing the 64- and 192-wide inputs


def tiny_pair4(seed: int = 0):
    """(diffusers transformer, our DiT) with 4 blocks and the same random fp32 weights."""
    torch.manual_seed(seed)
    reference = QwenImage21Transformer2DModel(**{**TINY, "num_layers": 4}).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.ndim == 1:
                param.copy_(0.2 * torch.randn_like(param) + (0.0 if "text_norm" in name else 1.0))
            else:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    config = DiTConfig(num_layers=4, num_heads=2, head_dim=32, context_in_dim=48, mlp_ratio=3,
                       axes_dims_rope=(4, 14, 14))
    ours = QwenImage21DiT(config)
    ours.load_state_dict(convert_state_dict(reference.state_dict()))
    return reference, ours.eval()


def alibaba_state(seed: int = 7, skip_scale: float = 0.5) -> dict:
    """The original layout (split MLP), fp32."""
    g = torch.Generator().manual_seed(seed)

    def w(rows, cols, scale=1.0):
        return scale * torch.randn(rows, cols, generator=g) / cols ** 0.5

    def b(n):
        return 0.1 * torch.randn(n, generator=g)

    state = {"control_img_in.weight": w(WIDTH, IN_DIM), "control_img_in.bias": b(WIDTH)}
    for i in range(BLOCKS):
        p = f"control_blocks.{i}."
        for x in "qkv":
            state[p + f"attn.to_{x}.weight"] = w(WIDTH, WIDTH)
        state[p + "attn.to_out.0.weight"] = w(WIDTH, WIDTH)
        state[p + "attn.norm_q.weight"] = 1 + 0.2 * torch.randn(HEAD_DIM, generator=g)
        state[p + "attn.norm_k.weight"] = 1 + 0.2 * torch.randn(HEAD_DIM, generator=g)
        state[p + "img_mlp.gate_layer.weight"] = w(HIDDEN, WIDTH)
        state[p + "img_mlp.proj.weight"] = w(HIDDEN, WIDTH)
        state[p + "img_mlp.out.weight"] = w(WIDTH, HIDDEN)
        state[p + "after_proj.weight"] = w(WIDTH, WIDTH, skip_scale)
        state[p + "after_proj.bias"] = b(WIDTH)
        if i == 0:
            state[p + "before_proj.weight"] = w(WIDTH, WIDTH)
            state[p + "before_proj.bias"] = b(WIDTH)
    return state


def fused_state(state: dict) -> dict:
    """Comfy-Org's layout: `img_mlp.gate_up` = [gate_layer; proj]."""
    out = {}
    for key, value in state.items():
        if key.endswith("img_mlp.proj.weight"):
            continue
        if key.endswith("img_mlp.gate_layer.weight"):
            prefix = key[: -len("gate_layer.weight")]
            out[prefix + "gate_up.weight"] = torch.cat([value, state[prefix + "proj.weight"]])
        else:
            out[key] = value
    return out


def is_linear_weight(key: str) -> bool:
    return key.startswith("control_blocks.") and key.endswith(".weight") and "norm_" not in key


def int8_state(state: dict) -> tuple[dict, dict]:
    """Comfy-Org's int8 ConvRot layout by comfy-kitchen's quantizer: (file tensors, the dequantized fp32 twin)."""
    from comfy_kitchen.tensor import TensorWiseINT8Layout

    out, twin = {}, {}
    for key, value in fused_state(state).items():
        if not is_linear_weight(key):
            out[key] = twin[key] = value
            continue
        q, params = TensorWiseINT8Layout.quantize(value, is_weight=True, per_channel=True, convrot=True,
                                                  convrot_groupsize=GROUP)
        layer = key[: -len(".weight")]
        out[key], out[layer + ".weight_scale"] = q.contiguous(), params.scale.contiguous()
        description = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": GROUP}
        out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(description).encode()), dtype=torch.uint8)
        twin[key] = TensorWiseINT8Layout.dequantize(q, params).float()
    return out, twin


def write(path, state: dict):
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    return path
