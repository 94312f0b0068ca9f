"""VAE encode: an IMAGE (RGB or RGBA) into a raw Qwen-Image 2.1 LATENT, for img2img and inpainting."""

from ..model.encoders.canvas import CROP_KEY
from ..model.encoders.pipeline import encode_images
from . import bridge, placement
from .bridge import io
from .decode import TILED
from .socket_types import CATEGORY, VAE
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
                                                "multiples of 32, the sizes the samplers generate (fit: pad keeps "
                                                "them)."),
                io.Mask.Input("mask", optional=True,
                              tooltip="Transparency (1 = transparent, as LoadImage gives): becomes the alpha channel. "
                                      "Not an inpainting mask: use SetLatentNoiseMask on the LATENT for that."),
                io.Combo.Input("tiled", options=list(TILED), default="auto", optional=True,
                               tooltip="auto tiles large images (memory bounded by the tile, seams blended); on forces "
                                       "tiles (least memory), off encodes in one piece (exact, most memory)."),
                io.Combo.Input("fit", options=["crop", "pad"], default="crop", optional=True,
                               tooltip="crop (default) centre-crops the sides to multiples of 32, dropping up to 31 "
                                       "pixels of each. pad keeps every pixel: it repeats the right and bottom edges "
                                       "to the next multiple of 32 and the LATENT remembers the image's own box, so "
                                       "the sampler's output decodes (Qwen-Image 2.1 VAE Decode) at exactly the "
                                       "input's size and pixel grid. A noise mask of the image's size is padded "
                                       "the same way."),
            ],
            outputs=[io.Latent.Output(display_name="LATENT")],
        )

    @classmethod
    def execute(cls, vae, image, mask=None, tiled="auto", fit="crop", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        require(widget_problem(cls, tiled=tiled, fit=fit))  # ComfyUI checks it only when it is not linked
        with placement.on_device(vae):
            raw, note = encode_images(vae, image, mask, tiled=TILED[tiled], fit=fit)
        if note:
            (bridge.log.info if fit == "pad" else bridge.log.warning)("qi21 VAE encode: %s", note)
        latent = {"samples": raw}
        height, width = image.shape[-3:-1]
        if fit == "pad" and (raw.shape[-1] * 16, raw.shape[-2] * 16) != (width, height):
            latent[CROP_KEY] = (int(width), int(height))  # the samplers pass it on, VAE Decode crops to it
        return io.NodeOutput(latent)
