"""The pack's own socket types (QI21_*) and the node category; core types (IMAGE, MASK, LATENT) at the edges."""

from .bridge import io

CATEGORY = "Qwen-Image 2.1"

Model = io.Custom("QI21_MODEL")
TextEncoder = io.Custom("QI21_TEXT_ENCODER")
VAE = io.Custom("QI21_VAE")
References = io.Custom("QI21_REFERENCES")
Conditioning = io.Custom("QI21_CONDITIONING")
ControlNet = io.Custom("QI21_CONTROL_NET")
