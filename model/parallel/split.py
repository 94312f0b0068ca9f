"""A DiT split over several devices, as the coordinator holds it: not a model, a recipe for the workers.

The loader returns a `SplitModel` instead of loading the weights in the host process: each worker loads them onto
its own device (one copy of the weights per device; Ulysses splits the work, not the weights). A LoRA adds itself
to the recipe (`with_lora`), so the model chain (file, dtype, LoRAs with strengths) is the pool's model key: the
same chain on the same devices reuses the running workers and their loaded model, another chain is built in them
after the old one is dropped, other devices start another pool.
"""

from dataclasses import dataclass, replace

import torch

from ..features.devices import PARALLEL_MODES  # noqa: F401 (declared by the feature; the loader reads it here)
from ..features.lora import apply_lora
from ..loaders.dit import load_dit
from ..sampling.loop import SampleResult
from . import pool as pools
from .worker import from_value, run_sample


def build_chain(device: torch.device, build, args: tuple, loras: tuple):
    """In a worker: `build(device, *args)`, then each `(path, strength, name)` LoRA in order."""
    model = build(device, *args)
    for path, strength, name in loras:
        model = apply_lora(model, path, strength, name=name)
    return model


def load_dit_on(device: torch.device, path: str, weight_dtype: str, attention: str):
    """`load_dit` straight to the worker's device (no second copy in host memory per worker)."""
    return load_dit(path, weight_dtype=weight_dtype, device=device, attention=attention)


@dataclass(frozen=True)
class SplitModel:
    """The recipe of a DiT that runs split over `devices` (`mode` "ulysses" or "cfg", model/parallel/cfg.py), or
    whole on one device of its own (`mode` "off", one worker): `build(device, *args)` builds it in each worker
    (picklable by reference), `loras` are applied after. `source` is what the file says (the variant, for the
    samplers' checks), read in the host without loading weights; None when unknown."""

    devices: tuple[str, ...]
    build: object
    args: tuple
    loras: tuple = ()
    mode: str = "ulysses"
    source: object = None
    hang_seconds: float = 600.0
    threads: int | None = None
    options: object = None  # the model's options record (model/options.py; set by `with_options`, not in `key`)

    @property
    def key(self) -> tuple:
        """The model chain: what the workers must hold for this model (the pool reuses them while it is the same)."""
        build = (getattr(self.build, "__module__", ""), getattr(self.build, "__qualname__", repr(self.build)))
        return build, self.args, self.loras

    def with_lora(self, path, strength: float, name: str | None = None) -> "SplitModel":
        return replace(self, loras=self.loras + ((str(path), float(strength), name),))

    def pool(self) -> pools.WorkerPool:
        """The running workers for these devices, holding this chain (started or rebuilt as needed)."""
        workers = pools.pool_for(self.devices, threads=self.threads, hang_seconds=self.hang_seconds)
        workers.ensure_model(self.key, build_chain, (self.build, self.args, self.loras), mode=self.mode)
        return workers

    def sample(self, positive, *, check_interrupt=None, on_progress=None, **options) -> SampleResult:
        """`loop.sample` on every rank (the same options; no `store`, `new_cache` or `callback`: each rank keeps its
        own shard of the caches and reports progress itself). The report is rank 0's with the split added."""
        for name in ("store", "new_cache", "callback", "sampler", "check_interrupt"):
            if options.get(name) is not None:
                raise ValueError(f"a model split over several devices runs sample() without {name!r}.")
        answers = self.pool().call(run_sample, dict(positive=positive, **options), what="sampling",
                                   check_interrupt=check_interrupt, on_progress=on_progress)
        report = dict(answers[0]["report"])
        report["parallel"] = {"mode": self.mode, "devices": list(self.devices),
                              "cache_bytes_per_device": [a["report"]["cache_bytes"] for a in answers]}
        report["cache_bytes"] = sum(report["parallel"]["cache_bytes_per_device"])
        report["cache_device"] = ",".join(self.devices)
        return SampleResult(from_value(answers[0]["latents"]), report)
