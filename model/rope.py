"""3-axis rotary position embedding (frame, height, width) of Qwen-Image 2.1.

Angles are computed from integer position ids on the fly, so there is no table and no range limit
(diffusers keeps a 9216-row table and silently reads wrong rows for ids outside [-1024, 8191]); inside that
range the angles are the same fp32 products diffusers tabulates.
"""

import torch


def rope_angles(positions: torch.Tensor, axes_dims: tuple[int, ...], theta: float = 10000.0):
    """Return `(cos, sin)`, each `(N, sum(axes_dims) // 2)` fp32, for `positions` `(N, len(axes_dims))` ids.

    Axis `a` contributes `axes_dims[a] // 2` frequencies `theta ** (-2k / axes_dims[a])`, in axis order, so
    the pairs line up with the interleaved channel pairs of a head (16/56/56 -> 8 + 28 + 28 = 64 pairs).
    """
    angles = []
    for axis, dim in enumerate(axes_dims):
        inv_freq = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
        angles.append(positions[:, axis].to(torch.float32)[:, None] * inv_freq[None, :])
    angles = torch.cat(angles, dim=-1)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs `(x[2k], x[2k+1])` of `x` `(..., N, heads, head_dim)` in fp32.

    `cos`/`sin` are `(N, head_dim // 2)`; the result has `x`'s dtype (the rotation itself runs in fp32, as the
    reference does with complex numbers).
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # (..., N, H, D/2, 2)
    real, imag = pairs.unbind(-1)
    cos = cos[:, None, :]  # (N, 1, D/2): broadcast over heads
    sin = sin[:, None, :]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
