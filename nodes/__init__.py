"""ComfyUI nodes (V3 schema) for Qwen-Image 2.1: thin wrappers around `model/`, with `bridge.py` the one module
that talks to ComfyUI. Node ids, input names and their order are a contract (listed in README.md, "Nodes"):
saved workflows match widget values by position, so inputs are only ever appended, and `NODES` only grows.

Imported as the top-level package `nodes` (the repository root on `sys.path`: `python -m nodes.route_key` there)
it defines nothing: the node modules import `../model`, which has no parent package then, and the one module run
that way, route_key.py, stands alone. Inside ComfyUI (whose own `nodes` module is top-level) and the tests the pack
is a package, so this is `<pack>.nodes` and everything below is defined."""

if __name__ == "nodes":  # no parent package: only the standalone route_key.py can be used
    __all__ = []
else:
    from .bridge import ComfyExtension, io
    from .cache import QI21CacheOptions
    from .conditioning import QI21Reference, QI21TextEncode
    from .controlnet import QI21ControlNetApply, QI21ControlNetLoader
    from .decode import QI21VAEDecode
    from .encode import QI21VAEEncode
    from .loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
    from .lora import QI21LoraLoader
    from .observability import register_routes
    from .samplers import QI21Sampler, QI21TurboSampler
    from .schedule import QI21Sigmas
    from .step_cache import QI21StepCache

    NODES = [QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader, QI21Reference, QI21TextEncode, QI21Sampler,
             QI21TurboSampler, QI21VAEDecode, QI21Sigmas, QI21VAEEncode, QI21LoraLoader, QI21ControlNetLoader,
             QI21ControlNetApply, QI21CacheOptions, QI21StepCache]

    register_routes()  # /qi21/route_key, /qi21/caches, /qi21/metrics on ComfyUI's server (nothing without it)

    class QwenImage21Extension(ComfyExtension):
        async def get_node_list(self) -> list[type[io.ComfyNode]]:
            return list(NODES)

    async def comfy_entrypoint() -> QwenImage21Extension:
        return QwenImage21Extension()
