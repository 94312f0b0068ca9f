"""The prefix KV cache, the pack's central feature, in one room (docs/prefix-cache.md explains why it is exact).

The prompt and the references (the prefix) are modulated with t = 0 and never read the target, so their post-RoPE
keys and values are the same at every step: the first model call fills them, every later call reads them.

What the cache is (data):
    layout.py           `PrefixKVCache`: per layer, the prefix rows' keys and values as a tree of row parts
                        (`LayerKV` is one layer's view a block reads and writes)
    leading_runs.py     content digests of a prefix's leading runs: which rows two prefixes share
    storage_formats.py  how rows are stored: the model's dtype, or int8 / int4 per token through comfy-kitchen
    storage_choice.py   `CacheOptions`: the Prefix Cache node's device and dtype, as the options record holds it
    kept_entries.py     `PrefixCacheStore`: the caches kept between runs, their budget, eviction and monitoring

What happens to it (lifecycle):
    lifecycle.py        one run's caches: planned from the kept entries (reuse), filled on the first call (fill),
                        read on every later one, then handed back to the store (keep) or freed (free)
    host_moves.py       a cache held in host memory and moved to the compute device one layer ahead (move)

The DiT (model/transformer/) fills and reads a `PrefixKVCache` it is given; the sampling loop
(model/sampling/loop.py) owns one run's `RunCaches`; the nodes own the kept store (nodes/placement.py).
Nothing here imports the DiT: the package sits below it in the floor plan (tests/test_import_graph.py).
"""
