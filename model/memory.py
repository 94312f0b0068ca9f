"""How much memory a sampling run needs, predicted before anything is allocated, so a request that cannot fit is
refused with numbers instead of growing until the operating system kills the process.

This is a deliberately conservative estimate (it over- rather than under-counts) of the peak a run adds on top
of the resident weights: the noise and latent buffers, the prefix cache, and the largest transient of one DiT
forward (the prefill, which runs every prefix and target row through a block). Per block the live tensors are
the row buffer and its modulated copy, q/k in fp32 (they are normed and rotated in fp32), v and the attention
output, and the two halves of the SwiGLU hidden state.

The memory planner (`planner.py`) builds every DiT phase on this estimate (adding the weights on the device, the
target attention's K/V concatenation off the CPU and a fixed allowance for workspaces), and the samplers refuse a
run that fits no plan through it (`planner.PlanError`).
"""

from dataclasses import dataclass

from .dit import DiTConfig

GIB = 1024**3
FP32 = 4


@dataclass(frozen=True)
class RunEstimate:
    latents: int  # noise, latents in two dtypes, the step's velocity and denoised estimate
    cache: int  # the prefix cache (0 with prefix_cache off)
    step: int  # the largest transient of one forward
    rows: int  # rows of the largest forward (prefixes + samples x target tokens)

    @property
    def total(self) -> int:
        return self.latents + self.cache + self.step


def estimate_run(config: DiTConfig, prefix_tokens: list[int], target_tokens: int, batch: int, cfg: bool,
                 itemsize: int, prefix_cache: bool = True) -> RunEstimate:
    """Bytes a run adds on top of the weights; `prefix_tokens` lists each distinct prompt's prefix length."""
    samples = batch * (2 if cfg else 1)
    rows = sum(prefix_tokens) + samples * target_tokens
    width, hidden = config.width, config.mlp_hidden
    per_row = width * (4 * itemsize + 2 * 2 * FP32) + 2 * hidden * itemsize  # see the module docstring
    step = rows * per_row
    latents = batch * config.in_channels * target_tokens * (6 * FP32 + 2 * itemsize)
    cache = 2 * config.num_layers * config.num_heads * config.head_dim * sum(prefix_tokens) * itemsize
    return RunEstimate(latents, cache if prefix_cache else 0, step, rows)

