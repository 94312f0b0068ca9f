"""The DiT's training paths (demo/train_toy.py), chosen once per model instead of tested in every inference call.

The inference block (block.py) writes into preallocated buffers and updates the row buffer in place; autograd can
follow neither, and the prefill's block-causal operator has no autograd formula. `with_training_paths(dit)` switches
a DiT's blocks to `TrainingBlock`, which computes the same sums out of place:
- modulation and gated residuals per row group, concatenated (`TrainingRows.modulate` / `gated_add`);
- the prefix's block-causal attention as one SDPA call per segment (`attention.prefix_attention_sdpa`);
- the target rows' attention per group of samples, concatenated instead of written into a buffer (autograd turns
  every slice assignment into a copy of the whole buffer: a cost that grows with the square of the prompts in a
  batch);
- SiLU out of place (autograd needs the pre-activation the in-place one overwrites).
Parameter names and values are untouched, so a switched model saves, loads and copies as before;
`with_training_paths(dit, False)` switches back (an EMA copy or a finished student runs the inference block).
"""

from dataclasses import fields

import torch
import torch.nn.functional as F

from .attention import prefix_attention_sdpa
from .block import Block, Rows


class TrainingRows(Rows):
    """`Rows` whose modulation, gated residual and prefix attention are out of place (autograd can follow them)."""

    def chunk_attention(self, c: int, q, k, v, kv=None) -> torch.Tensor:
        if self.chunk_masks and self.chunk_masks[c] is not None:
            return super().chunk_attention(c, q, k, v, kv)
        k, v = self.with_context(c, k, v, kv)
        table = [(start, end, bool(text)) for start, end, text in self.chunk_segments[c].tolist()]
        return prefix_attention_sdpa(q, k, v, table, k.shape[0] - q.shape[0])

    def modulate(self, x: torch.Tensor, factor: torch.Tensor, prefix: bool = True) -> torch.Tensor:
        return self._per_row(x, factor, prefix=prefix)

    def gated_add(self, x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, prefix: bool = True):
        return self._per_row(x, gate, update, prefix)

    def _per_row(self, x: torch.Tensor, table: torch.Tensor, update: torch.Tensor | None = None,
                 prefix: bool = True) -> torch.Tensor:
        """`x * table` (`update` None) or `x + table * update`, each row with its own table row (`Rows.modulate`'s
        selection), out of place."""
        xs = self.chunks(x, prefix)
        updates = (None,) * len(xs) if update is None else self.chunks(update, prefix)
        parts = []
        for x_c, update_c, row in zip(xs[:-1], updates[:-1], self.prefix_mod_rows):
            factor = table[row]
            parts.append(x_c * factor if update is None else x_c + factor * update_c)
        target = xs[-1].view(self.samples, self.target_len, -1)
        factor = table[: self.samples, None]
        if update is None:
            parts.append((target * factor).flatten(0, 1))
        else:
            parts.append((target + factor * updates[-1].view_as(target)).flatten(0, 1))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def training_rows(rows: Rows) -> TrainingRows:
    """The same rows with the training paths."""
    if isinstance(rows, TrainingRows):
        return rows
    return TrainingRows(**{field.name: getattr(rows, field.name) for field in fields(Rows)})


class TrainingBlock(Block):
    """A DiT block whose forward autograd can follow (the module docstring); the same parameters as `Block`."""

    def run(self, x: torch.Tensor, mods: torch.Tensor, rows: Rows, kv, drop_prefix: bool):
        return super().run(x, mods, training_rows(rows), kv, drop_prefix)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.gate_up.weight.shape[0] // 2
        up = self.gate_up.rows(x, hidden, 2 * hidden)
        gate = self.gate_up.rows(x, 0, hidden)
        return self.down(F.silu(gate) * up)

    def attention(self, q, k, v, rows: Rows, kv, drop_prefix: bool) -> torch.Tensor:
        """`Block.attention`'s sums out of place: chunks and groups of samples concatenated."""
        samples, length = rows.samples, rows.target_len
        (*q_c, q_t), (*k_c, k_t), (*v_c, v_t) = (rows.chunks(tensor) for tensor in (q, k, v))
        self._store_prefill(rows, k_c, v_c, kv)
        outputs = [] if drop_prefix else [rows.prefix_attention(c, q_c[c], k_c[c], v_c[c], kv) for c in range(len(q_c))]
        shape = (samples, length, self.num_heads, self.head_dim)
        q_t, k_t, v_t = (tensor.view(shape) for tensor in (q_t, k_t, v_t))
        groups = [(g, pick) for g, pick in enumerate(rows.readers) if pick is not None]
        if all(isinstance(pick, slice) for _, pick in groups):  # consecutive readers: one split in sample order
            groups.sort(key=lambda item: item[1].start)
            counts = [pick.stop - pick.start for _, pick in groups]
            parts = zip(*(tensor.split(counts) for tensor in (q_t, k_t, v_t)))
            order = None
        else:
            picks = [torch.arange(samples)[pick] for _, pick in groups]
            parts = [(q_t[p], k_t[p], v_t[p]) for p in picks]
            order = torch.cat(picks).argsort()
        target = []
        for (g, _), (q_g, k_g, v_g) in zip(groups, parts):
            target.append(rows.target_attention(q_g, k_g, v_g, *rows.prefix_keys(g, k_c, v_c, kv)))
        target = torch.cat(target)
        if order is not None:
            target = target[order]
        return torch.cat(outputs + [target.flatten(0, 1)])


def with_training_paths(dit, on: bool = True):
    """`dit` (changed in place, returned) with its blocks on the training paths (`on`) or the inference ones. Only
    the class of each block changes: no parameter is copied or renamed."""
    for block in dit.blocks:
        if type(block) not in (Block, TrainingBlock):
            raise TypeError(f"with_training_paths switches DiT blocks; got a {type(block).__name__}.")
        block.__class__ = TrainingBlock if on else Block
    return dit
