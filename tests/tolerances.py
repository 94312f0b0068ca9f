"""Two ways to compare results, so a bound says why it is what it is.

`same`: the computation is the same (a kept cache read back, the same call twice): the bytes must be equal.
`rounding_close`: the same sums taken in another order or by another kernel (a batch of two against a batch of
one, where the GEMMs may pick other kernels; a prefix computed in two parts against one): the results may differ by
float rounding, which scales with the values' magnitude, so the bound is a few units in the last place of the
largest value compared. An absolute 1e-6 was below that on an AMX Xeon (1.07e-6 on latents of magnitude 5.3)."""

import torch

#: units in the last place of the largest value: observed <= 2 (batch of two on an AMX Xeon, fp32 tiny models)
ROUNDING_ULPS = 8


def same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, expected.shape)
    assert torch.equal(got, expected), f"max difference {(got - expected).abs().max().item():.3g}, expected none"


def rounding_bound(expected: torch.Tensor, ulps: int = ROUNDING_ULPS) -> float:
    """`ulps` units of the dtype's precision at the largest magnitude in `expected`."""
    return ulps * torch.finfo(expected.dtype).eps * expected.abs().max().item()


def rounding_close(got: torch.Tensor, expected: torch.Tensor, ulps: int = ROUNDING_ULPS) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=rounding_bound(expected, ulps))
