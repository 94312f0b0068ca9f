"""Tiny random Qwen-Image 2.1 DiTs, loaded identically into diffusers (the oracle) and into ours.

Shapes keep the real model's structure at toy size: 3 blocks, 2 heads of 32 (RoPE axes 4/14/14 split the
head in the released 16/56/56 ratio), width 64, text width 48, SwiGLU ratio 3. Every weight, norm scales included,
is random, so a mis-mapped or mis-applied tensor cannot hide behind an identity initialisation.
"""

from dataclasses import dataclass

import torch
from diffusers import QwenImage21Transformer2DModel

from qi21.model.loaders.dit_keys import convert_state_dict
from qi21.model.transformer.dit import DiTConfig, PrefixInputs, QwenImage21DiT
from qi21.model.transformer.layout import build_layout

TINY = dict(num_layers=3, num_attention_heads=2, attention_head_dim=32, context_in_dim=48, mlp_ratio=3,
            axes_dims_rope=(4, 14, 14), in_channels=64, out_channels=64)


def unit_scale_dit(config: DiTConfig, seed: int) -> QwenImage21DiT:
    """Our DiT alone with finite, unit-scale random weights (norm scales around 1), seeded, in eval mode."""
    torch.manual_seed(seed)
    dit = QwenImage21DiT(config)
    with torch.no_grad():
        for param in dit.parameters():
            if param.ndim == 1:
                param.copy_(0.2 * torch.randn_like(param) + 1.0)
            else:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    return dit.eval()


def tiny_pair(seed: int = 0, causal_condition: bool = True):
    """(diffusers model, our model) with the same random fp32 weights."""
    torch.manual_seed(seed)
    reference = QwenImage21Transformer2DModel(**TINY, causal_condition=causal_condition).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.ndim == 1:  # norm scales: around 1 (the zero-centred text norm stores scale - 1)
                param.copy_(0.2 * torch.randn_like(param) + (0.0 if "text_norm" in name else 1.0))
            else:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    config = DiTConfig(num_layers=3, num_heads=2, head_dim=32, context_in_dim=48, mlp_ratio=3,
                       axes_dims_rope=(4, 14, 14), causal_condition=causal_condition)
    ours = QwenImage21DiT(config)
    ours.load_state_dict(convert_state_dict(reference.state_dict()))
    return reference, ours.eval()


def make_case(ref_shapes, target_shape, text_runs, batch=1, pad=(), seed=1, context_dim=48):
    """Inputs for one forward in the reference's form, and the same as our prefixes.

    `text_runs` gives the text tokens before each reference and after the last (len(ref_shapes) + 1 runs;
    a 0 between two references makes them adjacent). `pad[b]` right-pads sample b's prompt by that many.
    """
    generator = torch.Generator().manual_seed(seed)
    slots = []
    for run, shape in zip(text_runs, list(ref_shapes) + [None]):
        slots += [False] * run
        if shape is not None:
            slots += [True] * (shape[0] * shape[1] // 4)
    slot_mask = torch.tensor(slots)
    length = len(slots)
    target_tokens = target_shape[0] * target_shape[1]
    ref_tokens = sum(h * w for h, w in ref_shapes)
    text = torch.randn(batch, length, context_dim, generator=generator)
    latents = torch.randn(batch, ref_tokens + target_tokens, 64, generator=generator)
    latents[:, :ref_tokens] = latents[:1, :ref_tokens]  # references are shared by the batch
    text_mask = torch.ones(batch, length, dtype=torch.bool)
    for b, count in enumerate(pad):
        if count:
            text_mask[b, length - count :] = False
    reference_kwargs = dict(
        hidden_states=latents,
        encoder_hidden_states=text,
        encoder_hidden_states_mask=text_mask if pad else None,
        img_shapes=[[(1, h, w) for h, w in ref_shapes] + [(1, *target_shape)]] * batch,
        img_mask=torch.cat([slot_mask, torch.ones(target_tokens // 4, dtype=torch.bool)])[None].expand(batch, -1),
    )
    prefixes = [
        PrefixInputs(
            layout=build_layout(slot_mask, ref_shapes, target_shape, text_valid=text_mask[b] if pad else None),
            text=text[b],
            references=latents[b, :ref_tokens] if ref_tokens else None,
        )
        for b in range(batch)
    ]
    return reference_kwargs, prefixes, latents[:, ref_tokens:]


@dataclass(frozen=True)
class Case:
    """A named forward for `make_case`: reference latent shapes, target shape, text runs around the references,
    batch and right padding per sample."""
    refs: tuple
    target: tuple
    runs: tuple
    batch: int = 1
    pad: tuple = ()

    def make(self, **kwargs):
        return make_case(self.refs, self.target, self.runs, batch=self.batch, pad=self.pad, **kwargs)


def reference_velocity(reference, kwargs, timestep, **extra):
    out = reference(timestep=timestep, return_dict=False, **kwargs, **extra)[0]
    target_tokens = kwargs["img_shapes"][0][-1][1] * kwargs["img_shapes"][0][-1][2]
    return out[:, -target_tokens:]
