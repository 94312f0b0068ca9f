"""Qwen-Image 2.1 Fun ControlNet Union (alibaba-pai): a second stream of blocks beside the DiT, added to it.

Facts (docs/controlnet.md; ComfyUI core's `qwen_image21/model.py` and VideoX-Fun agree):
- the stream starts from the embedded joint sequence X (before base block 0) and, after base block 0, becomes
  `c0 = before_proj(J) + X`, J = `control_img_in(control latents)` on the target rows and 0 on the prefix rows;
- control block k is a full DiT block (same shared modulation, RoPE and block-causal segments, prefix rows at t = 0)
  that runs right after base block `k * num_base // num_control`; `c_{k+1} = block_k(c_k)`;
- `strength * after_proj_k(c_{k+1})` is added to every row of the base stream, prefix rows included.

Why the prefix cache stays exact: the control's prefix rows start at `X_prefix + before_proj.bias` (no control
image, no step), run at t = 0 and read only earlier prefix rows, exactly like the base prefix. So with fixed
strength the prefix rows of both streams, and the skips added to the base prefix, are the same at every step: a
prefill stores the base K/V (skips applied) and the control blocks' own prefix K/V (more layers of the same
`PrefixKVCache`, `ControlStream`), and cached steps run the target rows of both streams against them. A step
outside the control's window is a plain DiT step and reads a plain cache.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..layers.linear import Linear
from ..prefix_cache.layout import PrefixKVCache
from .block import Block, DiTConfig, Rows
from .hooks import CONTROL, BlockHook

CONTROL_IN_DIM = 129  # 64 control latent channels, 1 keep-mask channel, 64 inpaint latent channels
#: `(rows, width)` buffers a controlled step holds besides the DiT's: the control state c, the kept X, one skip.
STREAM_ROW_BUFFERS = 3
#: ComfyUI runs Qwen-Image 2.1 as ModelType.FLUX with shift (mu) 0.69: its `percent_to_sigma` for the window.
WINDOW_SHIFT = 0.69


@dataclass(frozen=True)
class ControlNetConfig:
    """Architecture of the control stream; defaults are the released Fun ControlNet Union's."""

    num_blocks: int = 16
    num_heads: int = 32
    head_dim: int = 128
    mlp_ratio: int = 3
    control_in_dim: int = CONTROL_IN_DIM
    eps: float = 1e-6

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim

    def block_config(self) -> DiTConfig:
        """The DiT config a control block shares its shape with (the blocks are DiT blocks)."""
        return DiTConfig(num_layers=self.num_blocks, num_heads=self.num_heads, head_dim=self.head_dim,
                         mlp_ratio=self.mlp_ratio, eps=self.eps)


