r"""Where every token of the joint sequence goes: rows, image blocks, segments and RoPE positions.

The text encoder returns one state per kept VLM token; each image slot (`<|image_pad|>` expanded by the
processor) stands for a 2x2 group of latent tokens. The DiT sequence is the text with every slot replaced by
four rows that receive the references' latent tokens in order, followed by the target's latent tokens:

    [ text | ref 1 | text | ref 2 | text ] [ target ]
    \_________ prefix (t = 0) __________/

A layout depends only on the conditioning and the target size, never on the step, so it is built once per
run and shared by every step. Padded prompt rows are dropped from the prefix entirely: nobody may attend to
them and nothing reads their outputs, so removing them is exact and needs no key mask. They still advance the
position counter, as they do in the reference, so a padded batch row gets the same RoPE as in diffusers.
"""

from dataclasses import dataclass, field

import torch

from ..vae.latents import LATENT_TOKENS_PER_SLOT


def _grid_ids(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred row/column ids of an `height x width` block, row-major: `range(-(h - h//2), h//2)`."""
    rows = torch.arange(-(height - height // 2), height // 2)
    cols = torch.arange(-(width - width // 2), width // 2)
    return rows.repeat_interleave(width), cols.repeat(height)


@dataclass(frozen=True, eq=False)
class SequenceLayout:
    """Token layout of one prompt (one distinct prefix) with its references and the target size.

    Attributes (P = kept prefix rows, T = target rows):
        prefix_len: P.
        target_shape: `(h, w)` of the target in latent tokens; T = h * w.
        ref_shapes: `(h, w)` of each reference in latent tokens, in sequence order.
        text_src: `(P_text,)` long, index into the encoder sequence of each kept text row.
        text_dst: `(P_text,)` long, the prefix row it goes to.
        ref_dst: `(sum h*w,)` long, the prefix row of each packed reference latent token.
        prefix_positions: `(P, 3)` long RoPE ids (frame, height, width); `target_positions`: `(T, 3)`.
        segments: `(start, end, is_text)` runs of the prefix: text runs are causal, each reference is one
            bidirectional block. Adjacent references are separate segments.
        block_ids: `(P,)` long, -1 on text rows, the reference index on image rows.
    """

    prefix_len: int
    target_shape: tuple[int, int]
    ref_shapes: tuple[tuple[int, int], ...]
    text_src: torch.Tensor
    text_dst: torch.Tensor
    ref_dst: torch.Tensor
    prefix_positions: torch.Tensor
    target_positions: torch.Tensor
    segments: tuple[tuple[int, int, bool], ...]
    block_ids: torch.Tensor
    # Derived tensors (RoPE tables, flex block masks) memoised per device: a layout lives for a whole run.
    derived: dict = field(default_factory=dict, repr=False)

    def memo(self, key, build):
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]

    @property
    def target_len(self) -> int:
        return self.target_shape[0] * self.target_shape[1]

    @property
    def ref_tokens(self) -> int:
        return sum(h * w for h, w in self.ref_shapes)


def build_layout(
    image_slots: torch.Tensor,
    ref_shapes: list[tuple[int, int]] | tuple[tuple[int, int], ...],
    target_shape: tuple[int, int],
    text_valid: torch.Tensor | None = None,
) -> SequenceLayout:
    """Lay out one prompt.

    Args:
        image_slots: `(L,)` bool over the encoder sequence, True at image slots.
        ref_shapes: latent `(h, w)` of each reference, in the order their slots appear.
        target_shape: latent `(h, w)` of the target.
        text_valid: `(L,)` bool, False at padded prompt positions (dropped), or None when nothing is padded.
    """
    image_slots = image_slots.detach().to("cpu", torch.bool).reshape(-1)
    slots = image_slots.tolist()
    if text_valid is None:
        valid = [True] * len(slots)
    else:
        valid = text_valid.detach().to("cpu", torch.bool).reshape(-1).tolist()
    if len(valid) != len(slots):
        raise ValueError(f"text_valid has {len(valid)} positions but image_slots has {len(slots)}.")
    ref_shapes = tuple((int(h), int(w)) for h, w in ref_shapes)
    target_shape = (int(target_shape[0]), int(target_shape[1]))
    ref_rows = sum(h * w for h, w in ref_shapes)
    slot_rows = LATENT_TOKENS_PER_SLOT * sum(slots)
    if slot_rows != ref_rows:
        raise ValueError(
            f"the prompt has {sum(slots)} image slots ({slot_rows} latent tokens) but the references hold "
            f"{ref_rows} latent tokens {list(ref_shapes)}: each reference must be encoded by the text encoder and "
            "the VAE at the same x32 size."
        )

    text_src, text_dst, ref_dst, positions, block_ids, segments = [], [], [], [], [], []
    position = 0  # shared text position, advanced by every text row (padded ones too) and by each block
    ref_index, ref_fill = 0, 0  # which reference the next image row belongs to, rows of it already placed
    row = 0  # next kept prefix row
    seg_start, seg_kind = 0, None  # current segment: start row and kind (-1 text, else reference index)

    def close_segment(kind):
        nonlocal seg_start, seg_kind
        if seg_kind is not None and kind != seg_kind:
            segments.append((seg_start, row, seg_kind < 0))
            seg_start = row
        seg_kind = kind

    for src, (is_slot, is_valid) in enumerate(zip(slots, valid)):
        if not is_slot:
            if is_valid:
                close_segment(-1)
                text_src.append(src)
                text_dst.append(row)
                positions.append((position, position, position))
                block_ids.append(-1)
                row += 1
            position += 1
            continue
        if not is_valid:
            raise ValueError(f"position {src} is an image slot but is marked as padding; only text may be padded.")
        for _ in range(LATENT_TOKENS_PER_SLOT):
            height, width = ref_shapes[ref_index]
            if ref_fill == 0:
                close_segment(ref_index)
                rows_ids, cols_ids = _grid_ids(height, width)
                block_frame = position
            ref_dst.append(row)
            positions.append((block_frame, int(rows_ids[ref_fill]), int(cols_ids[ref_fill])))
            block_ids.append(ref_index)
            row += 1
            ref_fill += 1
            if ref_fill == height * width:
                position += max(height, width)
                ref_index, ref_fill = ref_index + 1, 0
    if ref_fill:
        raise ValueError(f"reference {ref_index} got {ref_fill} of its {ref_shapes[ref_index]} latent tokens.")
    if seg_kind is not None and seg_start < row:
        segments.append((seg_start, row, seg_kind < 0))

    target_rows, target_cols = _grid_ids(*target_shape)
    target_positions = torch.stack(
        [torch.full_like(target_rows, position), target_rows, target_cols], dim=-1
    )
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return SequenceLayout(
        prefix_len=row,
        target_shape=target_shape,
        ref_shapes=ref_shapes,
        text_src=as_long(text_src),
        text_dst=as_long(text_dst),
        ref_dst=as_long(ref_dst),
        prefix_positions=as_long(positions).reshape(-1, 3),
        target_positions=target_positions,
        segments=tuple(segments),
        block_ids=as_long(block_ids),
    )
