"""The prefix-cache options node: where the cache lives and how it stores its rows, with core's `QwenImage21Cache`
vocabulary (model/prefix_cache/storage_choice.py). Like the LoRA and ControlNet nodes it returns a model copy that
shares every weight; both samplers (and a ComfyUI SAMPLER through them) read the options from the model."""

from ..model.options import with_cache_options
from ..model.prefix_cache.storage_formats import CACHE_DEVICES, CACHE_DTYPES
from .bridge import io
from .socket_types import CATEGORY, Model
from .validation import refuse_unknown_inputs, require, widget_problem

DEVICE_TOOLTIP = ("Where the prefix cache lives. auto: the memory planner's choice (on the GPU when it fits beside the "
                  "weights, else in pinned RAM). gpu: always on the GPU (a run that does not fit is refused). cpu: "
                  "pinned RAM, each layer copied in one layer ahead of use (frees VRAM; costs a copy per step). off: "
                  "no cache, every step recomputes the prompt and references (slowest; as the sampler's prefix_cache "
                  "off).")
DTYPE_TOOLTIP = ("How the cache stores each token's keys and values. default: the model's dtype (exact; 0.5 MiB per "
                 "prefix token in bf16). int8: per-token int8 with ConvRot through comfy-kitchen, 0.50x the bytes "
                 "(scales included) at about bf16's own rounding error. int4: 0.25x the bytes, a larger error (see "
                 "docs/measurements.md). A kept cache is reused only by runs with the same dtype.")


class QI21CacheOptions(io.ComfyNode):
    """The prefix cache's device and dtype for the samplers that use this model."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21CacheOptions",
            display_name="Qwen-Image 2.1 Prefix Cache",
            category=CATEGORY,
            description="Chooses where the samplers keep the prefix (prompt + references) KV cache and how they store "
                        "it, as core's QwenImage21Cache does: device auto/gpu/cpu/off, dtype default/int8/int4. int8 "
                        "halves the cache and int4 quarters it (2-4x more references or kept prompts in the same "
                        "memory); each layer is quantized once when the first step writes it and dequantized when a "
                        "step reads it. Returns a copy of the model (no weight is copied); the sampler's report shows "
                        "cache_dtype and the bytes.",
            inputs=[
                Model.Input("model"),
                io.Combo.Input("device", options=list(CACHE_DEVICES), default="auto", tooltip=DEVICE_TOOLTIP),
                io.Combo.Input("dtype", options=list(CACHE_DTYPES), default="default", tooltip=DTYPE_TOOLTIP),
            ],
            outputs=[Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, **kwargs):
        return widget_problem(cls, **kwargs)

    @classmethod
    def execute(cls, model, device="auto", dtype="default", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        require(cls.validate_inputs(device=device, dtype=dtype))
        return io.NodeOutput(with_cache_options(model, device, dtype))
