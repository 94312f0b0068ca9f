"""The Model Loader's weight_dtype: the dtype the DiT computes in and, for fp8, how its weights are stored
(model/loaders/checkpoint.py; a GGUF file's compute dtype)."""

from ..loaders.checkpoint import WEIGHT_DTYPES
from .plugin import Feature, Supported, one_of

FEATURE = Feature(
    name="weights", label="the Model Loader's weight_dtype",
    fields={"weights": "default"},
    is_on=lambda record: record.weights != "default",
    check=lambda record: one_of("weight_dtype", record.weights, WEIGHT_DTYPES),
    verdicts={
        "cache": Supported("the cache stores rows in the compute dtype or its own int8 / int4"),
        "step_cache": Supported("the step cache reads the blocks' outputs in fp32, whatever the weights"),
        "control": Supported("the control net keeps its own dtype and computes in the model's"),
        "compile": Supported("every weight format's layer runs inside the compiled block"),
        "devices": Supported("each worker loads the file with this weight_dtype"),
        "lora": Supported("a LoRA runs as a branch beside weights of any format"),
    },
    route_inputs={"QI21ModelLoader": ("model_name", "weight_dtype")},
)
