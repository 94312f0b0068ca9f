"""Reference loops written out on diffusers' own transformer and scheduler: the oracle for the sampling
tests and the baseline of the sampling benchmark. This is the denoising loop of diffusers'
QwenImage21Pipeline with the encoders left out (embeddings, reference latents and noise are given)."""

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

# The released Base scheduler_config.json, and Turbo's (no dynamic shift, no terminal stretch).
BASE_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                      base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                      time_shift_type="exponential")
TURBO_SCHEDULER = dict(BASE_SCHEDULER, use_dynamic_shifting=False, shift_terminal=None)


def diffusers_loop(transformer, cond, noise, grid, scheduler_config, negative=None, cfg=1.0, use_cache=True,
                   record=None, caches=None):
    """Denoise `noise` `(B, 64, h, w)` along `grid` as the reference pipeline does; returns `(B, 64, h, w)`.

    `cond`/`negative` are our `Conditioning`s, turned into the reference's inputs (states, image-slot mask with
    the target's slots appended, img_shapes). `record` collects the packed latents entering every step,
    `caches` the reference's KV caches (to measure them).
    """
    batch, _, height, width = noise.shape
    tokens = height * width
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    config = scheduler.config
    mu = config.base_shift + (config.max_shift - config.base_shift) * (tokens - config.base_image_seq_len) / (
        config.max_image_seq_len - config.base_image_seq_len)
    scheduler.set_timesteps(sigmas=np.array(grid, dtype=np.float64), mu=mu)
    latents = noise.flatten(2).transpose(1, 2)
    img_shapes = [[(1, h, w) for h, w in cond.ref_shapes] + [(1, height, width)]] * batch
    layers = len(transformer.transformer_blocks)

    def branch(c):
        mask = torch.cat([c.image_slots, torch.ones(tokens // 4, dtype=torch.bool)])[None].expand(batch, -1)
        return dict(encoder_hidden_states=c.text[None].expand(batch, -1, -1), img_mask=mask, img_shapes=img_shapes)

    branches = [(branch(cond), QwenImage21KVCache(layers))]
    if negative is not None:
        branches.append((branch(negative), QwenImage21KVCache(layers)))
    if caches is not None:
        caches.extend(cache for _, cache in branches)
    for i, t in enumerate(scheduler.timesteps):
        if record is not None:
            record.append(latents)
        x = latents if cond.references is None else torch.cat([cond.references[None].expand(batch, -1, -1), latents], 1)
        preds = []
        for kwargs, cache in branches:
            mode = ("extract" if i == 0 else "cached") if use_cache else None
            out = transformer(hidden_states=x, timestep=t.expand(batch).to(x.dtype) / 1000, return_dict=False,
                              kv_cache=cache if use_cache else None, kv_cache_mode=mode, **kwargs)[0]
            preds.append(out[:, -tokens:])
        v = preds[0] if len(preds) == 1 else preds[1] + cfg * (preds[0] - preds[1])
        latents = scheduler.step(v, t, latents, return_dict=False)[0]
    return latents.transpose(1, 2).reshape(batch, 64, height, width)


def reference_cache_bytes(cache: QwenImage21KVCache) -> int:
    return sum(layer.k.numel() * layer.k.element_size() * 2 for layer in cache.layer_caches if layer.k is not None)
