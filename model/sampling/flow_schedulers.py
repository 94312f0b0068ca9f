"""ComfyUI's scheduler names, computed the way ComfyUI computes them for a flux-style flow model (CONST noise
scaling, `sigma(t) = e^mu / (e^mu + 1/t - 1)`) whose shift `mu` is the official one for the image size.

ComfyUI keeps a table of 10,000 sigmas of its flux-style model (t = 1/10000 ... 1) and every table-based scheduler
(simple, ddim_uniform, beta) picks rows of it; sgm_uniform and normal map a linear grid through the shift (a second
time: they start from the table's end sigmas, which are already shifted); karras, exponential and kl_optimal only
read the table's smallest and largest sigma; linear_quadratic ignores the shift. Every schedule is fp32 and ends in
0. The Turbo model keeps its stored grid; these are for Base (and for anyone feeding the `sigmas` input).
"""

import math

import torch

from .schedule import SIGMA_DTYPE

#: ComfyUI's scheduler names in its own order (its `SCHEDULER_NAMES`).
COMFY_SCHEDULERS = ("simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal",
                    "linear_quadratic", "kl_optimal")
TABLE_SIZE = 10_000  # rows of ComfyUI's flux-style sigma table
KARRAS_RHO = 7.0
BETA_ALPHA = BETA_BETA = 0.6
LINEAR_QUADRATIC_THRESHOLD = 0.025


def flux_shift(mu: float, t: torch.Tensor) -> torch.Tensor:
    """The flux-style time shift in fp32: `e^mu / (e^mu + (1/t - 1))` (the identity for mu = 0)."""
    e_mu = math.exp(mu)
    return e_mu / (e_mu + (1 / t - 1))


def sigma_table(mu: float) -> torch.Tensor:
    """The model's sigma table: `flux_shift(mu, k / 10000)` for k = 1 ... 10000, fp32 ascending (the last is 1)."""
    return flux_shift(mu, torch.arange(1, TABLE_SIZE + 1) / TABLE_SIZE)


def scheduler_sigmas(name: str, steps: int, mu: float) -> torch.Tensor:
    """The `name` schedule of `steps` steps for a flow model shifted by `mu`: fp32 `(steps + 1,)` ending in 0
    (`ddim_uniform` and `beta` may give one step more or fewer, as in ComfyUI)."""
    if name not in COMFY_SCHEDULERS:
        raise ValueError(f"scheduler {name!r} is not one of ComfyUI's: {', '.join(COMFY_SCHEDULERS)}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1; got {steps!r}.")
    table = sigma_table(mu)
    lowest, highest = float(table[0]), float(table[-1])
    if name == "simple":
        stride = TABLE_SIZE / steps
        picked = [table[-(1 + int(i * stride))] for i in range(steps)]
        return _with_zero(torch.stack(picked))
    if name in ("sgm_uniform", "normal"):
        return _through_shift(name, steps, mu, table)
    if name == "karras":
        ramp = torch.linspace(0, 1, steps)
        top, bottom = highest ** (1 / KARRAS_RHO), lowest ** (1 / KARRAS_RHO)
        return _with_zero((top + ramp * (bottom - top)) ** KARRAS_RHO)
    if name == "exponential":
        return _with_zero(torch.linspace(math.log(highest), math.log(lowest), steps).exp())
    if name == "ddim_uniform":
        return _ddim_uniform(steps, table)
    if name == "beta":
        return _beta(steps, table)
    if name == "linear_quadratic":
        return _linear_quadratic(steps) * highest
    return _kl_optimal(steps, lowest, highest)


def _with_zero(sigmas: torch.Tensor) -> torch.Tensor:
    return torch.cat([sigmas.to(SIGMA_DTYPE), torch.zeros(1, dtype=SIGMA_DTYPE)])


