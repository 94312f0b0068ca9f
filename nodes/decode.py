"""VAE decode into RGB, the alpha as a MASK, and RGBA."""

import torch

from ..model.encoders.canvas import CROP_KEY, check_box, crop_images
from ..model.encoders.pipeline import decode_images
from ..model.vae.latents import LATENT_TOKEN_PIXELS
from . import placement
from .bridge import io
from .socket_types import CATEGORY, VAE
from .validation import refuse_unknown_inputs, require, widget_problem

TILED = {"auto": None, "on": True, "off": False}


class QI21VAEDecode(io.ComfyNode):
    """Decodes raw latents to RGB + alpha: RGB and MASK for the usual nodes, RGBA for transparent PNGs."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21VAEDecode",
            display_name="Qwen-Image 2.1 VAE Decode",
            category=CATEGORY,
            description="Decodes the 64-channel RGBA latents. IMAGE (RGB) and MASK (1 = transparent, ComfyUI's "
                        "convention) plug into core nodes; the 4-channel IMAGE saves as a transparent PNG with "
                        "SaveImage. A LATENT made from a padded picture (fit = pad on the Reference or VAE Encode) "
                        "is cropped back to the picture's own size.",
            inputs=[
                VAE.Input("vae"),
                io.Latent.Input("samples"),
                io.Combo.Input("tiled", options=list(TILED), default="auto", optional=True,
                               tooltip="auto decodes in one piece (exactly the reference's result) whenever that fits "
                                       "in the free memory, and in blended tiles only when it does not; on forces "
                                       "tiles (least memory), off forces one piece (most memory: may run out of it on "
                                       "a small GPU)."),
            ],
            outputs=[io.Image.Output(display_name="IMAGE"), io.Mask.Output(display_name="MASK"),
                     io.Image.Output(display_name="RGBA")],
        )

    @classmethod
    def execute(cls, vae, samples, tiled="auto", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        require(widget_problem(cls, tiled=tiled))  # ComfyUI checks it only when it is not linked
        latents = samples["samples"]
        if latents.ndim != 4 or latents.shape[1] != vae.config.z_dim:
            raise ValueError(f"QI21VAEDecode needs Qwen-Image 2.1 latents (B, {vae.config.z_dim}, h, w); got "
                             f"{tuple(latents.shape)}. Connect a Qwen-Image 2.1 sampler's LATENT.")
        if not bool(torch.isfinite(latents).all()):  # would decode to a black image without a word
            raise ValueError("QI21VAEDecode: the latents hold NaN/inf values; the node that made them failed (with "
                             "fp16 weights, try bf16 or fp32).")
        box = samples.get(CROP_KEY)  # set by the samplers / VAE Encode for a picture padded with fit = pad
        if box is not None:
            canvas = (latents.shape[-1] * LATENT_TOKEN_PIXELS, latents.shape[-2] * LATENT_TOKEN_PIXELS)
            box = check_box(box, canvas, f"samples' {CROP_KEY}")
        use_tiles, activations = TILED[tiled], 0
        if use_tiles is None:  # auto: one pass when the planner says it fits (the reference's result exactly)
            use_tiles, activations = placement.decode_tiled(vae, latents)
        with placement.on_device(vae, memory_required=activations):
            rgb, mask, rgba = decode_images(vae, latents, tiled=use_tiles)
        if box is not None:
            rgb, mask, rgba = (crop_images(images, box) for images in (rgb, mask, rgba))
        return io.NodeOutput(rgb, mask, rgba)
