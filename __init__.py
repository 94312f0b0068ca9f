"""Qwen-Image 2.1 for ComfyUI: exact, prefix-cached Base and Turbo sampling.

This file is what ComfyUI imports. It stays tiny and imports nothing heavy: `model/` is plain PyTorch and
never imports ComfyUI, so the pack and its tests import cleanly without ComfyUI installed.

The ComfyUI nodes (`nodes/`, registered through `comfy_entrypoint`) are not written yet; until they are,
ComfyUI loads this pack with no nodes.
"""

WEB_DIRECTORY = "./web"

__all__ = ["WEB_DIRECTORY"]
