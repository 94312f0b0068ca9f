"""The Fun ControlNet (Apply Fun ControlNet node): a second stream of blocks that adds to the DiT's rows on the
model calls inside its window (model/transformer/controlnet.py holds the stream; model/loaders/controlnet.py attaches
its blocks to a model copy; `apply_controlnet` here records the `ControlPatch` on the copy's record, the one place
that says a copy is controlled). Its calls read a controlled prefix cache, the others a plain one
(prefix_cache/lifecycle.py): its run part says which calls are in its window (`phase`) and what that cache adds."""

from ..loaders.controlnet import attach_controlnet
from ..transformer.controlnet import ControlPatch, FunControlNet
from .plugin import Feature, RunPart, Supported
from .record import record_on


def apply_controlnet(model, net: FunControlNet, hint_for, strength: float = 1.0, start_percent: float = 0.0,
                     end_percent: float = 1.0, inputs: tuple[str, ...] = ("control_image",)):
    """`model` with the control net applied, as a new model object sharing every weight with `model` (which is
    never changed), like `apply_lora`; LoRAs chain before or after it. `hint_for(grid)` builds the control latent
    `(h*w, 129)` for a target grid. Strength 0 or no input returns `model` itself, as ComfyUI core does."""
    new, patch = attach_controlnet(model, net, hint_for, strength, start_percent, end_percent, inputs)
    if patch is None:
        return model
    new.options = record_on(model).replace(control=patch)  # one per model: attach refused a second one
    return new


def _check(record) -> None:
    if record.control is not None and not isinstance(record.control, ControlPatch):
        raise ValueError(f"control must be a ControlPatch or None; got {type(record.control).__name__}.")


class ControlPart(RunPart):
    def __init__(self, model, control: ControlPatch, run):
        self.model, self.control, self.run = model, control, run

    def phase(self, sigma: float) -> bool:
        return self.control.active(sigma)

    def phase_cache(self) -> ControlPatch:
        return self.control

    def prepare(self, calls_in_window: bool) -> None:
        """The control latent (the VAE encodes) before the first call's clock."""
        if calls_in_window:
            self.control.hint(self.run.grid, self.run.device, self.run.dtype)

    def hooks(self, call) -> tuple:
        if not call.phase:
            return ()
        run = self.run
        return (self.control.stream(run.grid, run.num_layers, run.device, run.dtype, net=self.model.control_net),)

    def reads_sigma(self) -> bool:
        return True

    def finish(self, report: dict, notes: list, run) -> None:
        report["control"] = {**self.control.report(), "active_steps": run.active_steps,
                             "cache_bytes": run.caches.stream_bytes() if run.caches is not None else {}}


FEATURE = Feature(
    name="control", label="the Apply Fun ControlNet node",
    fields={"control": None},  # the applied ControlPatch; its blocks are the copy's `control_net` child
    is_on=lambda record: record.control is not None,
    check=_check,
    verdicts={
        "cache": Supported("the control's prefix keys and values are more layers of the same cache"),
        "step_cache": Supported("the skipped blocks' residual replays the control's skips"),
    },
    start_run=lambda model, record, run: ControlPart(model, record.control, run),
    route_inputs={"QI21ControlNetApply": ("model", "control_net", "strength"),
                  "QI21ControlNetLoader": ("control_net_name", "weight_dtype")},
)