def _through_shift(name: str, steps: int, mu: float, table: torch.Tensor) -> torch.Tensor:
    """sgm_uniform / normal: a linear grid from the largest to the smallest table sigma, each point shifted."""
    start, end = table[-1], table[0]
    if name == "sgm_uniform":
        return _with_zero(flux_shift(mu, torch.linspace(start, end, steps + 1)[:-1]))
    if math.isclose(float(flux_shift(mu, end)), 0.0, abs_tol=1e-5):  # the grid reaches 0 itself: no extra 0
        return flux_shift(mu, torch.linspace(start, end, steps + 1)).to(SIGMA_DTYPE)
    return _with_zero(flux_shift(mu, torch.linspace(start, end, steps)))


def _ddim_uniform(steps: int, table: torch.Tensor) -> torch.Tensor:
    """Every `TABLE_SIZE // steps`-th table row from row 1 up, reversed, after a leading 0 (which ends up last)."""
    if math.isclose(float(table[1]), 0.0, abs_tol=1e-5):
        steps, picked = steps + 1, []
    else:
        picked = [0.0]
    stride = max(TABLE_SIZE // steps, 1)
    picked += [float(table[row]) for row in range(1, TABLE_SIZE, stride)]
    return torch.tensor(picked[::-1], dtype=SIGMA_DTYPE)


def _beta(steps: int, table: torch.Tensor) -> torch.Tensor:
    """Table rows at the Beta(0.6, 0.6) quantiles of `1 - k / steps` (arXiv 2407.12173), repeats dropped."""
    last_row = TABLE_SIZE - 1
    picked, previous = [], None
    for k in range(steps):
        # numpy's linspace(0, 1, steps, endpoint=False) is k * (1 / steps)
        row = round_half_even(beta_quantile(1.0 - k * (1.0 / steps), BETA_ALPHA, BETA_BETA) * last_row)
        if row != previous:
            picked.append(float(table[row]))
        previous = row
    return _with_zero(torch.tensor(picked, dtype=SIGMA_DTYPE))


def _linear_quadratic(steps: int) -> torch.Tensor:
    """Mochi's schedule: linear to the threshold for the first half of the steps, quadratic to 1 after it."""
    if steps == 1:
        return torch.tensor([1.0, 0.0], dtype=SIGMA_DTYPE)
    linear_steps = steps // 2
    quadratic_steps = steps - linear_steps
    threshold = LINEAR_QUADRATIC_THRESHOLD
    gap = linear_steps - threshold * steps
    quad = gap / (linear_steps * quadratic_steps ** 2)
    lin = threshold / linear_steps - 2 * gap / quadratic_steps ** 2
    const = quad * linear_steps ** 2
    ramp = [i * threshold / linear_steps for i in range(linear_steps)]
    ramp += [quad * i ** 2 + lin * i + const for i in range(linear_steps, steps)]
    return torch.tensor([1.0 - value for value in ramp + [1.0]], dtype=SIGMA_DTYPE)


def _kl_optimal(steps: int, lowest: float, highest: float) -> torch.Tensor:
    """tan of a linear blend of atan(highest) and atan(lowest) (ComfyUI: AUTOMATIC1111 PR 15608). One step would
    divide 0 by 0 there (NaN); here it is the single step highest -> 0."""
    if steps == 1:
        return torch.tensor([highest, 0.0], dtype=SIGMA_DTYPE)
    frac = torch.arange(steps, dtype=SIGMA_DTYPE) / (steps - 1)
    return _with_zero(torch.tan(frac * math.atan(lowest) + (1 - frac) * math.atan(highest)))


def round_half_even(value: float) -> int:
    """numpy's `rint` (ties to even), which Python's `round` also does."""
    return int(round(value))


def beta_quantile(p: float, a: float, b: float) -> float:
    """The inverse of the regularized incomplete beta function I_x(a, b) = p (the Beta(a, b) quantile), by
    bisection in float64 (I_x is increasing in x), to about 1e-15."""
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    if a == b and p == 0.5:  # the median of a symmetric Beta is 1/2 exactly (bisection would stop an ulp off)
        return 0.5
    low, high = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if mid in (low, high):
            break
        if regularized_beta(mid, a, b) < p:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) by its continued fraction (modified Lentz), on the side of x where the fraction converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(1.0 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-16:
            break
    return result
