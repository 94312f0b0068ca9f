"""The nodes' side of a DiT split over several devices (model/parallel/): the loader's `devices` and `parallel`
inputs, the samplers' run on the workers, and ComfyUI's "free memory" ending them."""

import torch

from ..model.loaders.checkpoint import default_weight_dtype
from ..model.parallel import pool as pools
from ..model.parallel.ranks import check_ranks, file_heads, parse_devices
from ..model.parallel.split import PARALLEL_MODES, SplitModel, load_dit_on
from . import bridge

DEVICES_TOOLTIP = ("Empty (default): the model runs in ComfyUI's process on its device. One device (cuda:1) with "
                   "parallel off runs the DiT in a worker process on that GPU, the text encoder and VAE staying on "
                   "ComfyUI's. A comma list such as cuda:0,cuda:1 with parallel ulysses or cfg splits every step over "
                   "those GPUs: one worker process per GPU, each holding the whole model, kept between prompts. "
                   "cpu,cpu runs two CPU ranks (for tests).")
PARALLEL_TOOLTIP = ("off (default): one device. ulysses: each step's image rows and attention heads are split over "
                    "the devices (N must divide the 32 heads: 2, 4 or 8 GPUs); about 1.0 GiB (N = 2) or 0.75 GiB "
                    "(N = 4) crosses the links per GPU and step at 1024x1024 in bf16, so it pays on NVLink, less on "
                    "PCIe. cfg: two devices, one per prompt of true CFG (cfg > 1 with a negative prompt); only the "
                    "image's velocity crosses (0.5 MiB per step), so it suits slow links, and it gains nothing at "
                    "cfg 1.")


class _PoolToken(torch.nn.Module):
    """What ComfyUI's model manager holds for the worker pool: unloading it ("Unload Models", /free, or room needed on
    the GPU the first worker shares with ComfyUI) ends the workers."""


_token = _PoolToken()


def rank_list(devices: str, parallel: str, path) -> tuple[str, ...]:
    """The checked rank list of the loader's `devices` / `parallel` for the DiT at `path` (() for a model in this
    process): the text, the count (at most `ranks.MAX_RANKS`), each device, the mode's count and the heads rule, all
    before a worker starts (model/parallel/ranks.py); a ValueError naming the input otherwise."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}; got {str(parallel)[:40]!r}.")
    names = parse_devices(devices or "")
    if not names and parallel == "off":
        return ()
    heads = file_heads(path) if parallel == "ulysses" and path is not None else None
    check_ranks(names, parallel, bridge.gpu_count(), heads)
    return names


def rank_problem(devices, parallel, path) -> str | None:
    """`validate_inputs`' check of `devices` / `parallel` (None for a linked value: checked again when the loader
    runs): the prompt is refused before it is queued, so no worker is ever started for it."""
    if devices is None or parallel is None:
        return None
    try:
        rank_list(devices, parallel, path)
    except ValueError as error:
        return str(error)
    return None


def split_model(devices: str, parallel: str, path, weight_dtype: str, attention: str) -> SplitModel | None:
    """The loader's `SplitModel` for `devices` / `parallel`, or None for a model in this process (the default)."""
    names = rank_list(devices, parallel, path)
    if not names:
        return None
    weight_dtype = default_weight_dtype(weight_dtype, torch.device(names[0]))  # as the single-device loader does
    return SplitModel(devices=names, build=load_dit_on, args=(str(path), weight_dtype, attention), mode=parallel)


def sample_split(model: SplitModel, positive, progress, **options):
    """`model.sample` with ComfyUI's interrupt and progress; the pool is registered with ComfyUI's model manager so
    that freeing memory ends the workers."""
    bridge.load_managed(_token, lambda: _token, on_unload=lambda _: pools.close_pools(), what="Qwen-Image 2.1 workers")
    return model.sample(positive, check_interrupt=bridge.throw_if_interrupted,
                        on_progress=lambda done, total: progress.update(done), **options)
