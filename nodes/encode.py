"""VAE encode: an IMAGE (RGB or RGBA) into a raw Qwen-Image 2.1 LATENT, for img2img and inpainting."""

from ..model.encoders.pipeline import encode_images
from . import bridge, placement
from .bridge import io
from .decode import TILED
from .types import CATEGORY, VAE
from .validation import refuse_unknown_inputs, require, widget_problem


class QI21VAEEncode(io.ComfyNode):
    """Encodes RGB or RGBA images into raw VAE latents (a LATENT, like the samplers' output)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21VAEEncode",
            display_name="Qwen-Image 2.1 VAE Encode",
            category=CATEGORY,
            description="Encodes an image, alpha included, into the 64-channel latent space; the LATENT feeds a "
                        "sampler's latent_image (img2img; SetLatentNoiseMask for inpainting).",
            inputs=[
                VAE.Input("vae"),
                io.Image.Input("image", tooltip="RGB (encoded as opaque) or RGBA. Sides are centre-cropped to "
                                                "multiples of 32, the sizes the samplers generate."),
                io.Mask.Input("mask", optional=True,
                              tooltip="Transparency (1 = transparent, as LoadImage gives): becomes the alpha channel. "
                                      "Not an inpainting mask: use SetLatentNoiseMask on the LATENT for that."),
                io.Combo.Input("tiled", options=list(TILED), default="auto", optional=True,
                               tooltip="auto tiles large images (memory bounded by the tile, seams blended); on forces "
                                       "tiles (least memory), off encodes in one piece (exact, most memory)."),
            ],
            outputs=[io.Latent.Output(display_name="LATENT")],
        )

    @classmethod
    def execute(cls, vae, image, mask=None, tiled="auto", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        require(widget_problem(cls, tiled=tiled))  # ComfyUI checks it only when it is not linked
        with placement.on_device(vae):
            raw, note = encode_images(vae, image, mask, tiled=TILED[tiled])
        if note:
            bridge.log.warning("qi21 VAE encode: %s", note)
        return io.NodeOutput({"samples": raw})
