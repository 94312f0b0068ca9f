"""The Model Loader's compile: one torch.compile'd block forward shared by every block (model/transformer/compiled.py
compiles it when the loader builds the model; the hooks stay eager between the compiled blocks)."""

from ..transformer.compiled import COMPILE_MODES, compile_blocks
from .plugin import Feature, Supported, one_of
from .record import record_on


def compile_model(model, mode: str, backend: str = "inductor") -> None:
    """Compile `model`'s blocks in place with `mode` ("off": eager again) and say so on its record. In place: for a
    model only the caller holds (a loader's, a test's); the Model Loader does the same through `with_options`."""
    compile_blocks(model, mode, backend)
    model.options = record_on(model).replace(compile=mode)

FEATURE = Feature(
    name="compile", label="the Model Loader's compile",
    fields={"compile": "off"},
    is_on=lambda record: record.compile != "off",
    check=lambda record: one_of("compile", record.compile, COMPILE_MODES),
    verdicts={
        "cache": Supported("a host-side cache runs its blocks eagerly; the compiled forward takes the rest"),
        "step_cache": Supported("the step cache works between blocks, outside the compiled block forward"),
        "control": Supported("the control blocks run the model's compiled block forward"),
    },
)
