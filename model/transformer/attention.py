"""Attention kernels for the block-causal prefill and the cached target steps.

Tensors are `(rows, heads, head_dim)` for one prefix and `(samples, rows, heads, head_dim)` for targets,
the layout the QKV projection produces; each kernel transposes to SDPA's `(batch, heads, rows, dim)`.

Rule: `(q >= k) or same_image_block`. Text runs are causal, each reference block is bidirectional inside,
the prefix never reads the target, and the target reads everything. Two prefill backends cover the prefix:
- "sdpa": one SDPA call per segment. An image segment attends to every key before its end with no mask at
  all (so the fastest SDPA kernel runs); only the short text runs carry a small causal mask. Exact, needs no
  compilation; the default.
- "flex": one `flex_attention` call over the whole prefix, driven by a block mask built once per layout.
  Fast only when compiled (done automatically on CUDA); on CPU it runs eagerly and is meant for checking.
The target rows use the same full attention over `[prefix | target]` in the prefill and in cached steps.
"""

import warnings

import torch
import torch.nn.functional as F

from ..layers.custom_ops import op_name
from .layout import SequenceLayout

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    FLEX_AVAILABLE = True
except ImportError:  # torch < 2.5
    create_block_mask = flex_attention = None
    FLEX_AVAILABLE = False

ATTENTION_BACKENDS = ("sdpa", "flex")


def _sdpa(q, k, v, mask=None):
    """SDPA on `(B, rows, heads, dim)` tensors, returning `(B, rows_q, heads, dim)`."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def prefix_attention_sdpa(q, k, v, segments, first_row: int = 0) -> torch.Tensor:
    """Block-causal attention of one prefix, `(rows, heads, dim)` in and out, one SDPA call per segment.

    `q` holds the prefix rows from `first_row` on (a chunk after a reused leading run, which must end on a
    segment boundary or inside a text run), `k` and `v` every row from 0: the chunk's rows read the run before
    them like any earlier rows.
    """
    q, k, v = q[None], k[None], v[None]
    outputs = []
    for start, end, is_text in segments:
        if end <= first_row:
            continue
        start = max(start, first_row)
        mask = None
        if is_text:
            # row i of the run sees every key before the run and the run's keys up to itself
            length = end - start
            mask = torch.ones(length, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        outputs.append(_sdpa(q[:, start - first_row : end - first_row], k[:, :end], v[:, :end], mask))
    return torch.cat(outputs, dim=1)[0]


def segment_table(segments) -> torch.Tensor:
    """A layout's `segments` `[(start, end, is_text), ...]` as a `(n, 3)` int64 CPU tensor, what
    `block_causal_attention` takes."""
    return torch.tensor([(start, end, int(is_text)) for start, end, is_text in segments], dtype=torch.int64)


@torch.library.custom_op(op_name("block_causal_attention"), mutates_args=())
def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """`prefix_attention_sdpa` over rows `first_row:` = `len(k) - len(q)` (0 for a whole prefix), with the segments
    as a `segment_table`. One opaque operator, eager and compiled alike: its Python loop over segments would
    otherwise be unrolled into a compiled block's graph, and a prompt with another number of references would
    recompile it; as a tensor the segment count is just a dynamic size."""
    table = [(start, end, bool(is_text)) for start, end, is_text in segments.tolist()]
    return prefix_attention_sdpa(q, k, v, table, k.shape[0] - q.shape[0]).contiguous()


@block_causal_attention.register_fake
def _(q, k, v, segments):
    return q.new_empty(q.shape)


_warned_eager_flex = False
_compiled_flex = None


def _flex_kernel(device: torch.device):
    """Compiled flex_attention on CUDA (an eager one materialises the full score matrix), eager elsewhere."""
    global _compiled_flex, _warned_eager_flex
    if device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex
    if not _warned_eager_flex:
        warnings.warn(
            "attention='flex' runs flex_attention uncompiled on this device: exact but slow and memory hungry. "
            "Use attention='sdpa' unless you are checking the flex path.",
            stacklevel=3,
        )
        _warned_eager_flex = True
    return flex_attention


def flex_block_mask(layout: SequenceLayout, device: torch.device):
    """The prefix's block-causal mask in flex form; built once per layout and device, reused by every layer."""
    if not FLEX_AVAILABLE:
        raise RuntimeError(
            "attention='flex' needs torch.nn.attention.flex_attention (torch >= 2.5); use attention='sdpa'."
        )
    block_ids = layout.block_ids.to(device)

    def block_causal(batch, head, q_idx, kv_idx):
        same_block = (block_ids[q_idx] == block_ids[kv_idx]) & (block_ids[q_idx] >= 0)
        return (q_idx >= kv_idx) | same_block

    length = layout.prefix_len
    return create_block_mask(block_causal, B=None, H=None, Q_LEN=length, KV_LEN=length, device=device)


