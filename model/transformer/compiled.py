"""Regional compilation: one `torch.compile`d block forward that every block of a model (and of its Fun ControlNet)
runs, with dynamic shapes, so prompt length, reference count and image size never recompile it.

Why one block and not the model: what must never sit inside a graph runs between blocks or around them. The interrupt
check, the control stream's bookkeeping and the step cache (the forward's block hooks, hooks.py; ComfyUI's interrupt
check takes an `RLock`), progress and previews (the sampler) and weight streaming (forward hooks around
`Block.__call__`, which calls `Block.forward`, which calls the compiled `Block.run`) all stay eager. Inside a block
everything is tensor maths over what it is handed (`Rows`: tensors, ints and tuples; `LayerKV`: that layer's views of
the prefix cache), so one graph serves every layer; the prefill's per-segment attention is one opaque operator
(`attention.block_causal_attention`).

Per mode (and last block or not) one compiled function with a cache of its own: a run makes three graphs, the
prefill's blocks, its last block (which drops the prefix rows) and the cached steps' blocks, and a ControlNet block
adds its own (its class is part of the guards). A block the graphs cannot take runs eagerly (`takes`): a
host-side prefix cache (its slot ring fetches by layer) and the flex prefill (its kernel is compiled on CUDA by
itself, attention.py).

`"blocks+cudagraphs"` runs the cached steps' blocks under inductor's `reduce-overhead` mode on CUDA (CUDA graphs:
a step's 32 block launches become replays); the prefill stays as in `"blocks"` (its shapes are met once per run).
The cached step has no host sync (sampling/denoiser.py) and reads the prefix cache through views made once per
filling, marked as static addresses so a replay reads them in place instead of copying them in first. Elsewhere it
is the same as `"blocks"`.
"""

import contextlib
import weakref

import torch

from ..prefix_cache.layout import LayerKV

COMPILE_MODES = ("off", "blocks", "blocks+cudagraphs")


# One function per mode and per last block or not, each a code object of its own, because dynamo keeps its compiled
# graphs per code object and gives each at most `recompile_limit` (8) before it silently runs that code eagerly. What
# still makes new graphs within one is what a Python loop in a block unrolls (one prompt or two with CFG; one
# sample or several) and the block's class (a ControlNet block): at most 2 x 2 x 2 = 8.
def _uncached(block, x, mods, rows, kv, drop_prefix):
    # a fresh buffer instead of updating `x` in place: a graph that mutates an input copies it back, and CUDA
    # graphs refuse it; inductor fuses the clone into the first residual add
    return block.run(x.clone(), mods, rows, kv, drop_prefix)


def _uncached_last(block, x, mods, rows, kv, drop_prefix):
    return block.run(x.clone(), mods, rows, kv, drop_prefix)


def _prefill(block, x, mods, rows, kv, drop_prefix):
    return block.run(x.clone(), mods, rows, kv, drop_prefix)


def _prefill_last(block, x, mods, rows, kv, drop_prefix):
    return block.run(x.clone(), mods, rows, kv, drop_prefix)


def _cached(block, x, mods, rows, kv, drop_prefix):  # a cached step has no prefix rows to drop: no last variant
    return block.run(x.clone(), mods, rows, kv, drop_prefix)


_RUNS = {("uncached", False): _uncached, ("uncached", True): _uncached_last, ("prefill", False): _prefill,
         ("prefill", True): _prefill_last, ("cached", False): _cached}


