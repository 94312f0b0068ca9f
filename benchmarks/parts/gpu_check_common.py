"""What benchmarks/gpu_check.py and its section modules share: the `Check` (device, shapes, models built once), the
random model pair, and the table and difference helpers. A module of its own so the sections import it, not the
script that imports them."""

import statistics
import time
from dataclasses import dataclass, field

import torch

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.loaders.dit_keys import convert_state_dict
from qi21.model.memory.estimate import GIB
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.transformer.dit import DiTConfig, PrefixInputs, QwenImage21DiT

TEXT_TOKENS = 75


@dataclass
class Check:
    """What every section shares: where it runs, the shapes, and the models built once for several sections."""

    device: torch.device
    dtype: torch.dtype
    config: DiTConfig
    size: int  # target (and reference) side in pixels
    repeats: int
    format_layers: int
    dry_run: bool
    built: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def grid(self) -> tuple[int, int]:
        return self.size // 16, self.size // 16

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def median_ms(self, fn, repeats: int | None = None) -> float:
        """Median wall time of `fn` in ms (CUDA events on a GPU), after one warm-up call."""
        fn()
        samples = []
        for _ in range(repeats or self.repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    def peak(self, fn):
        """(result, bytes the call allocated at its peak above what was allocated before it); None on a CPU."""
        if not self.cuda:
            return fn(), None
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        out = fn()
        self.sync()
        return out, torch.cuda.max_memory_allocated(self.device) - before

    def release(self) -> None:
        self.built.clear()
        if self.cuda:
            torch.cuda.empty_cache()

    # -- shared models and inputs --------------------------------------------------------------------------------
    def pair(self, layers: int | None = None):
        """(diffusers' transformer, ours) on the same random weights (bf16-rounded), `layers` blocks, kept."""
        layers = layers or self.config.num_layers
        if ("pair", layers) not in self.built:
            self.built[("pair", layers)] = random_pair(self.config, layers, self.device, self.dtype)
        return self.built[("pair", layers)]

    def case(self, references: int, config: DiTConfig | None = None):
        """(conditioning, prefix, target (1, T, 64), diffusers' keyword arguments) of a template-like prompt."""
        config = config or self.config
        generator = torch.Generator().manual_seed(references)
        grid = self.grid
        slots = [False] * 20
        for _ in range(references):
            slots += [True] * (grid[0] * grid[1] // 4) + [False] * 3
        slots += [False] * (TEXT_TOKENS - slots.count(False))
        slot_mask = torch.tensor(slots)
        text = torch.randn(len(slots), config.context_in_dim, generator=generator)
        refs = torch.randn(references * grid[0] * grid[1], 64, generator=generator)
        target = torch.randn(1, grid[0] * grid[1], 64, generator=generator)
        cond = Conditioning(text=text, image_slots=slot_mask, references=refs if references else None,
                            ref_shapes=(grid,) * references)
        on = dict(device=self.device, dtype=self.dtype)
        prefix = PrefixInputs(layout=cond.layout(grid), text=text.to(**on),
                              references=refs.to(**on) if references else None)
        kwargs = dict(hidden_states=torch.cat([refs[None], target], dim=1).to(**on),
                      encoder_hidden_states=text[None].to(**on),
                      img_shapes=[[(1, *grid)] * references + [(1, *grid)]],
                      img_mask=torch.cat([slot_mask, torch.ones(grid[0] * grid[1] // 4, dtype=torch.bool)])[None]
                      .to(self.device))
        return cond, prefix, target.to(**on), kwargs


def random_pair(config: DiTConfig, layers: int, device, dtype):
    """diffusers' `QwenImage21Transformer2DModel` with random weights scaled like trained ones (norm scales near 1,
    the zero-centred text norm near 0), rounded to `dtype`, and our DiT loaded from its state dict."""
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        reference = QwenImage21Transformer2DModel(
            num_layers=layers, num_attention_heads=config.num_heads, attention_head_dim=config.head_dim,
            context_in_dim=config.context_in_dim, mlp_ratio=config.mlp_ratio, axes_dims_rope=config.axes_dims_rope,
        ).to(dtype).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.ndim == 1:
                param.copy_((0.0 if "text_norm" in name else 1.0) + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, param.shape[1] ** -0.5)
    ours = QwenImage21DiT(DiTConfig(**{**config.__dict__, "num_layers": layers}), device=device, dtype=dtype)
    ours.load_state_dict(convert_state_dict(reference.state_dict()))
    ours.compute_dtype = dtype
    return reference, ours.eval()


def rel_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.float(), expected.float()
    return ((got - expected).norm() / expected.norm()).item()


def gib(nbytes) -> str:
    return "n/a (CPU)" if nbytes is None else f"{nbytes / GIB:.2f}"


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def dit_calls(check: Check, reference, ours, prefix, target, kwargs):
    """(our prefill, our cached step, diffusers' prefill, diffusers' cached step) as calls on their own caches."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    t = torch.tensor([0.8], device=check.device)
    mine, theirs = PrefixKVCache(), QwenImage21KVCache(len(reference.transformer_blocks))
    return (lambda: ours(target, t, [prefix], cache=mine, mode="prefill"),
            lambda: ours(target, t, [prefix], cache=mine, mode="cached"),
            lambda: reference(timestep=t, kv_cache=theirs, kv_cache_mode="extract", **kwargs),
            lambda: reference(timestep=t, kv_cache=theirs, kv_cache_mode="cached", **kwargs)[0][:, -target.shape[1]:])
