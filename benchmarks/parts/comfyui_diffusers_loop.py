"""A benchmark-only ComfyUI custom node: diffusers' QwenImage21 denoising loop inside the same server as ours.

benchmarks/comfyui.py (its `speed` question) copies this file into the server's custom_nodes/ (never shipped with the
pack), so diffusers' loop runs in the same process, thread pool, executor and timing as our sampler node: the
transformer with the weights of `weights` (diffusers' layout), `kv_cache_mode` extract on the first step and cached
after it, and FlowMatchEulerDiscreteScheduler's step, as QwenImage21Pipeline runs them, at the token counts of our
run (one reference of `grid` x `grid` latent tokens, `prefix_tokens` prefix tokens in all, a `grid` x `grid` target).
"""

import json
from pathlib import Path

import numpy as np
import torch

_MODELS = {}


def _model(weights: str):
    """The transformer for a weights file (config in `<file>.json` beside it), loaded once per server."""
    if weights not in _MODELS:
        from diffusers import QwenImage21Transformer2DModel
        from safetensors.torch import load_file

        config = json.loads(Path(weights + ".json").read_text())
        model = QwenImage21Transformer2DModel(**config).eval()
        model.load_state_dict(load_file(weights))
        _MODELS[weights] = model
    return _MODELS[weights]


class QI21BenchDiffusersLoop:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "weights": ("STRING", {"default": ""}),
            "steps": ("INT", {"default": 2, "min": 1, "max": 200}),
            "prefix_tokens": ("INT", {"default": 1100, "min": 1, "max": 100000}),
            "grid": ("INT", {"default": 32, "min": 2, "max": 256}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31}),
        }}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "run"
    CATEGORY = "qi21 benchmark"

    def run(self, weights, steps, prefix_tokens, grid, seed):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

        model = _model(weights)
        generator = torch.Generator().manual_seed(seed)
        tokens = grid * grid
        text_tokens = prefix_tokens - tokens
        slots = [False] * min(20, text_tokens) + [True] * (tokens // 4)  # the reference's vision slots
        slots += [False] * (text_tokens - slots.count(False))
        context = torch.randn(1, len(slots), model.config.context_in_dim, generator=generator)
        img_mask = torch.cat([torch.tensor(slots), torch.ones(tokens // 4, dtype=torch.bool)])[None]
        reference = torch.randn(1, tokens, model.config.in_channels, generator=generator)
        latents = torch.randn(1, tokens, model.config.in_channels, generator=generator)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps), device="cpu")
        cache = QwenImage21KVCache(len(model.transformer_blocks))
        with torch.inference_mode():
            for i, t in enumerate(scheduler.timesteps):
                out = model(hidden_states=torch.cat([reference, latents], 1), timestep=t.expand(1) / 1000,
                            encoder_hidden_states=context, img_shapes=[[(1, grid, grid), (1, grid, grid)]],
                            img_mask=img_mask, kv_cache=cache, kv_cache_mode="extract" if i == 0 else "cached",
                            return_dict=False)[0]
                latents = scheduler.step(out[:, -tokens:], t, latents, return_dict=False)[0]
        return ({"samples": latents.transpose(1, 2).reshape(1, -1, grid, grid).float()},)


NODE_CLASS_MAPPINGS = {"QI21BenchDiffusersLoop": QI21BenchDiffusersLoop}