class CompiledBlocks:
    """The compiled block forward of one mode of `COMPILE_MODES` (not "off"); `Block.forward` calls it as
    `compiled(block, x, mods, rows, kv, drop_prefix)` when `takes(rows, kv)`. Compiles on first use of each mode.
    `backend` is torch.compile's (the tests count graphs with "eager", which traces the same graphs in a fraction of
    inductor's time)."""

    def __init__(self, mode: str, backend: str = "inductor"):
        if mode not in COMPILE_MODES or mode == "off":
            raise ValueError(f"compile mode must be one of {COMPILE_MODES[1:]}, got {mode!r}.")
        self.mode, self.backend = mode, backend
        self._compiled = {}
        self._warm = weakref.WeakKeyDictionary()  # block -> (dtype, device) it last ran eagerly with

    def takes(self, rows, kv: LayerKV | None) -> bool:
        """Whether these inputs run compiled (module docstring: a host cache and the flex prefill run eagerly)."""
        if kv is not None and not kv.compilable:
            return False
        return not any(mask is not None for mask in rows.chunk_masks)

    def graphed(self, rows, device: torch.device) -> bool:
        """Whether this call replays a CUDA graph: a cached step on CUDA in `"blocks+cudagraphs"`."""
        return self.mode == "blocks+cudagraphs" and rows.mode == "cached" and device.type == "cuda"

    def __call__(self, block, x, mods, rows, kv, drop_prefix):
        # A block's first call on a dtype and device runs eagerly: what it builds lazily (a LoRA branch's stacked
        # pairs per row range) is then in place before a graph is traced, so no graph guards on the empty state and
        # is traced again when it fills.
        if self._warm.get(block) != (x.dtype, x.device):
            self._warm[block] = (x.dtype, x.device)
            return block.run(x, mods, rows, kv, drop_prefix)
        graphed = self.graphed(rows, x.device)
        key = (rows.mode, drop_prefix, graphed)
        fn = self._compiled.get(key)
        if fn is None:
            options = {"mode": "reduce-overhead"} if graphed else {}
            fn = self._compiled[key] = torch.compile(_RUNS[rows.mode, drop_prefix], dynamic=True, backend=self.backend,
                                                     **options)
        if graphed:
            _mark_static(kv)
        if x._base is not None:  # the first block's input may be a view (of the embedded target): a graph traced for
            x = x.clone()  # a view guards on its base, which every later block's fresh input lacks
        # Without duck sizing: by default two sizes that happen to be equal when a graph is traced (a prompt of as
        # many rows as the target, three segments in a three-layer cache) become one symbol, and the next prompt
        # where they differ recompiles. The setting is read when a graph is traced, so it is scoped to our calls.
        with _no_duck_shapes():
            return fn(block, x, mods, rows, kv, drop_prefix)


def _no_duck_shapes():
    try:  # a private setting: where this torch has none, its default (duck sizing) stays
        from torch.fx.experimental import _config as shape_config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(shape_config, "use_duck_shape"):
        return contextlib.nullcontext()
    return shape_config.patch(use_duck_shape=False)


def _mark_static(kv: LayerKV) -> None:
    """Tell CUDA graphs the cache views keep their addresses (they are made once per filling): a replay then reads
    them where they are, instead of copying every layer's prefix keys and values into a buffer of its own first."""
    for chain in kv.parts:
        for key, value in chain:
            for tensor in (key, value):
                if getattr(tensor, "_dynamo_static_input_type", None) is None:
                    torch._dynamo.mark_static_address(tensor)


def compile_blocks(model, mode: str, backend: str = "inductor") -> None:
    """Make every block of `model` (a `QwenImage21DiT`) run through one `CompiledBlocks` of `mode`, or eagerly again
    with "off". The blocks of a Fun ControlNet applied later share it (`loaders/controlnet.apply_controlnet`)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}.")
    compiled = None if mode == "off" else CompiledBlocks(mode, backend)
    control = getattr(model, "control_net", None)
    for block in list(model.blocks) + (list(control.blocks) if control is not None else []):
        block.compiled = compiled


def begin_step(model) -> None:
    """Before a forward: under CUDA graphs, tell the graph trees a new step starts, so the previous step's outputs
    (held by nobody now: the sampler keeps its own copies) may be overwritten by this step's replays."""
    compiled = model.blocks[0].compiled if len(model.blocks) else None  # the mode is the compiled forward's own
    if compiled is not None and compiled.mode == "blocks+cudagraphs":
        torch.compiler.cudagraph_mark_step_begin()
