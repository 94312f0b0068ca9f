"""The Model Loader's plan: where weights and the prefix cache live for a run (model/memory/planner.py; the nodes
place them, nodes/placement.py)."""

from ..memory.planner import PLAN_CHOICES
from .plugin import Feature, Refused, Supported, one_of

FEATURE = Feature(
    name="plan", label="the Model Loader's plan",
    fields={"plan": "auto"},
    is_on=lambda record: record.plan != "auto",
    check=lambda record: one_of("plan", record.plan, PLAN_CHOICES),
    verdicts={
        "cache": Supported("the planner places the cache where the Prefix Cache node says, or refuses the run"),
        "step_cache": Supported("a skipped step brings no streamed block in; the rest streams as planned"),
        "control": Supported("the planner counts the control net's weights and cache layers"),
        "compile": Supported("streaming hooks run around the compiled block forward"),
        "devices": Refused("the memory plan places weights and cache in ComfyUI's process, while each worker holds "
                           "the whole model on its own device. Set plan auto, or leave devices empty."),
        "lora": Supported("a streamed block brings its LoRA branches with it"),
        "weights": Supported("the planner counts the weights' bytes in their format"),
    },
)
