"""What the Ulysses tests send to their CPU ranks: a tiny model builder and jobs, importable in a spawned worker
(which registers the pack as `qi21` and has tests/ on its path, as the coordinator does). Only torch and the pack."""

import torch
import torch.distributed as dist

from qi21.model.encoders.conditioning import Conditioning
from qi21.model.parallel.worker import by_value
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT

#: 4 heads of 32 (so 2 and 4 ranks split them, 3 do not), width 128, text width 48
CONFIG = DiTConfig(num_layers=2, num_heads=4, head_dim=32, context_in_dim=48, mlp_ratio=3, axes_dims_rope=(4, 14, 14))


def build_tiny(device="cpu", seed: int = 0) -> QwenImage21DiT:
    """A random fp32 DiT of `CONFIG` on `device`; the same seed gives the same weights in every process."""
    generator = torch.Generator().manual_seed(seed)
    model = QwenImage21DiT(CONFIG)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1:  # norm scales around 1 (the zero-centred text norm stores scale - 1)
                param.copy_(0.2 * noise + (0.0 if "text_norm" in name else 1.0))
            else:
                param.copy_(noise / param.shape[1] ** 0.5)
    return model.to(device).eval()


def prompt(*items) -> Conditioning:
    """A conditioning from items: `("t", n, seed)` n text rows drawn from `seed` (the same seed gives the same
    rows, as the encoder gives the same states to the same leading tokens) or `((h, w), seed)` a reference of that
    latent size. Shared with tests/test_prefix_reuse.py."""
    text, slots, refs, shapes = [], [], [], []
    for item in items:
        if item[0] == "t":
            _, count, seed = item
            text.append(torch.randn(count, 48, generator=torch.Generator().manual_seed(seed)))
            slots += [False] * count
        else:
            (h, w), seed = item
            generator = torch.Generator().manual_seed(seed)
            text.append(torch.randn(h * w // 4, 48, generator=generator))
            refs.append(torch.randn(h * w, 64, generator=generator))
            slots += [True] * (h * w // 4)
            shapes.append((h, w))
    return Conditioning(text=torch.cat(text), image_slots=torch.tensor(slots),
                        references=torch.cat(refs) if refs else None, ref_shapes=tuple(shapes))


def cached_step_traffic(state, prefixes, target, sample_prefix=None) -> dict:
    """A prefill and one cached step of the rank's model; what `dist.all_to_all_single` sent to other ranks during
    the cached step (counted here, around torch's own function), and the cache's bytes."""
    model = state.model
    cache = model.parallel.new_cache()
    sent, calls = [0], [0]
    original = dist.all_to_all_single

    def counting(output, send, *args, **kwargs):
        calls[0] += 1
        sent[0] += send.numel() * send.element_size() * (dist.get_world_size() - 1) // dist.get_world_size()
        return original(output, send, *args, **kwargs)

    with torch.no_grad():
        model(target, torch.tensor([0.9]), prefixes, sample_prefix, cache=cache, mode="prefill")
        dist.all_to_all_single = counting
        try:
            out = model(target, torch.tensor([0.5]), prefixes, sample_prefix, cache=cache, mode="cached")
        finally:
            dist.all_to_all_single = original
    return {"sent": sent[0], "calls": calls[0], "cache_bytes": cache.nbytes, "out": by_value(out)}
