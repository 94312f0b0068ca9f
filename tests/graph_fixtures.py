"""Helpers shared by the reliability tests: the tiny model set behind the nodes, loaded in fp32 (CPUs without
native bf16 run bf16 matmuls and convolutions 10-20x slower), conditioning built without the text encoder, and
what "nothing left behind" means (no live models, no filled prefix cache, no extra tensor bytes)."""

import gc
import os

import torch

from qi21.demo.tiny_checkpoints import write_tiny_checkpoints
from qi21.model.conditioning import Conditioning
from qi21.model.dit import QwenImage21DiT
from qi21.model.prefix_cache import PrefixKVCache
from qi21.model.vae import QwenImage21VAE
from qi21.nodes import bridge
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader

SINGLE = {"model": "qwen_image_2.1_bf16.safetensors", "turbo": "qwen_image_2.1_turbo_bf16.safetensors",
          "text_encoder": "qwen3vl_8b_bf16.safetensors", "vae": "qwen_image_2.1_vae_bf16.safetensors"}
TEXT_WIDTH = 16  # the tiny text encoder's hidden size = the tiny DiT's context width


def models_root(tmp_path_factory):
    """Write the tiny set and point the loaders at it (callers reset with `bridge.set_models_root(None)`)."""
    root = tmp_path_factory.mktemp("models")
    write_tiny_checkpoints(root)
    bridge.set_models_root(root)
    return root


def load(*names: str, dtype: str = "fp32") -> dict:
    """The named components ("model", "turbo", "text_encoder", "vae") through their loader nodes."""
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


def live_models() -> int:
    """Our DiT/VAE modules and transformers' Qwen3-VL models still referenced anywhere."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    kinds = (QwenImage21DiT, QwenImage21VAE, Qwen3VLModel)
    gc.collect()
    return sum(issubclass(type(o), kinds) for o in gc.get_objects())  # type(): some module proxies warn on isinstance


def filled_caches() -> list:
    return leftovers()[0]


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
