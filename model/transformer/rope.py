"""3-axis rotary position embedding (frame, height, width) of Qwen-Image 2.1.

Angles are computed from integer position ids on the fly, so there is no table and no range limit
(diffusers keeps a 9216-row table and silently reads wrong rows for ids outside [-1024, 8191]); inside that
range the angles are the same fp32 products diffusers tabulates.

The rotations the blocks read are real `[cos, sin]` pairs (`rope_rotations`): eagerly they are viewed as complex
and applied with one complex multiply, as the reference does; inside a compiled block the same products are
written out in real arithmetic, because inductor does not fuse complex tensors.
"""

import torch


def rope_angles(positions: torch.Tensor, axes_dims: tuple[int, ...], theta: float = 10000.0) -> torch.Tensor:
    """`(N, sum(axes_dims) // 2)` complex64 rotations `exp(i * angle)` for `positions` `(N, len(axes_dims))`.

    Axis `a` contributes `axes_dims[a] // 2` frequencies `theta ** (-2k / axes_dims[a])`, in axis order, so
    the pairs line up with the interleaved channel pairs of a head (16/56/56 -> 8 + 28 + 28 = 64 pairs).
    """
    angles = []
    for axis, dim in enumerate(axes_dims):
        inv_freq = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
        angles.append(torch.outer(positions[:, axis].to(torch.float32), inv_freq))
    angles = torch.cat(angles, dim=-1)
    return torch.polar(torch.ones_like(angles), angles)


def rope_rotations(positions: torch.Tensor, axes_dims: tuple[int, ...], theta: float = 10000.0) -> torch.Tensor:
    """`(N, sum(axes_dims) // 2, 2)` fp32 `[cos, sin]` of `rope_angles`: the same numbers, in a real tensor of its
    own (not a view of a complex one, which a compiled block could not take as an input)."""
    return torch.view_as_real(rope_angles(positions, axes_dims, theta)).clone()


def apply_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs `(x[2k], x[2k+1])` of `x` `(..., head_dim)` in fp32.

    `rotations` is `rope_rotations`' real `[cos, sin]` and broadcasts against `x`'s pairs `(..., head_dim // 2, 2)`
    (e.g. `(N, 1, D/2, 2)` for `(N, H, D)`); the result has `x`'s dtype and layout. Eagerly: one complex multiply,
    as the reference does, so the fp32 arithmetic is the same. Compiled: `(re * cos - im * sin, re * sin + im *
    cos)`, the products a complex multiply forms, which inductor fuses into the kernels around it (it may contract
    them into FMAs, so compiled and eager agree to ~1e-7, not bit for bit).
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    if torch.compiler.is_compiling():
        re, im = pairs.unbind(-1)
        cos, sin = rotations.unbind(-1)
        return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2).to(x.dtype)
    rotated = torch.view_as_complex(pairs) * torch.view_as_complex(rotations)
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)
