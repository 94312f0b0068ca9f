"""The LoRA branches on one `Linear`, run next to the frozen weight (`Linear.adapters`): `LowRankBranch` (a file's
low-rank pairs) and `DeltaBranch` (its full-weight deltas, `.diff`). Reading and applying a LoRA file is
`loaders/lora.py`."""

import torch
import torch.nn.functional as F


class LowRankBranch:
    """One LoRA on one Linear, as `Linear.adapters` calls it: `branch(x, start, end)` -> the `(..., end - start)`
    term for those output rows, or None when none of its pairs touches them.

    For each requested row range the pairs that overlap it are stacked once per (dtype, device): their downs as
    one `(sum of ranks, in)` matrix, their ups (times strength * alpha / rank, folded in fp32) side by side in a
    `(end - start, sum of ranks)` matrix with zeros where a pair has no rows, so the term is two skinny GEMMs in
    the compute dtype. The stored pairs stay on the CPU; the stacked copy follows the model to its device.
    """

    def __init__(self, pairs, strength: float):
        self.pairs = tuple(pairs)  # LoraPair, all on one Linear
        self.strength = float(strength)
        self._plans: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def _stacked(self, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(downs, scaled ups) of the pairs overlapping rows `[start, end)`, fp32 on `device`, or None."""
        hits = [p for p in self.pairs if p.target.start < end and start < p.target.end]
        if not hits:
            return None
        down = torch.cat([p.down.to(device=device, dtype=torch.float32) for p in hits])
        up = torch.zeros(end - start, down.shape[0], dtype=torch.float32, device=device)
        col = 0
        for p in hits:
            lo, hi = max(start, p.target.start), min(end, p.target.end)
            rows = p.up[lo - p.target.start : hi - p.target.start].to(device=device, dtype=torch.float32)
            up[lo - start : hi - start, col : col + p.rank] = rows * (self.strength * p.scale)
            col += p.rank
        return down, up

    def _plan(self, start: int, end: int, dtype: torch.dtype, device: torch.device):
        key = (start, end, dtype, device)
        if key not in self._plans:
            if any(k[3] != device for k in self._plans):
                self._plans = {}  # the model moved: keep one device's copy only
            stacked = self._stacked(start, end, device)
            self._plans[key] = None if stacked is None else tuple(t.to(dtype) for t in stacked)
        return self._plans[key]

    def release(self) -> None:
        """Drop the stacked copies (they follow the model's device; the host's model manager unloaded it)."""
        self._plans = {}

    def __call__(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor | None:
        plan = self._plan(start, end, x.dtype, x.device)
        if plan is None:
            return None
        down, up = plan
        return F.linear(F.linear(x, down), up)

    def dense(self, start: int, end: int, device) -> torch.Tensor | None:
        """The term for rows `[start, end)` as one fp32 matrix `(end - start, in)` (strength included), or None."""
        stacked = self._stacked(start, end, device)
        return None if stacked is None else stacked[1] @ stacked[0]


class DeltaBranch:
    """A file's full-weight deltas (`.diff`) on one Linear, as `Linear.adapters` calls it: `x @ (strength * D)^T`
    for the requested rows, D being the deltas placed on their rows (zeros elsewhere). The same term as ComfyUI's
    merged `W + strength * D`, computed as a second GEMM so the frozen weight (of any format) is neither copied
    nor requantized. Costs one dense matrix of the layer's size in the compute dtype on the device (built on first
    use, dropped by `release`) and that GEMM; the file's deltas stay on the CPU.
    """

    def __init__(self, deltas, strength: float):
        self.deltas = tuple(deltas)  # LoraDelta (`.target`, `.delta` rows x in), all on one Linear
        self.strength = float(strength)
        self._plans: dict[tuple, torch.Tensor | None] = {}

    def dense(self, start: int, end: int, device) -> torch.Tensor | None:
        """strength * D for rows `[start, end)`, fp32 on `device`, or None when no delta touches them."""
        hits = [d for d in self.deltas if d.target.start < end and start < d.target.end]
        if not hits:
            return None
        matrix = torch.zeros(end - start, hits[0].delta.shape[1], dtype=torch.float32, device=device)
        for d in hits:
            lo, hi = max(start, d.target.start), min(end, d.target.end)
            rows = d.delta[lo - d.target.start : hi - d.target.start].to(device=device, dtype=torch.float32)
            matrix[lo - start : hi - start] += rows * self.strength
        return matrix

    def release(self) -> None:
        self._plans = {}

    def __call__(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor | None:
        key = (start, end, x.dtype, x.device)
        if key not in self._plans:
            if any(k[3] != x.device for k in self._plans):
                self._plans = {}  # the model moved: keep one device's copy only
            matrix = self.dense(start, end, x.device)
            self._plans[key] = None if matrix is None else matrix.to(x.dtype)
        matrix = self._plans[key]
        return None if matrix is None else F.linear(x, matrix)


def release_branches(model: torch.nn.Module) -> None:
    """Free every LoRA branch's stacked device copy in `model` (called when the model is unloaded, so the copies
    do not stay in VRAM while its weights are offloaded; the next call rebuilds them where the model is)."""
    for module in model.modules():
        for adapter in getattr(module, "adapters", ()):
            if isinstance(adapter, (LowRankBranch, DeltaBranch)):
                adapter.release()
