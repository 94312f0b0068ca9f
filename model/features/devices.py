"""The Model Loader's devices / parallel: the DiT split over worker processes (model/parallel/; the loader returns
a `SplitModel` recipe and the run goes to its workers)."""

from .plugin import Feature, Refused, Supported, one_of

PARALLEL_MODES = ("off", "ulysses", "cfg")  # off with one device: the whole DiT in one worker there

FEATURE = Feature(
    name="devices", label="the Model Loader's devices / parallel",
    fields={"devices": (), "parallel": "off"},  # () runs the DiT in this process
    is_on=lambda record: bool(record.devices),
    check=lambda record: one_of("parallel", record.parallel, PARALLEL_MODES),
    verdicts={
        "cache": Refused("the worker processes keep their head-sharded prefix cache on their own devices in the "
                         "model's dtype. Remove the Prefix Cache node, or leave devices empty."),
        "step_cache": Supported("the ranks reduce the indicator over their group and decide together "
                                "(parallel/agreement.py)"),
        "control": Refused("the control stream does not run split over worker processes yet. Leave devices empty "
                           "to use the ControlNet."),
        "compile": Refused("the worker processes run their blocks eagerly. Set compile off, or leave devices empty "
                           "to compile in ComfyUI's process."),
    },
)
