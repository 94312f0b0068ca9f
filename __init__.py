"""Qwen-Image 2.1 for ComfyUI: exact, prefix-cached Base and Turbo sampling.

This file is what ComfyUI imports. It stays tiny and imports nothing heavy at module level beyond the nodes:
`model/` is plain PyTorch and never imports ComfyUI, and `nodes/bridge.py` falls back to a stand-in of the
V3 node API without ComfyUI, so the pack and its tests import cleanly anywhere. No model is loaded here.
"""

WEB_DIRECTORY = "./web"

try:
    import comfy_api.latest  # noqa: F401  (present only inside ComfyUI)
except ImportError:
    __all__ = ["WEB_DIRECTORY"]
else:
    from .nodes import comfy_entrypoint  # noqa: F401

    __all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
