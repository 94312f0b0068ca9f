"""ComfyUI nodes (V3 schema) for Qwen-Image 2.1: thin wrappers around `model/`, with `bridge.py` the one module
that talks to ComfyUI. Node ids, inputs and outputs follow the contract in the design notes; saved workflows
match widget values by position, so inputs are only ever appended."""

from .bridge import ComfyExtension, io
from .conditioning import QI21Reference, QI21TextEncode
from .decode import QI21VAEDecode
from .loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
from .samplers import QI21Sampler, QI21TurboSampler

NODES = [QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader, QI21Reference, QI21TextEncode, QI21Sampler,
         QI21TurboSampler, QI21VAEDecode]


class QwenImage21Extension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> QwenImage21Extension:
    return QwenImage21Extension()
