"""The LoRA loader: a LoRA file from ComfyUI's `loras` folder on a Qwen-Image 2.1 model (model/loaders/lora.py).

Like ComfyUI's LoraLoader it never changes the model it is given: it returns a copy that shares every weight
with it (no second copy of the DiT) and runs the LoRA as a low-rank branch, so another branch of the graph
that uses the model without the LoRA gets the model without the LoRA.
"""

import functools

from ..model.features.lora import apply_lora
from ..model.options import with_lora
from . import bridge
from .bridge import io
from .loaders import checked_path, file_changed_key, file_problem, load_or_free
from .socket_types import CATEGORY, Model
from .validation import refuse_unknown_inputs

MAX_STRENGTH = 10.0


class QI21LoraLoader(io.ComfyNode):
    """Applies one LoRA at a strength; chain several nodes to stack LoRAs."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21LoraLoader",
            display_name="Qwen-Image 2.1 LoRA",
            category=CATEGORY,
            description="Applies a Qwen-Image 2.1 LoRA (diffusers/PEFT, kohya/musubi, ComfyUI or LyCORIS LoCon keys) "
                        "to the model. The input model is not changed and no weight is copied: the LoRA runs as a "
                        "low-rank branch next to the weights, exact on bf16, fp16, fp32, fp8, quantized and GGUF "
                        "models. Full-weight patches in the file (.diff, .set_weight, as ComfyUI's LoRA extraction "
                        "writes them) apply as in ComfyUI. Chain nodes to stack LoRAs; the sampler's report lists "
                        "them.",
            inputs=[
                Model.Input("model"),
                io.Combo.Input("lora_name", options=bridge.model_choices("loras"),
                               tooltip="A LoRA trained for Qwen-Image 2.1, in models/loras (.safetensors). LoRAs for "
                                       "other models (Qwen-Image 1.x, Flux, SDXL) are refused by name."),
                io.Float.Input("strength", default=1.0, min=-MAX_STRENGTH, max=MAX_STRENGTH, step=0.01,
                               tooltip="How strongly the LoRA applies: the layer gets strength * alpha / rank * up @ "
                                       "down. 1 is what it was trained for; 0 turns it off; negative inverts it."),
            ],
            outputs=[Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, lora_name=None, **kwargs):
        return file_problem(cls, "loras", lora_name, **kwargs)

    @classmethod
    def fingerprint_inputs(cls, lora_name=None, **kwargs):
        return file_changed_key("loras", lora_name)

    @classmethod
    def execute(cls, model, lora_name, strength, **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        path = checked_path(cls, "loras", lora_name, strength=strength)
        apply = functools.partial(load_or_free, apply_lora)
        return io.NodeOutput(with_lora(model, path, strength, lora_name, apply))

