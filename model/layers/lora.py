"""The LoRA branch: one LoRA file's pairs on one `Linear`, run next to the frozen weight (`Linear.adapters`).
Reading and applying a LoRA file is `loaders/lora.py`."""

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

    def _plan(self, start: int, end: int, dtype: torch.dtype, device: torch.device):
        key = (start, end, dtype, device)
        if key not in self._plans:
            if any(k[3] != device for k in self._plans):
                self._plans = {}  # the model moved: keep one device's copy only
            hits = [p for p in self.pairs if p.target.start < end and start < p.target.end]
            if not hits:
                self._plans[key] = None
            else:
                down = torch.cat([p.down.to(device=device, dtype=torch.float32) for p in hits])
                up = torch.zeros(end - start, down.shape[0], dtype=torch.float32, device=device)
                col = 0
                for p in hits:
                    lo, hi = max(start, p.target.start), min(end, p.target.end)
                    rows = p.up[lo - p.target.start : hi - p.target.start].to(device=device, dtype=torch.float32)
                    up[lo - start : hi - start, col : col + p.rank] = rows * (self.strength * p.scale)
                    col += p.rank
                self._plans[key] = (down.to(dtype), up.to(dtype))
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



def release_branches(model: torch.nn.Module) -> None:
    """Free every LoRA branch's stacked device copy in `model` (called when the model is unloaded, so the copies
    do not stay in VRAM while its weights are offloaded; the next call rebuilds them where the model is)."""
    for module in model.modules():
        for adapter in getattr(module, "adapters", ()):
            if isinstance(adapter, LowRankBranch):
                adapter.release()
