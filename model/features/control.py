"""The Fun ControlNet (Apply Fun ControlNet node): a second stream of blocks that adds to the DiT's rows on the
model calls inside its window (model/transformer/controlnet.py holds the stream; model/loaders/controlnet.py applies
it to a model copy). Its calls read a controlled prefix cache, the others a plain one (prefix_cache/lifecycle.py):
its run part says which calls are in its window (`phase`)."""

from .plugin import Feature, RunPart, Supported


class ControlPart(RunPart):
    def __init__(self, model, run):
        self.model, self.control, self.run = model, model.control, run

    def phase(self, sigma: float) -> bool:
        return self.control.active(sigma)

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
    fields={"control": None},  # the applied ControlNet's file name; the stream is on the copy
    is_on=lambda record: record.control is not None,
    verdicts={
        "cache": Supported("the control's prefix keys and values are more layers of the same cache"),
        "step_cache": Supported("the skipped blocks' residual replays the control's skips"),
    },
    start_run=lambda model, record, run: ControlPart(model, run),
    route_inputs={"QI21ControlNetApply": ("model", "control_net", "strength"),
                  "QI21ControlNetLoader": ("control_net_name", "weight_dtype")},
)
