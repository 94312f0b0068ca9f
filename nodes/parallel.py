"""The nodes' side of a DiT split over several devices (model/parallel/): the loader's `devices` and `parallel`
inputs, the samplers' run on the workers, and ComfyUI's "free memory" ending them."""

import torch

from ..model.parallel import pool as pools
from ..model.parallel.pool import parse_devices
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


def split_model(devices: str, parallel: str, path, weight_dtype: str, attention: str) -> SplitModel | None:
    """The loader's `SplitModel` for `devices` / `parallel`, or None for a model in this process (the default)."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}; got {parallel!r}.")
    names = parse_devices(devices or "")
    if parallel == "off":
        if not names:
            return None
        if len(names) > 1:
            raise ValueError(f"devices = {devices!r} names {len(names)} devices with parallel off; name one (the DiT "
                             "on a device of its own) or choose ulysses or cfg to split it over them.")
    if parallel == "cfg" and len(names) != 2:
        raise ValueError(f"parallel = cfg runs CFG's two prompts on two devices; devices names {len(names)} "
                         f"({devices!r}). Use ulysses for more.")
    if len(names) < 2 and parallel != "off":
        raise ValueError(f"parallel = {parallel} needs at least two devices in devices (e.g. cuda:0,cuda:1); got "
                         f"{devices!r}.")
    if weight_dtype == "default" and names[0] == "cpu":  # as the single-device loader does on a CPU
        weight_dtype = "fp32"
    return SplitModel(devices=names, build=load_dit_on, args=(str(path), weight_dtype, attention), mode=parallel)


def sample_split(model: SplitModel, positive, progress, **options):
    """`model.sample` with ComfyUI's interrupt and progress; the pool is registered with ComfyUI's model manager so
    that freeing memory ends the workers."""
    bridge.load_managed(_token, lambda: _token, on_unload=lambda _: pools.close_pools(), what="Qwen-Image 2.1 workers")
    return model.sample(positive, check_interrupt=bridge.throw_if_interrupted,
                        on_progress=lambda done, total: progress.update(done), **options)
