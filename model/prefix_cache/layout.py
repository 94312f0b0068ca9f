"""The prefix KV cache: post-RoPE keys and values of the prefix rows, for every layer.

Valid only because prefix rows (text and references) are modulated with t = 0 and never attend to the
target: their keys and values are the same at every denoising step. The first step (prefill) fills the
cache; later steps run only the target rows and attend over `[cached prefix | target]`.

The cache owns exactly its payload: `(layers, 2, rows, heads, head_dim)` tensors written with `copy_` from the
prefill's keys and values, never views that would pin the prefill buffers. All samples of a batch that share a
prompt read the same copy.

Prefixes form a tree rather than a list: each prompt's rows are a chain of *parts*, row ranges of payload
tensors. A prompt that starts like another (CFG's negative after the same references, a new instruction after
a kept prompt's references) reads the other's tensor for the shared leading run and owns only the rows after it,
which the prefill computes as a chunk (`plan` says which, `allocate` makes the chunks). Shared tensors are
counted and held once; a part is a row range of a tensor, so a run can start from the first rows of another.

With a quantized `storage` (storage_formats.py: int8 / int4) the payload tensors are uint8 `(layers, 2, rows,
row_bytes)`: each layer's keys and values are quantized once when the prefill writes them, and dequantized into the
compute dtype when a step reads them. The prefill itself then attends over the dequantized rows too (`store` puts
them back into its buffer), so every step, a kept cache's reuse and a chunk after shared rows all read the same
numbers: a quantized run equals itself whether its rows were computed now, kept or shared.
"""

import torch

from .storage_formats import QuantizedRows


def _truncate(parts, rows: int) -> list:
    """The parts covering the first `rows` rows of a chain of `(tensor, start, end)` parts."""
    out = []
    for tensor, start, end in parts:
        if rows <= 0:
            break
        take = min(end - start, rows)
        out.append((tensor, start, start + take))
        rows -= take
    if rows > 0:
        raise ValueError("a reused prefix part is shorter than the rows planned from it.")
    return out