def injection_layers(num_base: int, num_control: int) -> tuple[int, ...]:
    """Base block after which each control block runs: `range(0, num_base, num_base // num_control)`."""
    if num_control < 1 or num_base % num_control:
        raise ValueError(f"a control net of {num_control} blocks does not fit a DiT of {num_base} blocks (it needs a "
                         "divisor of the DiT's block count; the release pairs 16 with 32).")
    return tuple(range(0, num_base, num_base // num_control))


def percent_to_sigma(percent: float, shift: float = WINDOW_SHIFT) -> float:
    """ComfyUI's FLUX `percent_to_sigma`: 1 at 0 %, 0 at 100 %, else the time shift of `1 - percent`."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    return math.exp(shift) / (math.exp(shift) + (1.0 / (1.0 - percent) - 1.0))


class ControlBlock(Block):
    """A DiT block plus its output projection `after_proj` (with bias); block 0 also has `before_proj`."""

    def __init__(self, config: ControlNetConfig, first: bool, device=None, dtype=None):
        super().__init__(config.block_config(), device=device, dtype=dtype)
        width = config.width
        self.after_proj = Linear(width, width, device=device, dtype=dtype)
        self.after_proj_bias = nn.Parameter(torch.zeros(width, device=device, dtype=dtype), requires_grad=False)
        if first:
            self.before_proj = Linear(width, width, device=device, dtype=dtype)
            self.before_proj_bias = nn.Parameter(torch.zeros(width, device=device, dtype=dtype), requires_grad=False)


class FunControlNet(nn.Module):
    """The control stream's weights: `control_img_in` (129 -> width, with bias) and the control blocks.

    `source` names the file it came from and `identity` is a number no other loaded control net ever gets: the
    prefix-cache key uses it (an `id()` could be reused by a later object once this one is freed).
    """

    _identities = itertools.count(1)

    def __init__(self, config: ControlNetConfig = ControlNetConfig(), device=None, dtype=None):
        super().__init__()
        self.config = config
        self.compute_dtype = dtype or torch.float32
        self.source = None  # the file name (loaders/controlnet.py); None for a net built in code
        self.layout = None  # "alibaba" (split MLP), "comfy" (fused gate_up) or "comfy int8"
        self.identity = next(self._identities)
        self.control_img_in = Linear(config.control_in_dim, config.width, device=device, dtype=dtype)
        self.control_img_in_bias = nn.Parameter(torch.zeros(config.width, device=device, dtype=dtype),
                                                requires_grad=False)
        self.blocks = nn.ModuleList(ControlBlock(config, i == 0, device=device, dtype=dtype)
                                    for i in range(config.num_blocks))

    def check_fits(self, dit_config: DiTConfig, where: str = "the control net") -> tuple[int, ...]:
        """The injection layers for a DiT of `dit_config`, or a ValueError saying what does not match."""
        mine, theirs = self.config, dit_config
        if (mine.num_heads, mine.head_dim, mine.mlp_ratio) != (theirs.num_heads, theirs.head_dim, theirs.mlp_ratio):
            raise ValueError(f"{where} has {mine.num_heads} heads of {mine.head_dim} and MLP ratio {mine.mlp_ratio}, "
                             f"the model {theirs.num_heads} of {theirs.head_dim} and {theirs.mlp_ratio}: it was made "
                             "for another model. Use the Qwen-Image 2.1 Fun ControlNet Union.")
        return injection_layers(theirs.num_layers, mine.num_blocks)


class ControlStream(BlockHook):
    """The control stream of one forward, in the model's compute dtype: a block hook (hooks.py) of the DiT's forward,
    `start` before its first block and `after_block` after each, first in the hooks' order (its skips are part of
    the model's arithmetic). `hint` is the `(T, 129)` control latent of the
    target rows (one for all samples: both CFG prompts and every seed read it).

    The control blocks' prefix keys and values live in the base's prefix cache as `cache_layers` more layers
    after the base's (layer `base_layers + k` is control block k): one cache with one tree of row parts, so a
    kept controlled prefix is reused, shared by CFG's prompts and extended after a kept leading run exactly like
    a plain one (their prefix rows depend only on earlier prefix rows, as the base's do)."""

    order = CONTROL
    runs_split = False
    name = "a Fun ControlNet"

    def __init__(self, net: FunControlNet, layers: tuple[int, ...], hint: torch.Tensor, strength: float,
                 base_layers: int):
        self.net, self.hint, self.strength, self.base_layers = net, hint, float(strength), int(base_layers)
        self.at = {base: k for k, base in enumerate(layers)}  # base block index -> control block index
        self.x = self.c = self.mods = self.rows = self.cache = None

    @property
    def cache_layers(self) -> int:
        """Layers the control adds to the prefix cache: one per control block."""
        return self.net.config.num_blocks

    def start(self, x: torch.Tensor, mods: torch.Tensor, rows: Rows, cache: PrefixKVCache | None) -> None:
        """Keep the embedded sequence X (the base blocks change their buffer in place) and the run's cache."""
        config = self.net.config
        if rows.mode != "uncached" and cache is None:
            raise ValueError(f"a {rows.mode} step with a control net needs the prefix cache.")
        if tuple(self.hint.shape) != (rows.target_len, config.control_in_dim):
            raise ValueError(f"the control latent is {tuple(self.hint.shape)}, the target needs "
                             f"({rows.target_len}, {config.control_in_dim}).")
        self.x, self.mods, self.rows, self.cache = x.clone(), mods, rows, cache

    def after_block(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Run the control block paired with base block `index` (if any) and add its skip to `x` in place."""
        k = self.at.get(index)
        if k is None:
            return x
        skip = self._run(k)
        if x.shape[0] != skip.shape[0]:  # the DiT's last block dropped its prefix rows
            skip = skip[self.rows.target_start :]
        return x.add_(skip, alpha=self.strength)

    def _run(self, k: int) -> torch.Tensor:
        """Control block k on the stream; its skip `after_proj(c_{k+1})` on every row the stream holds."""
        block, rows = self.net.blocks[k], self.rows
        if k == 0:
            self.c, self.x = self._first_input(block), None
        kv = self.cache.layer_kv(self.base_layers + k) if self.cache is not None else None
        self.c = block(self.c, self.mods, rows, kv)
        skip = block.after_proj(self.c)
        skip += block.after_proj_bias
        return skip

    def _first_input(self, block: ControlBlock) -> torch.Tensor:
        """`before_proj(J) + X`: the bias on every row, the projected control latent on each sample's target rows."""
        net, rows = self.net, self.rows
        c = self.x
        c += block.before_proj_bias
        hint = self.hint.to(device=c.device, dtype=c.dtype)
        injected = block.before_proj(net.control_img_in(hint) + net.control_img_in_bias)  # (T, width)
        target = c[rows.target_start :].view(rows.samples, rows.target_len, -1)
        target += injected
        return c


@dataclass(eq=False)
class ControlPatch:
    """What a controlled model copy's record holds (`record.control`): the net, strength, window and the control
    latent; as the phase of a run (`RunPart.phase_cache`), what its cache adds to the plain one.

    `hint_for(grid)` builds the `(h*w, 129)` control latent for a target grid (VAE encoding happens there, once
    per size). A controlled prefix is keyed by the model the control was applied to, the control net's identity and
    the strength (`cache_key`), never by the control image (prefix rows never see it).
    """

    net: FunControlNet
    strength: float
    start_percent: float
    end_percent: float
    hint_for: Callable[[tuple[int, int]], torch.Tensor]
    layers: tuple[int, ...]
    name: str = ""
    inputs: tuple[str, ...] = ()  # which of control_image / inpaint_image / mask were given
    _hints: dict = field(default_factory=dict, repr=False)

    @property
    def sigma_start(self) -> float:
        return percent_to_sigma(self.start_percent)

    @property
    def sigma_end(self) -> float:
        return percent_to_sigma(self.end_percent)

    @property
    def whole_schedule(self) -> bool:
        """Whether the window is the whole schedule (then a run holds the controlled cache only)."""
        return self.start_percent <= 0.0 and self.end_percent >= 1.0

    def active(self, sigma: float) -> bool:
        """Whether the control applies at this sigma (core: `sigma_end <= sigma <= sigma_start`)."""
        return self.sigma_end <= float(sigma) <= self.sigma_start

    def __repr__(self) -> str:  # what a record's repr shows (not the net's modules)
        window = f"{self.start_percent:g}-{self.end_percent:g}"
        return f"ControlPatch({self.name!r}, strength={self.strength:g}, window={window})"

    @property
    def extra_layers(self) -> int:
        """Cache layers a controlled step adds to the base blocks' (one per control block)."""
        return self.net.config.num_blocks

    @property
    def cache_key(self) -> tuple:
        """What the controlled prefix depends on besides the base model and the conditioning."""
        return ("fun_controlnet", self.net.identity, self.strength, self.layers)

    def hint(self, grid: tuple[int, int], device, dtype) -> torch.Tensor:
        grid = (int(grid[0]), int(grid[1]))
        if grid not in self._hints:
            hint = self.hint_for(grid)
            expected = (grid[0] * grid[1], self.net.config.control_in_dim)
            if tuple(hint.shape) != expected:
                raise ValueError(f"the control latent for a {grid} target is {tuple(hint.shape)}, expected {expected}.")
            self._hints = {grid: hint}  # one size at a time: a run has one target size
        hint = self._hints[grid]
        if hint.device != torch.device(device) or hint.dtype != dtype:  # moved once, not on every step
            hint = self._hints[grid] = hint.to(device=device, dtype=dtype)
        return hint

    def read_order(self, base_layers: int) -> tuple[int, ...]:
        """The prefix-cache layers in the order a controlled step reads them: base block i, then control block k
        (cache layer `base_layers + k`) right after its base block."""
        after = {base: k for k, base in enumerate(self.layers)}
        order = []
        for i in range(base_layers):
            order.append(i)
            if i in after:
                order.append(base_layers + after[i])
        return tuple(order)

    def stream(self, grid, base_layers: int, device, dtype, net: FunControlNet | None = None) -> ControlStream:
        """The control stream for one forward at this target size, beside a DiT of `base_layers` blocks. `net`: the
        model copy's own `control_net` child (a LoRA applied on top clones it; the weights are the same), so the
        blocks that run are the ones the copy streams and moves; default `self.net`."""
        return ControlStream(net if net is not None else self.net, self.layers, self.hint(grid, device, dtype),
                             self.strength, base_layers)

    def report(self) -> dict:
        return {"file": self.name, "strength": self.strength, "window": [self.start_percent, self.end_percent],
                "inputs": list(self.inputs)}
