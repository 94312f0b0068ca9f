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
                "T8's; see docs/measurements.md before relying on it). taylor: a forecast in sigma through the last "
                "order + 1 full steps' changes (TaylorSeer's idea; order 1 is extrapolate's line). off: every block "
                "runs (exact).")
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
#: The `mode` input's choices: T8's rule, its first-order replay and the forecast of order 1-2 (`order`); the other
#: step methods are the inputs appended after `preset` (a front/back split, a steps mask, a calibrated schedule).
NODE_MODES = ("t8", "extrapolate", "taylor", "off")
#: The `preset` input: "custom" uses the other widgets (every workflow saved before the input existed); a preset
#: replaces all of them (model/sampling/step_cache_presets.json, chosen from docs/images/step_cache_curve.png).
CUSTOM = "custom"
PRESET_TOOLTIP = ("custom: the other inputs. A preset replaces every other input with a complete setting measured "
                  "on the trained toy (docs/step-cache.md). near-exact: cache-dit's DBCache rule with a first-order "
                  "forecast, 0.06 for edits (1.2x, 66 dB there at cfg 1). balanced / fast: 8 / 5 full steps of a "
                  "schedule calibrated offline at cfg 1; the other steps run no block and forecast the DiT's change "
                  "(2.7x / 3.5x, 47 / 41 dB there at cfg 1; far lower at cfg 4). A toy's numbers rank the settings; "
                  "they bound nothing about the real model.")
ORDER_TOOLTIP = ("mode taylor only: the forecast's order, 1 (a line through the last two full steps' changes) or 2 "
                 "(a parabola through the last three). The presets use 1.")
PROBE_TOOLTIP = ("The first blocks whose change decides a skip and that always run (1 = T8's block 0). 0: no probe, "
                 "a skipped step runs no block at all: only with a steps mask or a schedule, which decide alone.")
BACK_TOOLTIP = ("A skipped step still runs the last this many blocks on the forecast (cache-dit's DBCache Bn), which "
                "corrects part of its error; only on steps that read the prefix cache. 0: none, as T8.")
MASK_TOOLTIP = ("Steps mask (cache-dit's): the first full_first steps, every full_every-th step after them and the "
                "last full_last steps always run in full; any other step skips when its change is under the "
                "threshold, or always with probe_blocks 0. All 0: no mask, the threshold and the window decide.")
SCHEDULE_TOOLTIP = ("A schedule of full steps (DPCache's idea): shares of the run, comma separated (step i of n at "
                    "i / n, e.g. 0, 0.075, 0.175); the other steps skip when their change is under the threshold, or "
                    "always with probe_blocks 0. Empty: no schedule. The balanced and fast presets carry calibrated "
                    "ones.")
_told = set()  # the retired choices already logged in this process


def parse_schedule(text: str) -> tuple:
    """The `schedule` input ("0, 0.075, 0.175") as shares of the run; "" is none. A bad entry is named."""
    shares = []
    for part in (text or "").replace(";", ",").split(","):
        if not part.strip():
            continue
        try:
            share = float(part)
        except ValueError:
            raise ValueError(f"schedule must be shares of the run in [0, 1), comma separated (e.g. 0, 0.075, 0.175); "
                             f"{part.strip()[:40]!r} is not a number.") from None
        if not 0.0 <= share < 1.0:
            raise ValueError(f"schedule must be shares of the run in [0, 1); got {share!r}.")
        shares.append(share)
    return tuple(shares)


def method_options(mode, threshold, edit_threshold, start_percent, end_percent, max_skips, order=1, probe_blocks=1,
                   back_blocks=0, full_first=0, full_every=0, full_last=0, schedule="") -> StepCacheOptions:
    """The widgets as one `StepCacheOptions`: a schedule decides when it lists steps, else a mask when any of its
    counts is above 0, else the indicator (T8's window and skip cap)."""
    shares = parse_schedule(schedule)
    masked = full_first or full_every or full_last
    if shares and masked:
        raise ValueError("schedule and full_first / full_every / full_last are two ways to pick the full steps; set "
                         "one (empty the schedule, or set the three to 0).")
    decide = "schedule" if shares else "mask" if masked else "indicator"
    return StepCacheOptions(mode, float(threshold), float(edit_threshold), float(start_percent), float(end_percent),
                            int(max_skips), probe_blocks=int(probe_blocks), back_blocks=int(back_blocks),
                            order=int(order), decide=decide, full_first=int(full_first), full_every=int(full_every),
                            full_last=int(full_last), schedule=shares)


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
                # the step methods' own inputs, appended and optional: their defaults are T8's rule as before
                io.Int.Input("order", default=1, min=1, max=2, optional=True, tooltip=ORDER_TOOLTIP),
                io.Int.Input("probe_blocks", default=1, min=0, max=8, optional=True, tooltip=PROBE_TOOLTIP),
                io.Int.Input("back_blocks", default=0, min=0, max=64, optional=True, tooltip=BACK_TOOLTIP),
                io.Int.Input("full_first", default=0, min=0, max=1000, optional=True, tooltip=MASK_TOOLTIP),
                io.Int.Input("full_every", default=0, min=0, max=1000, optional=True, tooltip=MASK_TOOLTIP),
                io.Int.Input("full_last", default=0, min=0, max=1000, optional=True, tooltip=MASK_TOOLTIP),
                io.String.Input("schedule", default="", optional=True, tooltip=SCHEDULE_TOOLTIP),
            ],
            outputs=[Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, start_percent=None, end_percent=None, schedule=None, **kwargs):
        ranged = widget_problem(cls, start_percent=start_percent, end_percent=end_percent, schedule=schedule, **kwargs)
        if ranged is not True:  # first: a string or 10**400 is named, never compared
            return ranged
        if isinstance(schedule, str):
            try:
                parse_schedule(schedule)
            except ValueError as error:
                return str(error)
        if start_percent is not None and end_percent is not None and not start_percent < end_percent:
            return (f"start_percent ({start_percent}) must be less than end_percent ({end_percent}), within [0, 1]: "
                    "steps are skipped only between them.")
        return True

    @classmethod
    def execute(cls, model, mode="t8", threshold=THRESHOLD, edit_threshold=EDIT_THRESHOLD,
                start_percent=START_PERCENT, end_percent=END_PERCENT, max_skips=MAX_SKIPS, control=CONTROL_CHOICES[0],
                preset=CUSTOM, order=1, probe_blocks=1, back_blocks=0, full_first=0, full_every=0, full_last=0,
                schedule="", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        methods = dict(order=order, probe_blocks=probe_blocks, back_blocks=back_blocks, full_first=full_first,
                       full_every=full_every, full_last=full_last, schedule=schedule)
        require(cls.validate_inputs(mode=mode, threshold=threshold, edit_threshold=edit_threshold,
                                    start_percent=start_percent, end_percent=end_percent, max_skips=max_skips,
                                    control=control, preset=preset, **methods))
        if control == "recompute" and control not in _told:
            _told.add(control)
            log.warning("qi21: Step Cache control = recompute is retired and runs as reuse (it changed pictures by "
                        "0.3 dB or less for 5-13% more time; docs/step-cache.md). Set control to reuse to silence "
                        "this.")
        if preset != CUSTOM:  # complete on its own: the widgets above do not apply
            return io.NodeOutput(with_options(model, step_cache=shipped_presets()[preset]))
        options = method_options(mode, threshold, edit_threshold, start_percent, end_percent, max_skips, **methods)
        return io.NodeOutput(with_options(model, step_cache=options))
