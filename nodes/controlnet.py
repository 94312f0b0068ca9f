"""The Fun ControlNet Union nodes: a loader for the `model_patches` file and the node that applies it to a model
(model/loaders/controlnet.py). Like the LoRA node, applying returns a model copy that shares every weight; the
samplers then run the control on the steps of its window and keep the prefix cache on (docs/controlnet.md)."""

from ..model.encoders.control import FITS, control_latents
from ..model.features.control import apply_controlnet
from ..model.loaders.controlnet import load_controlnet
from ..model.options import with_options
from . import bridge, placement
from .bridge import io
from .loaders import checked_path, default_dtype, file_changed_key, file_problem, load_or_free
from .socket_types import CATEGORY, VAE, ControlNet, Model
from .validation import refuse_unknown_inputs, require, widget_problem

DTYPES = ["default", "bf16", "fp16", "fp32", "fp8_e4m3fn_fast"]  # append only: saved graphs store the value
MAX_STRENGTH = 10.0


class QI21ControlNetLoader(io.ComfyNode):
    """The Qwen-Image 2.1 Fun ControlNet Union, from models/model_patches."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21ControlNetLoader",
            display_name="Qwen-Image 2.1 Fun ControlNet Loader",
            category=CATEGORY,
            description="Loads alibaba-pai's Fun ControlNet Union for Qwen-Image 2.1 (canny, depth, pose, HED, "
                        "lineart, MLSD, scribble, grayscale and inpainting in one net): the original file, Comfy-Org's "
                        "bf16 repack or its int8 ConvRot one (runs quantized through comfy-kitchen). Other model "
                        "patches are refused by name.",
            inputs=[
                io.Combo.Input("control_net_name", options=bridge.model_choices("model_patches"),
                               tooltip="qwen_image_2.1_fun_controlnet_union_bf16.safetensors (7.6 GB) or "
                                       "..._int8_convrot.safetensors (3.8 GB), in models/model_patches."),
                io.Combo.Input("weight_dtype", options=DTYPES, default="default",
                               tooltip="default: the file's precision (bf16; fp32 on a CPU without native bf16, as the "
                                       "other loaders). "
                                       "The weights are held in this dtype; the control stream computes in the "
                                       "model's (its keys and values are more layers of the model's prefix "
                                       "cache), so bf16 halves the memory of fp32 whatever the model's dtype. "
                                       "fp8_e4m3fn_fast holds its blocks' linears in fp8 and multiplies them in fp8 "
                                       "where the GPU can (as the model loader's option)."),
            ],
            outputs=[ControlNet.Output(display_name="control_net")],
        )

    @classmethod
    def validate_inputs(cls, control_net_name=None, **kwargs):
        return file_problem(cls, "model_patches", control_net_name, **kwargs)

    @classmethod
    def fingerprint_inputs(cls, control_net_name=None, **kwargs):
        return file_changed_key("model_patches", control_net_name)

    @classmethod
    def execute(cls, control_net_name, weight_dtype="default", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        path = checked_path(cls, "model_patches", control_net_name, weight_dtype=weight_dtype)
        net = load_or_free(load_controlnet, path, weight_dtype=default_dtype(weight_dtype, bridge.compute_device()),
                    device=bridge.offload_device())
        net.source = control_net_name
        bridge.log.info("qi21: loaded %s (Fun ControlNet, %s layout, %d blocks)", control_net_name, net.layout,
                        net.config.num_blocks)
        return io.NodeOutput(net)


class QI21ControlNetApply(io.ComfyNode):
    """Applies the Fun ControlNet to a model: a control map, an inpainting mask, or both."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21ControlNetApply",
            display_name="Qwen-Image 2.1 Apply Fun ControlNet",
            category=CATEGORY,
            description="Steers the image with a control map (canny, depth, pose, ...: any RGB map, stretched to the "
                        "output size) and/or repaints the masked region of inpaint_image. The input model is not "
                        "changed and no weight is copied. Unlike core, the sampler keeps its prefix cache on (the "
                        "control's own prefix keys and values are cached too, about +50% cache memory): exact, and "
                        "each step runs only the image rows.",
            inputs=[
                Model.Input("model"),
                ControlNet.Input("control_net"),
                VAE.Input("vae", tooltip="Encodes the control and inpaint images (the Qwen-Image 2.1 VAE)."),
                io.Float.Input("strength", default=1.0, min=-MAX_STRENGTH, max=MAX_STRENGTH, step=0.01,
                               tooltip="Scale of the control's additions. 1 is what the net was trained for and the "
                                       "strongest hold on the structure; lower loosens it (0.8 is common); 0 turns "
                                       "it off."),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.001, advanced=True,
                               tooltip="Where in the schedule the control starts (0 = first step), as in core."),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.001, advanced=True,
                               tooltip="Where it ends (1 = last step). Steps outside the window run the plain model "
                                       "with a plain prefix cache of their own (held beside the controlled one "
                                       "while both are in use)."),
                io.Image.Input("control_image", optional=True,
                               tooltip="The control map (e.g. from Canny, a depth or pose preprocessor); only its "
                                       "first image is used."),
                io.Image.Input("inpaint_image", optional=True,
                               tooltip="The image to inpaint; used only with a mask."),
                io.Mask.Input("mask", optional=True,
                              tooltip="1 marks the region to regenerate (white = repaint)."),
                io.Combo.Input("fit", options=list(FITS), default="stretch", optional=True,
                               tooltip="stretch (core's, default) resizes the images and mask to the output size. pad "
                                       "keeps them at their own size at the top-left corner and repeats their right "
                                       "and bottom edges, as a Reference with fit = pad does: use it with a padded "
                                       "edit so the control lines up with the picture pixel for pixel."),
            ],
            outputs=[Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, start_percent=0.0, end_percent=1.0, **kwargs):
        ranged = widget_problem(cls, start_percent=start_percent, end_percent=end_percent, **kwargs)
        if ranged is not True:  # first: a string or 10**400 is named, never compared
            return ranged
        if start_percent is not None and end_percent is not None and start_percent > end_percent:
            return (f"start_percent {start_percent} is after end_percent {end_percent}: the control would never "
                    "apply. Use start_percent <= end_percent.")
        return True

    @classmethod
    def execute(cls, model, control_net, vae, strength=1.0, start_percent=0.0, end_percent=1.0, control_image=None,
                inpaint_image=None, mask=None, fit="stretch", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        require(cls.validate_inputs(start_percent=start_percent, end_percent=end_percent, strength=strength, fit=fit))
        given = {"control_image": control_image, "inpaint_image": inpaint_image, "mask": mask}
        inputs = tuple(name for name, value in given.items() if value is not None)
        if control_image is None and mask is None:
            bridge.log.warning("qi21 Fun ControlNet: neither control_image nor mask is connected; the model is "
                               "returned unchanged (as core does).")
            inputs = ()
        elif inpaint_image is not None and mask is None:
            bridge.log.warning("qi21 Fun ControlNet: inpaint_image is ignored without a mask (as core does).")

        def hint_for(grid):
            with placement.on_device(vae):
                return control_latents(vae, grid, control_image, inpaint_image, mask, fit=fit)

        def build(whole):
            return apply_controlnet(whole, control_net, hint_for, strength, start_percent, end_percent, inputs=inputs)

        if strength == 0.0 or not inputs:  # the model itself, as core does (no control on the record either)
            return io.NodeOutput(model)
        return io.NodeOutput(with_options(model, build=build, turns_on=("control",)))
