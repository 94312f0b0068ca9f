"""A small stand-in for ComfyUI's V3 node API (`comfy_api.latest`), used only when ComfyUI is absent.

It covers exactly what our nodes use, with the same names and call shapes, so the node classes import and
run in plain Python (tests, the headless demo). Inside ComfyUI the real API is used instead (see bridge.py);
a test compares the two through ComfyUI's `/object_info` when a ComfyUI checkout is configured.
"""

from dataclasses import dataclass, field
from typing import Any


class _Input:
    def __init__(self, id: str, display_name: str = None, optional: bool = False, tooltip: str = None,
                 default: Any = None, **options):
        self.id, self.display_name, self.optional = id, display_name, optional
        self.tooltip, self.default = tooltip, default
        self.options = options  # min, max, step, options (combo), multiline, ...

    @property
    def io_type(self) -> str:
        return self.Parent.io_type


class _Output:
    def __init__(self, id: str = None, display_name: str = None, tooltip: str = None):
        self.id, self.display_name, self.tooltip = id, display_name or id, tooltip

    @property
    def io_type(self) -> str:
        return self.Parent.io_type


def _comfy_type(io_type: str, widget: bool):
    input_cls = type("Input", (_Input,), {"widget": widget})
    output_cls = type("Output", (_Output,), {})
    parent = type(io_type.title(), (), {"io_type": io_type, "Input": input_cls, "Output": output_cls})
    input_cls.Parent = output_cls.Parent = parent
    return parent


class io:  # noqa: N801  (mirrors `from comfy_api.latest import io`)
    Int = _comfy_type("INT", widget=True)
    Float = _comfy_type("FLOAT", widget=True)
    String = _comfy_type("STRING", widget=True)
    Boolean = _comfy_type("BOOLEAN", widget=True)
    Combo = _comfy_type("COMBO", widget=True)
    Image = _comfy_type("IMAGE", widget=False)
    Mask = _comfy_type("MASK", widget=False)
    Latent = _comfy_type("LATENT", widget=False)
    Sigmas = _comfy_type("SIGMAS", widget=False)
    Sampler = _comfy_type("SAMPLER", widget=False)

    @staticmethod
    def Custom(io_type: str):  # noqa: N802
        return _comfy_type(io_type, widget=False)

    @dataclass
    class Schema:
        node_id: str
        display_name: str = None
        category: str = "sd"
        inputs: list = field(default_factory=list)
        outputs: list = field(default_factory=list)
        description: str = ""
        is_output_node: bool = False

    class NodeOutput:
        def __init__(self, *args, ui: dict = None):
            self.args, self.ui = args, ui

        @property
        def result(self):
            return self.args if self.args else None

        def __getitem__(self, index):
            return self.args[index]

    class ComfyNode:
        @classmethod
        def define_schema(cls):
            raise NotImplementedError

        @classmethod
        def validate_inputs(cls, **kwargs):
            return True


class ComfyExtension:
    async def on_load(self) -> None:
        pass

    async def get_node_list(self) -> list:
        raise NotImplementedError


class EulerSampler:
    """A stand-in for the SAMPLER that ComfyUI's `KSamplerSelect("euler")` returns (`comfy.samplers.KSAMPLER` over
    k-diffusion's Euler, no churn), with the same `sample` call: noise scaled to the first sigma by the model's
    `model_sampling`, the kept region of a `denoise_mask` re-noised before every model call and taken from the
    latent in its result, the scaling undone at the end. Only for runs without ComfyUI (tests, the demo)."""

    name = "euler"

    def sample(self, model_wrap, sigmas, extra_args, callback, noise, latent_image=None, denoise_mask=None,
               disable_pbar=False):
        inner = model_wrap.inner_model
        sampling = inner.model_sampling
        x = sampling.noise_scaling(sigmas[0], noise, latent_image)
        ones = x.new_ones([x.shape[0]])
        for i in range(len(sigmas) - 1):
            sigma = sigmas[i] * ones
            model_in = x
            if denoise_mask is not None:
                kept = inner.scale_latent_inpaint(x=x, sigma=sigma, noise=noise, latent_image=latent_image)
                model_in = x * denoise_mask + kept * (1.0 - denoise_mask)
            denoised = model_wrap(model_in, sigma, model_options=extra_args.get("model_options", {}),
                                  seed=extra_args.get("seed"))
            if denoise_mask is not None:
                denoised = denoised * denoise_mask + latent_image * (1.0 - denoise_mask)
            if callback is not None:
                callback(i, denoised, x, len(sigmas) - 1)
            slope = (x - denoised) / sigmas[i]
            x = x + slope * (sigmas[i + 1] - sigmas[i])
        return sampling.inverse_noise_scaling(sigmas[-1], x)
