"""The step-cache node: skip the DiT's blocks 1..N-1 on steps where block 0 barely changed, keeping the prefix cache
(model/sampling/step_cache.py has the rule). Like the Prefix Cache node it returns a model copy that shares every
weight; both samplers (and a ComfyUI SAMPLER through them) read the options from the model."""

from ..model.options import with_options
from ..model.sampling.step_cache import (
    EDIT_THRESHOLD,
    END_PERCENT,
    MAX_SKIPS,
    START_PERCENT,
    THRESHOLD,
    StepCacheOptions,
)
from ..model.sampling.step_presets import shipped_presets
from .bridge import io, log
from .socket_types import CATEGORY, Model
from .validation import refuse_unknown_inputs, require, widget_problem

MODE_TOOLTIP = ("t8: T8 BlockCache's rule, what core's users know: reuse the other blocks' change from the last full "
                "step as it is. extrapolate: a straight line through the last two full steps' changes instead (not "
                "T8's; see docs/measurements.md before relying on it). off: every block runs (exact).")
THRESHOLD_TOOLTIP = ("Skip a step when the first block's output changed by less than this (relative L1 against the "
                     "last full step). Higher skips more steps and changes more detail; 0 never skips and is "
                     "bit-identical to no step cache. 0.08 is T8's default.")
EDIT_THRESHOLD_TOOLTIP = ("The threshold when the prompt has references (an edit): edits keep most of the picture, so "
                          "a smaller change already moves what matters. 0.03 is T8's advice.")
WINDOW_TOOLTIP = ("Steps are skipped only between start_percent and end_percent of the steps this run takes (img2img "
                  "and split schedules count their own steps): the first steps set the layout and the last ones the "
                  "fine detail. 0.10 to 0.85 as T8.")
MAX_SKIPS_TOOLTIP = ("At most this many skipped steps in a row; then a full step refreshes what is reused. 2 as T8; "
                     "0 never skips.")
#: The `control` input's choices. "recompute" (run the Fun ControlNet's later blocks on a skipped step) is retired: it
#: moved pictures by 0.3 dB or less for 5-13% more time (docs/step-cache.md). Still listed, so a workflow saved with
#: it passes ComfyUI's check of the value and runs, as "reuse", with one log line per process.
CONTROL_CHOICES = ("reuse", "recompute")
CONTROL_TOOLTIP = ("With a Fun ControlNet a skipped step reuses the control's effect from the last full step (T8's "
                   "way). recompute is retired and runs as reuse: it changed pictures by 0.3 dB or less for 5-13% "
                   "more time (docs/step-cache.md); it stays listed so saved workflows load.")
#: The `mode` input's choices: the widgets set T8's rule or its first-order replay; the other step methods (a
#: front/back split, a forecast, a steps mask, a calibrated schedule) come complete with a preset.
NODE_MODES = ("t8", "extrapolate", "off")
#: The `preset` input: "custom" uses the widgets above (every workflow saved before the input existed); a preset
#: replaces all of them (model/sampling/step_cache_presets.json, chosen from docs/images/step_cache_curve.png).
CUSTOM = "custom"
PRESET_TOOLTIP = ("custom: the inputs above. A preset replaces every input above with a complete setting measured on "
                  "the trained toy (docs/step-cache.md). near-exact: cache-dit's DBCache rule with a first-order "
                  "forecast (1.4x, 61 dB there). balanced / fast: 8 / 5 full steps of a schedule calibrated "
                  "offline; the other steps run no block and forecast the DiT's change (2.7x / 3.5x, 47 / 41 dB "
                  "there). A toy's numbers rank the settings; they bound nothing about the real model.")
_told = set()  # the retired choices already logged in this process


class QI21StepCache(io.ComfyNode):
    """Skips all blocks but the first on steps where the first barely changed (lossy, opt-in), beside the prefix
    cache."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21StepCache",
            display_name="Qwen-Image 2.1 Step Cache",
            category=CATEGORY,
            description="Makes the samplers run only the DiT's first block on steps where its output barely changed "
                        "since the last full step, adding the other blocks' change from that step instead (T8 "
                        "BlockCache's rule and defaults). Lossy: it changes details. The prefix cache, kept caches, "
                        "CFG, batches and the Fun ControlNet keep working; the first step is never skipped. Returns "
                        "a copy of the model (no weight is copied); the sampler's report shows the steps skipped and "
                        "the indicator of each step.",
            inputs=[
                Model.Input("model"),
                io.Combo.Input("mode", options=list(NODE_MODES), default="t8", tooltip=MODE_TOOLTIP),
                io.Float.Input("threshold", default=THRESHOLD, min=0.0, max=1.0, step=0.005,
                               tooltip=THRESHOLD_TOOLTIP),
                io.Float.Input("edit_threshold", default=EDIT_THRESHOLD, min=0.0, max=1.0, step=0.005,
                               tooltip=EDIT_THRESHOLD_TOOLTIP),
                io.Float.Input("start_percent", default=START_PERCENT, min=0.0, max=1.0, step=0.01,
                               tooltip=WINDOW_TOOLTIP),
                io.Float.Input("end_percent", default=END_PERCENT, min=0.0, max=1.0, step=0.01,
                               tooltip=WINDOW_TOOLTIP),
                io.Int.Input("max_skips", default=MAX_SKIPS, min=0, max=16, tooltip=MAX_SKIPS_TOOLTIP),
                # appended and optional: workflows saved before it load unchanged (and reuse, as they did)
                io.Combo.Input("control", options=list(CONTROL_CHOICES), default=CONTROL_CHOICES[0], optional=True,
                               tooltip=CONTROL_TOOLTIP),
                # appended and optional too: a saved workflow without it runs its widgets, as before
                io.Combo.Input("preset", options=[CUSTOM, *shipped_presets()], default=CUSTOM, optional=True,
                               tooltip=PRESET_TOOLTIP),
            ],
            outputs=[Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, start_percent=None, end_percent=None, **kwargs):
        ranged = widget_problem(cls, start_percent=start_percent, end_percent=end_percent, **kwargs)
        if ranged is not True:  # first: a string or 10**400 is named, never compared
            return ranged
        if start_percent is not None and end_percent is not None and not start_percent < end_percent:
            return (f"start_percent ({start_percent}) must be less than end_percent ({end_percent}), within [0, 1]: "
                    "steps are skipped only between them.")
        return True

    @classmethod
    def execute(cls, model, mode="t8", threshold=THRESHOLD, edit_threshold=EDIT_THRESHOLD,
                start_percent=START_PERCENT, end_percent=END_PERCENT, max_skips=MAX_SKIPS, control=CONTROL_CHOICES[0],
                preset=CUSTOM, **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        require(cls.validate_inputs(mode=mode, threshold=threshold, edit_threshold=edit_threshold,
                                    start_percent=start_percent, end_percent=end_percent, max_skips=max_skips,
                                    control=control, preset=preset))
        if control == "recompute" and control not in _told:
            _told.add(control)
            log.warning("qi21: Step Cache control = recompute is retired and runs as reuse (it changed pictures by "
                        "0.3 dB or less for 5-13% more time; docs/step-cache.md). Set control to reuse to silence "
                        "this.")
        if preset != CUSTOM:  # complete on its own: the widgets above do not apply
            return io.NodeOutput(with_options(model, step_cache=shipped_presets()[preset]))
        options = StepCacheOptions(mode, float(threshold), float(edit_threshold), float(start_percent),
                                   float(end_percent), int(max_skips))
        return io.NodeOutput(with_options(model, step_cache=options))
