"""Reference images and prompt encoding."""

import torch

from ..model.encoders.pipeline import (
    MAX_REFERENCES,
    chain_references,
    check_room_for_reference,
    encode_prepared,
    encode_prompt,
)
from ..model.encoders.references import FITS, prepare_reference
from . import bridge, placement
from .bridge import io
from .socket_types import CATEGORY, VAE, Conditioning, References, TextEncoder
from .validation import refuse_unknown_inputs, require, widget_problem


class QI21Reference(io.ComfyNode):
    """One reference image, resized once: the VAE encodes all four channels, the VLM sees it over white."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21Reference",
            display_name="Qwen-Image 2.1 Reference",
            category=CATEGORY,
            description="Adds a reference image (<image1>..<image10> in chain order) for editing and multi-image "
                        "prompts. Chain several of these; the prompt can name them as <image1>, <image2>, ...",
            inputs=[
                VAE.Input("vae"),
                io.Image.Input("image", tooltip="RGB or RGBA (a 1-channel image is read as grey). With a batch, only "
                                                "the first image is used (a warning is logged)."),
                io.Int.Input("resolution", default=1024, min=0, max=4096, step=32,
                             tooltip="Resize to about resolution x resolution pixels, aspect kept, sides x32 (the "
                                     "reference pipeline's default, 1024). 0 keeps the image's own size floored to "
                                     "x32. Larger costs prefix tokens: 1024 -> 4096 tokens, 2 GiB of cache in bf16."),
                io.Mask.Input("mask", optional=True,
                              tooltip="Transparency in ComfyUI's convention (1 = transparent), as LoadImage gives it; "
                                      "becomes the alpha channel the VAE encodes."),
                References.Input("references", optional=True,
                                 tooltip="References from a previous Qwen-Image 2.1 Reference node; this one is added "
                                         f"after them (at most {MAX_REFERENCES})."),
                io.Combo.Input("fit", options=list(FITS), default="resize", optional=True,
                               tooltip="How the image reaches sides that are multiples of 32. resize (the reference "
                                       "pipeline's, default) resamples it to about resolution x resolution, so an "
                                       "edit comes out slightly scaled. pad keeps its own pixels and repeats its "
                                       "right and bottom edges to the next multiple of 32 (at least 256x256); it is "
                                       "scaled down only when larger than resolution x resolution (0: never). A "
                                       "sampler with width and height 0 then generates the padded size and VAE "
                                       "Decode crops back to the image's own, so the edit lays over its input "
                                       "pixel for pixel."),
            ],
            outputs=[References.Output(display_name="references")],
        )

    @classmethod
    def execute(cls, vae, image, resolution, mask=None, references=None, fit="resize", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        require(widget_problem(cls, resolution=resolution, fit=fit))  # ComfyUI checks it only when it is not linked
        check_room_for_reference(references)  # before any work
        if image is None or image.numel() == 0 or min(image.shape[-3:-1]) == 0:
            raise ValueError(f"the image given to Qwen-Image 2.1 Reference is empty (shape {tuple(image.shape)}).")
        if image.ndim == 4 and image.shape[0] > 1:
            bridge.log.warning("qi21 Reference: a batch of %d images was given; only the first is used (chain one "
                               "Reference node per image).", image.shape[0])
        # resize and size checks first: a refused image must not make ComfyUI unload models to move the VAE
        prepared = prepare_reference(image, mask, resolution, fit=fit)
        if prepared.crop is not None:
            bridge.log.info("qi21 Reference: %dx%d kept, padded to %dx%d", *prepared.crop, *prepared.size)
        with placement.on_device(vae):
            reference = encode_prepared(vae, prepared)
        return io.NodeOutput(chain_references(references, reference))


class QI21TextEncode(io.ComfyNode):
    """Encodes a prompt (and its references) with Qwen3-VL into the sampler's conditioning."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21TextEncode",
            display_name="Qwen-Image 2.1 Text Encode",
            category=CATEGORY,
            description="Builds the exact Qwen-Image 2.1 prompt template (with <image1>..<imageN> for references), "
                        "encodes it and keeps the last layer before the final norm. Use one for the positive and "
                        "one for the negative prompt.",
            inputs=[
                TextEncoder.Input("text_encoder"),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="Refer to references as <image1>, <image2>, ... An empty prompt is encoded as "
                                        "a single space, as the reference pipeline does. Up to about 8,180 tokens "
                                        "(some 35,000 characters) without references, fewer with them: the RoPE "
                                        "range the model is defined for; a longer prompt is refused."),
                References.Input("references", optional=True,
                                 tooltip="The same reference chain the edit is about; the negative prompt should get "
                                         "the same references."),
            ],
            outputs=[Conditioning.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, text_encoder, prompt, references=None, **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        if not isinstance(prompt, str):  # a linked prompt is not checked by ComfyUI
            raise ValueError(f"Qwen-Image 2.1 Text Encode needs a prompt string; got {type(prompt).__name__}.")
        # too long a prompt or reference set is refused here, before the 16 GB encoder moves to the GPU
        text_encoder.check_prompt(prompt, [r.prepared for r in references or ()])
        # whole on the device when it fits beside the encoding, else its decoder layers streamed (nodes/placement.py)
        with placement.text_encoder_on_device(text_encoder, prompt, references or ()):
            # Cancel stops the encoding between layers, not after the whole 36-layer pass
            with torch.no_grad(), text_encoder.interruptible(bridge.throw_if_interrupted):
                conditioning = encode_prompt(text_encoder, prompt, references or ())
        return io.NodeOutput(conditioning)
