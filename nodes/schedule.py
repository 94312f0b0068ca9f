"""The schedule as a core SIGMAS value, for ComfyUI's sigma nodes (SplitSigmas, FlipSigmas, ...) and the samplers'
`sigmas` input."""

import dataclasses

from ..model.sampling.flow_schedulers import COMFY_SCHEDULERS, scheduler_sigmas
from ..model.sampling.img2img import denoise_problem, denoise_tail, fixed_tail
from ..model.sampling.schedule import BASE_CONFIG, base_sigmas, schedule_mu, turbo_sigmas
from ..model.vae.latents import DEFAULT_SIZE, latent_tokens
from .bridge import io
from .socket_types import CATEGORY
from .validation import is_number, quoted, refuse_unknown_inputs, require, widget_problem

SCHEDULER_CHOICES = ("official", *COMFY_SCHEDULERS)


def schedule_sigmas(schedule: str, steps: int, width: int, height: int, denoise: float = 1.0,
                    scheduler: str = "official", shift_terminal: float = BASE_CONFIG.shift_terminal):
    """The samplers' own schedule: Base (shifted by the image size; 0 = 1024; stretched to end on `shift_terminal`,
    0 = no stretch) or Turbo's stored grid. For Base, `scheduler` other than "official" is ComfyUI's scheduler of
    that name for a flow model shifted by the official mu for this size (model/sampling/flow_schedulers.py; the
    stretch is the official schedule's own and does not apply to them)."""
    if schedule == "turbo":
        return fixed_tail(turbo_sigmas(), denoise)
    width, height = width or DEFAULT_SIZE, height or DEFAULT_SIZE
    if scheduler in (None, "official"):
        config = dataclasses.replace(BASE_CONFIG, shift_terminal=shift_terminal or None)
        return denoise_tail(lambda n: base_sigmas(n, width, height, config), steps, denoise)
    mu = schedule_mu(latent_tokens(width, height))
    return denoise_tail(lambda n: scheduler_sigmas(scheduler, n, mu), steps, denoise)


class QI21Sigmas(io.ComfyNode):
    """The official schedules as SIGMAS: edit, split or flip them with core nodes, then feed a sampler."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21Sigmas",
            display_name="Qwen-Image 2.1 Schedule",
            category=CATEGORY,
            description="The sigmas the Qwen-Image 2.1 samplers use (Base: dynamic shift from the image size, last "
                        "sigma 0.02; Turbo: the stored 8), as a SIGMAS value for core sigma nodes and the samplers' "
                        "sigmas input.",
            inputs=[
                io.Combo.Input("schedule", options=["base", "turbo"], default="base",
                               tooltip="base: the official 40-step schedule family; turbo: the stored 8-sigma grid "
                                       "the Turbo model was distilled for."),
                io.Int.Input("steps", default=40, min=1, max=200, tooltip="Base steps (ignored for turbo)."),
                io.Int.Input("width", default=0, min=0, max=4096, step=32,
                             tooltip="The image width the Base schedule is shifted for (0 = 1024); use the sampler's."),
                io.Int.Input("height", default=0, min=0, max=4096, step=32,
                             tooltip="The image height the Base schedule is shifted for (0 = 1024)."),
                io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01, optional=True,
                               tooltip="Below 1: the last steps of a longer schedule, as ComfyUI's schedulers do "
                                       "(img2img). For turbo: the last round(8 * denoise) of its 8 steps."),
                io.Combo.Input("scheduler", options=list(SCHEDULER_CHOICES), default="official", optional=True,
                               tooltip="official: the released Base schedule (dynamic shift, last sigma 0.02). The "
                                       "others are ComfyUI's schedulers, computed as ComfyUI does for a flow model "
                                       "shifted by the official mu for this size. Turbo always keeps its stored 8."),
                io.Float.Input("shift_terminal", default=BASE_CONFIG.shift_terminal, min=0.0, max=0.5, step=0.01,
                               optional=True,
                               tooltip="Base only: the last sigma before 0 that the schedule is stretched to (the "
                                       "official 0.02). 0 = no stretch: the size-shifted schedule as is, which "
                                       "lightx2v's Lightning LoRA was trained with."),
            ],
            outputs=[io.Sigmas.Output(display_name="SIGMAS")],
        )

    @classmethod
    def validate_inputs(cls, denoise=1.0, **kwargs):
        if is_number(denoise) and not 0.0 < denoise <= 1.0:
            return f"denoise = {quoted(denoise)}: use a value in (0, 1] (0 would be a schedule without a step)."
        steps = kwargs.get("steps")
        ranged = widget_problem(cls, denoise=denoise, steps=steps)  # no arithmetic on 10**400 or a string
        if ranged is not True:
            return ranged
        if denoise is not None and steps is not None and kwargs.get("schedule") != "turbo":
            problem = denoise_problem(denoise, steps)  # a tiny denoise would build a huge schedule
            if problem is not None:
                return problem
        return widget_problem(cls, denoise=denoise, **kwargs)

    @classmethod
    def execute(cls, schedule, steps, width, height, denoise=1.0, scheduler="official",
                shift_terminal=BASE_CONFIG.shift_terminal, **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        require(cls.validate_inputs(schedule=schedule, steps=steps, width=width, height=height, denoise=denoise,
                                    scheduler=scheduler, shift_terminal=shift_terminal))
        return io.NodeOutput(schedule_sigmas(schedule, steps, width, height, denoise, scheduler, shift_terminal))
