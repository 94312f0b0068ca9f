"""Helpers shared by the node-level tests: the tiny model set behind the nodes (the `models_root` fixture of
conftest.py points the loaders at it), loaded in fp32 (CPUs without native bf16 run bf16 matmuls and
convolutions 10-20x slower), conditioning built without the text encoder, and what "nothing left behind" means
(no live models, no filled prefix cache, no extra tensor bytes)."""

import contextlib
import gc
import os

import torch

from qi21.demo import tiny_checkpoints as tiny
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.transformer.dit import QwenImage21DiT
from qi21.model.vae.autoencoder import QwenImage21VAE
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
from qi21.nodes.placement import KEPT_CACHES

#: The tiny set's single files (the released names), by component.
SINGLE = {"model": tiny.DIT_FILE, "turbo": tiny.TURBO_DIT_FILE, "text_encoder": tiny.TEXT_ENCODER_FILE,
          "vae": tiny.VAE_FILE}
TEXT_WIDTH = tiny.TINY_DIT.context_in_dim  # the tiny text encoder's hidden size = the tiny DiT's context width


def load(*names: str, dtype: str = "fp32") -> dict:
    """The named components ("model", "turbo", "text_encoder", "vae") through their loader nodes (from the
    `models_root` fixture's folder)."""
    loaders = {"model": QI21ModelLoader, "turbo": QI21ModelLoader, "text_encoder": QI21TextEncoderLoader,
               "vae": QI21VAELoader}
    return {name: loaders[name].execute(SINGLE[name], dtype)[0] for name in names}


def synthetic_conditioning(prepared=(), text_runs=None, seed=0) -> Conditioning:
    """A Conditioning for prepared references with random text states and random reference latents: the token
    accounting is the real one (one image slot per 32x32 px, 2x2 latent tokens per slot), the values are not."""
    generator = torch.Generator().manual_seed(seed)
    text_runs = text_runs or [3] * (len(prepared) + 1)
    slots = []
    for run, ref in zip(text_runs, list(prepared) + [None]):
        slots += [False] * run
        if ref is not None:
            slots += [True] * ref.vlm_tokens
    shapes = tuple(ref.latent_grid for ref in prepared)
    tokens = sum(h * w for h, w in shapes)
    return Conditioning(
        text=torch.randn(len(slots), TEXT_WIDTH, generator=generator),
        image_slots=torch.tensor(slots, dtype=torch.bool),
        references=torch.randn(tokens, 64, generator=generator) if tokens else None,
        ref_shapes=shapes,
    )


@contextlib.contextmanager
def default_store_budget(budget_bytes: int):
    """The samplers' kept-cache store, emptied and given `budget_bytes` for a while; emptied and given its budget
    back afterwards."""
    saved = KEPT_CACHES.budget_bytes
    KEPT_CACHES.clear()
    KEPT_CACHES.budget_bytes = budget_bytes
    try:
        yield KEPT_CACHES
    finally:
        KEPT_CACHES.budget_bytes = saved
        KEPT_CACHES.clear()


def live_models() -> int:
    """Our DiT/VAE modules and transformers' Qwen3-VL models still referenced anywhere."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    kinds = (QwenImage21DiT, QwenImage21VAE, Qwen3VLModel)
    gc.collect()
    return sum(issubclass(type(o), kinds) for o in gc.get_objects())  # type(): some module proxies warn on isinstance


def filled_caches() -> list:
    """Prefix caches still holding a payload."""
    gc.collect()
    return [obj for obj in gc.get_objects() if type(obj) is PrefixKVCache and obj.filled]


def safe_open_failing_at(read: int, error: type[BaseException], *args):
    """A stand-in for `safetensors.safe_open` whose `read`-th tensor read (counted over every file it opens)
    raises a new `error(*args)`: a load that fails halfway, for tests that monkeypatch it in."""
    from safetensors import safe_open

    reads = {"n": 0}

    class FailingSafeOpen:
        def __init__(self, *open_args, **kwargs):
            self.inner = safe_open(*open_args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            reads["n"] += 1
            if reads["n"] == read:
                raise error(*args)
            return self.inner.get_tensor(key)

    return FailingSafeOpen


def leftovers() -> tuple[list, int]:
    """(prefix caches still holding a payload, bytes of every storage a live tensor holds), in one gc pass;
    storages shared by several tensors count once."""
    gc.collect()
    caches, storages = [], {}
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: some module proxies warn when asked for their class
        if kind is PrefixKVCache and obj.filled:
            caches.append(obj)
        # plain tensors and parameters only: fake and functional tensors that other tests' compiled graphs leave
        # behind hold no memory (and refuse data_ptr)
        elif kind in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return caches, sum(storages.values())


def open_files() -> int:
    return len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))