class PrefixKVCache:
    """Keys and values of one or more distinct prefixes (one per prompt of the batch), for every layer.

    `parts[g]` is prefix g's chain of `(tensor, start, end)`: rows `start:end` of a `(layers, 2, rows, heads,
    head_dim)` tensor (`[layer, 0]` keys, `[layer, 1]` values, post norm and RoPE). Without a `plan` every prefix is
    one part of its own tensor (`kv[g]`). Build it empty (optionally `plan` what it may reuse), let the model's
    prefill fill it, then pass it to the cached steps.
    """

    #: Whether prefixes may read rows of other prefixes' tensors (a host-side cache streams whole prefixes).
    shares_rows = True
    #: How rows are stored: None (the compute dtype) or a `QuantizedRows`; set before the prefill allocates.
    storage: QuantizedRows | None = None

    def __init__(self):
        self.kv: list[torch.Tensor] | None = None  # the distinct payload tensors this cache holds
        self.prefix_lens: tuple[int, ...] = ()
        self.parts: tuple = ()
        self.computed: tuple[tuple[int, int, int], ...] = ()  # (group, first row, end) the prefill computes
        self.runs: tuple = ()  # per prefix its `PrefixRuns` (set by whoever plans reuse; the kept store reads it)
        self.compute_dtype: torch.dtype | None = None  # what reads return (the dtype the prefill computed in)
        self._head_shape = None
        self._plan = None
        self._views: dict[int, LayerKV] = {}  # layer -> its view; made again whenever the payload changes

    # -- planned reuse ----------------------------------------------------------------------------------------
    def plan(self, prefix_lens, bases) -> None:
        """Say where each prefix's leading rows come from before the prefill allocates: `bases[g]` is None (all
        rows computed), `("parts", parts, rows)` (the first `rows` rows are the given parts of a kept cache) or
        `("group", h, rows)` (the first `rows` rows of prefix h < g of this cache)."""
        lens = tuple(int(p) for p in prefix_lens)
        if len(bases) != len(lens):
            raise ValueError(f"plan: {len(bases)} bases for {len(lens)} prefixes.")
        for g, base in enumerate(bases):
            if base is not None and not (0 <= base[2] <= lens[g] and (base[0] == "parts" or base[1] < g)):
                raise ValueError(f"plan: prefix {g} cannot start from {base[:1]} with {base[2]} rows.")
        self.free()
        self._plan = (lens, tuple(bases))

    @property
    def planned_rows(self) -> int:
        """Rows the planned prefill will compute (all of them without a plan, once allocated: `computed`)."""
        if self._plan is None:
            return sum(end - start for _, start, end in self.computed)
        lens, bases = self._plan
        return sum(p - (b[2] if b else 0) for p, b in zip(lens, bases))

    # -- filled by the model ------------------------------------------------------------------------------
    @property
    def storage_name(self) -> str:
        """"default" or the quantized storage's name (the report's `cache_dtype`, part of the store key)."""
        return "default" if self.storage is None else self.storage.name

    def row_shape(self, heads: int, head_dim: int) -> tuple[int, ...]:
        """The trailing shape of a payload tensor: `(heads, head_dim)`, or `(row_bytes,)` when quantized."""
        if self.storage is None:
            return (heads, head_dim)
        self.storage.check_width(heads * head_dim)
        return (self.storage.row_bytes(heads * head_dim),)

    def payload_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.storage is None else torch.uint8

    def new_payload(self, layers: int, rows: int, heads: int, head_dim: int, dtype, device, **kwargs) -> torch.Tensor:
        return torch.empty(layers, 2, rows, *self.row_shape(heads, head_dim), dtype=self.payload_dtype(dtype),
                           device=device, **kwargs)

    def allocate(self, prefix_lens, layers: int, heads: int, head_dim: int, dtype, device) -> None:
        """Make the tensors the prefill fills: one per prefix, or with a `plan` one per prefix for its rows after
        the reused leading run (none when nothing is left to compute)."""
        lens = tuple(int(p) for p in prefix_lens)
        plan, self._plan = self._plan, None
        if plan is not None and plan[0] != lens:
            raise ValueError(f"the prefix cache was planned for prefixes of {list(plan[0])} tokens, this step has "
                             f"{list(lens)}.")
        bases = plan[1] if plan is not None else (None,) * len(lens)
        self.free()
        self.prefix_lens = lens
        tensors, parts, computed = [], [], []
        for g, (length, base) in enumerate(zip(lens, bases)):
            reused = 0 if base is None else base[2]
            if base is None:
                chain = []
            elif base[0] == "parts":
                chain = _truncate(base[1], reused)
            else:
                chain = _truncate(parts[base[1]], reused)
            if reused < length:
                tensor = self.new_payload(layers, length - reused, heads, head_dim, dtype, device)
                chain.append((tensor, 0, length - reused))
                computed.append((g, reused, length))
            parts.append(tuple(chain))
            for tensor, _, _ in chain:
                if not any(tensor is t for t in tensors):
                    tensors.append(tensor)
        row_shape, stored = self.row_shape(heads, head_dim), self.payload_dtype(dtype)
        for tensor in tensors:
            shape = tuple(tensor.shape)
            if (shape[:2], shape[3:]) != ((layers, 2), row_shape) or tensor.device != torch.device(device) or \
                    tensor.dtype != stored:
                raise ValueError(f"a reused prefix part is {shape} {tensor.dtype} on {tensor.device}; this model "
                                 f"needs ({layers}, 2, rows, {', '.join(map(str, row_shape))}) {stored} on {device}.")
        self.kv, self.parts, self.computed = tensors, tuple(parts), tuple(computed)
        self.compute_dtype, self._head_shape = dtype, (heads, head_dim)
        self._views = {}

    def layer_kv(self, layer: int) -> "LayerKV":
        """This cache as one block sees it: its own layer's keys and values, as views made once per filling (the
        same object every step, so a cached step costs no slicing and its tensors keep their addresses)."""
        view = self._views.get(layer)
        if view is None:
            view = self._views[layer] = LayerKV(self, layer)
        return view

    def own_part(self, group: int):
        """`(tensor, start, end)` of the rows the prefill computes for `group` (its last part)."""
        if not any(g == group for g, _, _ in self.computed):
            raise ValueError(f"prefix {group} computes no rows in this prefill (all of them are reused).")
        return self.parts[group][-1]

    def decoded(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored rows `(n, row_bytes)` of keys and values as `(n, heads, head_dim)` in the compute dtype."""
        shape = self._head_shape
        width = shape[0] * shape[1]
        return tuple(self.storage.decode(rows, width, self.compute_dtype).view(rows.shape[0], *shape)
                     for rows in (key, value))

    # -- lifetime -----------------------------------------------------------------------------------------
    @property
    def filled(self) -> bool:
        return self.kv is not None

    @property
    def nbytes(self) -> int:
        """Bytes held: `2 * layers * heads * head_dim * rows * itemsize` over the distinct tensors (a run shared
        by two prefixes counts once)."""
        if self.kv is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.kv)

    @property
    def reused_rows(self) -> int:
        """Prefix rows this cache holds that its prefill did not compute (kept or shared with another prefix)."""
        return sum(self.prefix_lens) - sum(end - start for _, start, end in self.computed)

    @property
    def device(self) -> torch.device | None:
        return None if not self.kv else self.kv[0].device

    def to(self, device) -> "PrefixKVCache":
        """Move the payload (e.g. to CPU while the model is offloaded); returns self. Shared tensors stay shared."""
        if self.kv is not None:
            moved = {id(t): t.to(device) for t in self.kv}
            self.kv = [moved[id(t)] for t in self.kv]
            self.parts = tuple(tuple((moved[id(t)], s, e) for t, s, e in chain) for chain in self.parts)
            self._views = {}
        return self

    def free(self) -> None:
        """Drop this cache's references to the payload now (a tensor another cache also holds lives on there);
        the object can be filled again by another prefill."""
        self.kv = None
        self.prefix_lens = ()
        self.parts = ()
        self.computed = ()
        self._views = {}

    def check_compatible(self, prefix_lens, layers: int, heads: int, head_dim: int) -> None:
        if self.kv is None:
            raise RuntimeError("the prefix cache is empty: run the prefill step (mode='prefill') before cached steps.")
        expected = tuple(int(p) for p in prefix_lens)
        if expected != self.prefix_lens:
            raise ValueError(
                f"the prefix cache holds prefixes of {list(self.prefix_lens)} tokens but this step's conditioning "
                f"has {list(expected)}: it was filled for another prompt or reference set."
            )
        shape = tuple(self.kv[0].shape)
        if (shape[0], shape[3:]) != (layers, self.row_shape(heads, head_dim)):
            raise ValueError(
                f"the prefix cache was filled by a model with {shape[0]} layers of rows {shape[3:]}, this one has "
                f"{layers} layers of {heads}x{head_dim} heads ({self.storage_name} storage)."
            )


class LayerKV:
    """One layer's view of a `PrefixKVCache`: what a block fills in a prefill and reads in a cached step.

    It holds that layer's rows of every part as tensors (`parts[g]`: prefix g's `[(k, v), ...]` in row order;
    `own[g]`: the rows the prefill computes for g, or None), sliced once when the view is made. A block never
    indexes the payload by a layer number: a compiled block would bake the number into its graph (one graph per
    layer), while views of the same shapes give every layer the same graph.
    """

    __slots__ = ("parts", "own", "storage", "head_shape", "compute_dtype")
    #: whether a compiled block may take this view (a host cache's reads go through its slot ring: not traceable)
    compilable = True

    def __init__(self, cache: PrefixKVCache, layer: int):
        def rows(tensor, start, end):
            return tensor[layer, 0, start:end], tensor[layer, 1, start:end]

        self.parts = tuple(tuple(rows(*part) for part in chain) for chain in cache.parts)
        computes = {g for g, _, _ in cache.computed}
        self.own = tuple(rows(*chain[-1]) if g in computes else None for g, chain in enumerate(cache.parts))
        self.storage, self.head_shape, self.compute_dtype = cache.storage, cache._head_shape, cache.compute_dtype

    def store(self, group: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Copy the keys/values `(rows, heads, head_dim)` the prefill computed for prefix `group` (all its rows, or
        those after its reused leading run) into the cache's own storage."""
        own = self.own[group] if group < len(self.own) else None
        if own is None:
            raise ValueError(f"prefix {group} computes no rows in this prefill (all of them are reused).")
        if self.storage is None:
            own[0].copy_(key)
            own[1].copy_(value)
            return
        for stored, rows in zip(own, (key, value)):  # quantized once; the prefill reads back what is stored
            self.storage.encode(rows.reshape(rows.shape[0], -1), stored)
            rows.copy_(self.storage.decode(stored, rows[0].numel(), rows.dtype).view(rows.shape))

    def read_parts(self, group: int, rows: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Prefix `group`'s keys and values as views `[(k, v), ...]` in row order (its first `rows` rows if given)."""
        parts = list(self.parts[group])
        if rows is not None:
            parts = _truncate_views(parts, rows)
        return parts if self.storage is None else [self._decoded(k, v) for k, v in parts]

    def read(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix `group`'s keys and values `(P, heads, head_dim)` for this layer (a copy only when it is made of
        several parts)."""
        parts = self.read_parts(group)
        if len(parts) == 1:
            return parts[0]
        return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])

    def _decoded(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored rows `(n, row_bytes)` as `(n, heads, head_dim)` in the compute dtype (`PrefixKVCache.decoded`)."""
        width = self.head_shape[0] * self.head_shape[1]
        return tuple(self.storage.decode(rows, width, self.compute_dtype).view(rows.shape[0], *self.head_shape)
                     for rows in (key, value))


def _truncate_views(parts, rows: int) -> list:
    """The `(k, v)` views covering the first `rows` rows of a layer's chain of parts."""
    out = []
    for key, value in parts:
        if rows <= 0:
            break
        take = min(key.shape[0], rows)
        out.append((key[:take], value[:take]))
        rows -= take
    if rows > 0:
        raise ValueError("a reused prefix part is shorter than the rows planned from it.")
    return out
