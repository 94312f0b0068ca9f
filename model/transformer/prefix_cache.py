"""The prefix KV cache: post-RoPE keys and values of the prefix rows, for every layer.

Valid only because prefix rows (text and references) are modulated with t = 0 and never attend to the
target: their keys and values are the same at every denoising step. The first step (prefill) fills the
cache; later steps run only the target rows and attend over `[cached prefix | target]`.

The cache owns exactly its payload: one `(layers, 2, P, heads, head_dim)` tensor per distinct prefix,
written with `copy_` from the prefill's keys and values, never a view that would pin the prefill buffers.
All samples of a batch that share a prompt read the same copy.
"""

import torch


class PrefixKVCache:
    """Keys and values of one or more distinct prefixes (one per prompt of the batch), for every layer.

    `kv[g]` is `(layers, 2, P_g, heads, head_dim)`: `[layer, 0]` keys and `[layer, 1]` values, post norm and
    RoPE. Build it empty, let the model's prefill fill it, then pass it to the cached steps.
    """

    def __init__(self):
        self.kv: list[torch.Tensor] | None = None
        self.prefix_lens: tuple[int, ...] = ()

    # -- filled by the model ------------------------------------------------------------------------------
    def allocate(self, prefix_lens, layers: int, heads: int, head_dim: int, dtype, device) -> None:
        self.free()
        self.prefix_lens = tuple(int(p) for p in prefix_lens)
        self.kv = [
            torch.empty(layers, 2, p, heads, head_dim, dtype=dtype, device=device) for p in self.prefix_lens
        ]

    def layer_kv(self, layer: int) -> "LayerKV":
        """This cache as one block sees it: its own layer's keys and values."""
        return LayerKV(self, layer)

    # -- lifetime -----------------------------------------------------------------------------------------
    @property
    def filled(self) -> bool:
        return self.kv is not None

    @property
    def nbytes(self) -> int:
        """Bytes held: `2 * layers * heads * head_dim * prefix_tokens * itemsize`, summed over prefixes."""
        if self.kv is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.kv)

    @property
    def device(self) -> torch.device | None:
        return None if self.kv is None else self.kv[0].device

    def to(self, device) -> "PrefixKVCache":
        """Move the payload (e.g. to CPU while the model is offloaded); returns self."""
        if self.kv is not None:
            self.kv = [t.to(device) for t in self.kv]
        return self

    def free(self) -> None:
        """Drop the payload now; the object can be filled again by another prefill."""
        self.kv = None
        self.prefix_lens = ()

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
        if (shape[0], shape[3], shape[4]) != (layers, heads, head_dim):
            raise ValueError(
                f"the prefix cache was filled by a model with {shape[0]} layers of {shape[3]}x{shape[4]} heads, "
                f"this one has {layers} layers of {heads}x{head_dim}."
            )


class LayerKV:
    """One layer's view of a `PrefixKVCache`: what a block fills in a prefill and reads in a cached step."""

    __slots__ = ("cache", "layer")

    def __init__(self, cache: PrefixKVCache, layer: int):
        self.cache, self.layer = cache, layer

    def store(self, group: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Copy prefix `group`'s keys/values `(P, heads, head_dim)` into the cache's own storage."""
        entry = self.cache.kv[group][self.layer]
        entry[0].copy_(key)
        entry[1].copy_(value)

    def read(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix `group`'s keys and values `(P, heads, head_dim)` for this layer."""
        entry = self.cache.kv[group][self.layer]
        return entry[0], entry[1]