def prefix_attention_flex(q, k, v, block_mask) -> torch.Tensor:
    """Block-causal attention of one prefix in a single flex_attention call, `(P, heads, dim)` in and out."""
    kernel = _flex_kernel(q.device)
    with warnings.catch_warnings():
        # torch's own "not compiled" notice; ours above says what to do instead
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")
        out = kernel(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2), block_mask=block_mask)
    return out.transpose(1, 2)[0]


# torch's CPU flash kernel also returns the log-sum-exp, which the split-KV merge below needs:
# `(out (B, H, Lq, D), logsumexp (B, H, Lq))` on `(B, H, L, D)` inputs.
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _parts(prefix) -> list[torch.Tensor]:
    return [prefix] if isinstance(prefix, torch.Tensor) else list(prefix)


def target_attention(q, k, v, prefix_k, prefix_v) -> torch.Tensor:
    """Target rows `(S, T, heads, dim)` of S samples sharing one prefix: full attention.

    The prefix is `(P, heads, dim)` keys and values, or lists of such parts in row order (a prefix whose leading
    run is shared with another prompt). The block-causal rule gives target rows every key, so no mask is needed.
    On CPU the prefix is never concatenated with the target keys: the S samples' queries, folded into one
    sequence, attend to each prefix part in one call, each sample attends to its own target keys in another, and
    the partial results are merged exactly through their log-sum-exps. Elsewhere the parts are broadcast and
    concatenated per call, as they are whenever autograd records (training).
    """
    samples, length, heads, dim = q.shape
    parts = [(pk, pv) for pk, pv in zip(_parts(prefix_k), _parts(prefix_v)) if pk.shape[0]]
    # The kernel's log-sum-exp carries no gradient, so under autograd the merge's weights would be constants and
    # the gradient would miss how attention shifts between the prefix and the target: training concatenates.
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *(x for p in parts for x in p)))
    if _flash_with_lse is None or q.device.type != "cpu" or not parts or recording:
        keys = torch.cat([pk.expand(samples, -1, -1, -1) for pk, _ in parts] + [k], dim=1)
        values = torch.cat([pv.expand(samples, -1, -1, -1) for _, pv in parts] + [v], dim=1)
        return _sdpa(q, keys, values)
    out, lse = _flash_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (S,H,T,D), (S,H,T)
    # (1, S*T, H, D) against each prefix part: every sample reads the same keys
    folded = q.reshape(1, samples * length, heads, dim).transpose(1, 2)
    for part_k, part_v in parts:
        out_p, lse_p = _flash_with_lse(folded, part_k[None].transpose(1, 2), part_v[None].transpose(1, 2))
        out_p = out_p.view(heads, samples, length, dim).transpose(0, 1)  # (S, H, T, D)
        lse_p = lse_p.view(heads, samples, length).transpose(0, 1)  # (S, H, T)
        # softmax over both key sets = weighted mean of the partial results, weight sigmoid(lse_p - lse)
        out = torch.lerp(out, out_p, torch.sigmoid(lse_p - lse)[..., None].to(out.dtype))
        lse = torch.logaddexp(lse, lse_p)
    return out.transpose(1, 2)
