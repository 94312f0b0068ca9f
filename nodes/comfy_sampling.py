"""A ComfyUI SAMPLER (from KSamplerSelect or any node that makes one) run over our model.

A SAMPLER's `sample(model_wrap, sigmas, extra_args, callback, noise, latent_image, denoise_mask, disable_pbar)`
calls `model_wrap(x, sigma, model_options=..., seed=...)` for x0 and reads a few things around it: the model's
`model_sampling` (as `model_wrap.inner_model.model_sampling` and through
`model_wrap.model_patcher.get_model_object("model_sampling")`), `inner_model.scale_latent_inpaint` for masks,
`model_wrap.cfg`, and the `seed` extra argument its ancestral and SDE noise is drawn from. `FlowGuider` offers exactly
that around model/sampling/denoiser.py's FlowDenoiser, in the roles ComfyUI's CFGGuider, BaseModel and ModelPatcher
play. The guidance is ours (true CFG batched in the DiT call); ComfyUI's post-CFG hooks (the CFG++ samplers read the
unguided prediction through them) get the positive and negative predictions as ComfyUI's own guidance hands them.
No ComfyUI import here: the SAMPLER comes from the graph, `model_sampling` from the bridge.
"""

from ..model.sampling.denoiser import FlowModelSampling
from . import bridge

#: Samplers whose update is not one for a flow-matching latent, refused by name when the node runs.
REFUSED = {
    "ddpm": "its step rescales the latent by 1/sqrt(1 + sigma^2) (a variance-exploding latent), which a "
            "flow-matching latent (sigma * noise + (1 - sigma) * image) is not",
}


def sampler_name(sampler) -> str:
    """A SAMPLER's name as KSamplerSelect lists it, from its sampling function (`sample_dpmpp_2m` -> dpmpp_2m)."""
    function = getattr(sampler, "sampler_function", None)
    function = getattr(function, "func", function)  # a functools.partial
    name = getattr(function, "__name__", None) or getattr(sampler, "name", None) or type(sampler).__name__
    for prefix in ("sample_",):
        name = name[len(prefix):] if name.startswith(prefix) else name
    return name.removesuffix("_function")


def check_sampler(sampler) -> str:
    """The SAMPLER's name, or a clear error when it is not a SAMPLER or cannot run over a flow denoiser."""
    if not callable(getattr(sampler, "sample", None)):
        raise ValueError(f"sampler is a {type(sampler).__name__}, not a SAMPLER; connect KSamplerSelect (or another "
                         "node with a SAMPLER output).")
    name = sampler_name(sampler)
    if name in REFUSED:
        raise ValueError(f"sampler {name} cannot run Qwen-Image 2.1: {REFUSED[name]}. Pick another one (euler, "
                         "dpmpp_2m, res_multistep, heun, uni_pc, er_sde, ...).")
    return name


class _FlowModel:
    """The BaseModel role: the model_sampling, inpainting's noise scaling, latents in and out unchanged (ours
    arrive normalised)."""

    def __init__(self, model_sampling):
        self.model_sampling = model_sampling

    def scale_latent_inpaint(self, sigma, noise, latent_image, **kwargs):
        return self.model_sampling.noise_scaling(sigma, noise, latent_image)

    def process_latent_in(self, latent):
        return latent

    def process_latent_out(self, latent):
        return latent


class _FlowPatcher:
    """The ModelPatcher role, as far as samplers read it: `get_model_object("model_sampling")` and `model`."""

    def __init__(self, model: _FlowModel):
        self.model = model
        self.model_options = {"transformer_options": {}}

    def get_model_object(self, name: str):
        return getattr(self.model, name)


class FlowGuider:
    """The `model_wrap` a SAMPLER's `sample` takes (ComfyUI's CFGGuider role) around a FlowDenoiser."""

    def __init__(self, denoiser, model_sampling):
        self.denoiser = denoiser
        self.inner_model = _FlowModel(model_sampling)
        self.model_patcher = _FlowPatcher(self.inner_model)
        self.model_options = self.model_patcher.model_options
        self.cfg = denoiser.cfg

    def __call__(self, x, timestep, model_options=None, seed=None):
        guided, cond, uncond = self.denoiser.parts(x, timestep)
        model_options = model_options or {}
        for hook in model_options.get("sampler_post_cfg_function", []):
            guided = hook({"denoised": guided, "cond_denoised": cond, "uncond_denoised": uncond, "input": x,
                           "sigma": timestep, "cond_scale": self.cfg, "model": self.inner_model, "cond": None,
                           "uncond": None, "model_options": model_options})
        return guided


def sampler_runner(sampler, *, seed: int, mu: float):
    """(name, run) for loop.sample's `sampler`: `run(denoiser, sigmas, noise, latent, mask)` calls the SAMPLER as
    ComfyUI's sampling does, the node's seed as its `seed` extra argument (ancestral/SDE noise as core draws it),
    over a flow model whose shift is `mu` (the official one for the size; 0 = identity for Turbo's grid)."""
    name = check_sampler(sampler)
    model_sampling = bridge.flow_model_sampling(FlowModelSampling, mu)

    def run(denoiser, sigmas, noise, latent, mask):
        guider = FlowGuider(denoiser, model_sampling)
        extra_args = {"model_options": {"transformer_options": {"sample_sigmas": sigmas}}, "seed": int(seed)}

        def step_done(step, denoised, x, total_steps):
            denoiser.step_done(step)

        return sampler.sample(guider, sigmas, extra_args, step_done, noise, latent, mask, True)

    return name, run
