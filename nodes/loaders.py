"""Loaders for the DiT, the text encoder and the VAE: ComfyUI's model folders plus diffusers repositories.

Models load to the offload device (CPU RAM); the nodes that use them move them to the GPU, making room first.
"""

import gc
import traceback
from pathlib import Path

import torch

from ..model.loaders.checkpoint import WEIGHT_DTYPES, default_weight_dtype
from ..model.loaders.dit import load_dit
from ..model.loaders.fingerprint import file_fingerprint
from ..model.loaders.text_encoder import load_text_encoder
from ..model.loaders.vae import load_vae
from ..model.memory.planner import PLAN_CHOICES
from ..model.options import ModelOptions, with_options
from ..model.transformer.compiled import COMPILE_MODES, compile_blocks
from . import bridge
from .bridge import io
from .parallel import DEVICES_TOOLTIP, PARALLEL_MODES, PARALLEL_TOOLTIP, rank_problem, split_model
from .placement import PLAN_TOOLTIP
from .socket_types import CATEGORY, VAE, Model, TextEncoder
from .validation import quoted, refuse_unknown_inputs, require, widget_problem


def _choices(kind: str) -> list[str]:
    """`bridge.model_choices`, plus the `.gguf` files of the DiT folders (diffusion_models, unet): ComfyUI's own file
    lists leave that extension out, so the DiT loader finds them itself, in the same folders."""
    choices = bridge.model_choices(kind)
    if kind != "diffusion_models":
        return choices
    ggufs = {str(p.relative_to(folder)) for folder in bridge._folders(kind) if folder.is_dir()
             for p in folder.rglob("*.gguf") if p.is_file()}
    repos = [c for c in choices if c.startswith(bridge.DIFFUSERS_PREFIX)]
    return sorted(ggufs.union(c for c in choices if c not in repos)) + repos


def _not_listed(kind: str, name) -> str | None:
    if name in _choices(kind):
        return None
    return f"{quoted(name)} is not in the {kind} folders; pick a listed file or refresh (R) after copying it there."


def file_problem(node, kind: str, name, **widgets) -> str | bool:
    """A loader's `validate_inputs`: a listed file and widgets inside their lists. A name fed by a link (a switch,
    a primitive) is None here and is checked by `execute` once it is known."""
    problem = _not_listed(kind, name) if name is not None else None
    return problem or widget_problem(node, **widgets)


COMPILE_TOOLTIP = (
    "off (default) runs every block eagerly. blocks compiles one DiT block with torch.compile and reuses it for all "
    "32 (and a Fun ControlNet's): the first prompts after loading pay the compilation, three graphs (the prefill, its "
    "last block, the cached step; tens of seconds each on a CPU, not measured on a GPU yet), and later prompts of any "
    "length, reference count or size reuse them. Results match off to about 1e-6 in fp32. blocks+cudagraphs also "
    "replays the cached steps as CUDA graphs (CUDA only; elsewhere the same as blocks). Needs what torch.compile "
    "needs: a C++ compiler, and Triton on a GPU.")


def checked_path(node, kind: str, name, **widgets) -> Path:
    """Where `name` is, after the checks `validate_inputs` makes, with the same messages. Only names that
    `model_choices` lists pass, so nothing outside the model folders can be named ("../../x.safetensors")."""
    require(_not_listed(kind, name) or widget_problem(node, **widgets))
    return bridge.model_path(kind, name)


def file_changed_key(kind: str, name) -> str | None:
    """A loader's `fingerprint_inputs`: the file's size, mtime and edge digest (model/loaders/fingerprint.py), so
    ComfyUI's node cache runs the loader again when the file was replaced on disk. A removed or unreadable file gives
    a key of its own: the loader runs and says what is wrong. None for a name fed by a link (known only at run
    time; its upstream node's own key applies)."""
    if name is None:
        return None
    if _not_listed(kind, name):  # never read a file the loader would refuse ("../../x"): validation says why
        return f"unlisted:{kind}/{name}"
    try:
        return file_fingerprint(bridge.model_path(kind, name))
    except FileNotFoundError:
        return f"missing:{kind}/{name}"
    except OSError as error:
        return f"unreadable:{kind}/{name}:{type(error).__name__}"


TEXT_ENCODER_DEVICE_TOOLTIP = (
    "default encodes on ComfyUI's GPU and offloads the encoder to RAM afterwards. cpu never touches VRAM but encoding "
    "takes tens of seconds. cuda:0, cuda:1, ... (each GPU torch sees) encode on that GPU and keep the encoder loaded "
    "there (as ComfyUI-MultiGPU does) instead of moving 16 GB in and out of the DiT's GPU; only the conditioning (a "
    "few MB) crosses over.")
VAE_DEVICE_TOOLTIP = (
    "default encodes and decodes on ComfyUI's GPU. cpu never touches VRAM but is much slower. cuda:0, cuda:1, ... "
    "(each GPU torch sees) run the VAE on that GPU and keep it loaded there: a large decode's activations no longer "
    "need room beside the DiT, and only latents and images cross over.")


def device_input(tooltip: str):
    """A loader's optional `device` input: default, cpu and each GPU of this machine (`bridge.device_choices`; only
    default and cpu without GPUs, so workflows saved with those load anywhere)."""
    return io.Combo.Input("device", options=bridge.device_choices(), default="default", optional=True, tooltip=tooltip)


def device_label(node) -> str:
    """How an error names a loader's `device` input."""
    return f"{node.define_schema().display_name}'s device"


def device_problem(node, device) -> str | None:
    """`validate_inputs`' check of a loader's `device`: None, or a message naming the input and the devices this
    machine has (a workflow saved on a machine with more GPUs)."""
    return bridge.device_problem(device, device_label(node))


def device_of(node, device) -> torch.device | None:
    """The loader's `device` as a torch device (None: "default"); `device_problem`'s message as a ValueError."""
    return bridge.chosen_device(device, device_label(node))


def default_dtype(weight_dtype: str, device: torch.device) -> str:
    """"default" keeps the file's precision on GPUs and on CPUs with native bf16 (AVX512-BF16, AMX); on other CPUs
    it means fp32, as ComfyUI does there (bf16 is emulated there, several times slower than fp32):
    model/loaders/checkpoint.py `default_weight_dtype`."""
    return default_weight_dtype(weight_dtype, device)


def load_or_free(loader, *args, **kwargs):
    """Run a loader; on any failure nothing it allocated stays referenced (the error names the file)."""
    try:
        return loader(*args, **kwargs)
    except BaseException as error:
        # The traceback's finished frames still hold what the loader had built (a half-filled model); ComfyUI
        # keeps the exception while it reports it, so drop their locals now. File names and lines stay.
        traceback.clear_frames(error.__traceback__)
        gc.collect()
        raise


def loader_pairs_problem(compile=None, devices=None, parallel=None, plan=None, **_) -> str | None:  # noqa: A002
    """The table of pairs (model/options.py) on the loader's own inputs, before anything loads: compile or plan with
    devices is refused here, by name. Inputs not given (linked, or left out) are taken as their defaults."""
    text = devices if isinstance(devices, str) else ""  # anything else is named by the rank list's own check
    named = ", ".join(part.strip() for part in text.split(",") if part.strip())
    try:
        record = ModelOptions(compile=compile or "off", plan=plan or "auto",
                              devices=(named,) if named else (), parallel=parallel or "off")
    except ValueError:
        return None  # a value outside its list: widget_problem names it
    return record.pair_problem()


class QI21ModelLoader(io.ComfyNode):
    """The Qwen-Image 2.1 DiT (Base or Turbo), from a ComfyUI single file or a diffusers folder."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21ModelLoader",
            display_name="Qwen-Image 2.1 Model Loader",
            category=CATEGORY,
            description="Loads the 7B Qwen-Image 2.1 DiT. Base and Turbo share the file format; the variant is read "
                        "from the diffusers model_index.json or the file name and checked by the samplers.",
            inputs=[
                io.Combo.Input("model_name", options=_choices("diffusion_models"),
                               tooltip="qwen_image_2.1_bf16.safetensors / qwen_image_2.1_turbo_bf16.safetensors in "
                                       "models/diffusion_models, a GGUF of them (.gguf, Q8_0 to Q2_K: 8-12 GB GPUs; "
                                       "needs `pip install gguf`), or a diffusers Qwen-Image-2.1 folder in "
                                       "models/diffusers."),
                io.Combo.Input("weight_dtype", options=list(WEIGHT_DTYPES), default="default",
                               tooltip="default keeps the file's bf16 (14.2 GB) on a GPU and on a CPU with native "
                                       "bf16 (AMX, AVX512-BF16), fp32 on other CPUs. fp8_e4m3fn stores the block "
                                       "weights in fp8 (about 7.5 GB) and computes in bf16, at a small quality "
                                       "cost. fp8_e4m3fn_fast also multiplies in fp8 on RTX 40xx / H100 and newer "
                                       "(per-row scales, not core's scale 1, which breaks Qwen pictures); elsewhere "
                                       "it runs as fp8_e4m3fn. fp32 doubles memory and is for checking only. A .gguf "
                                       "file stays quantized: this picks its compute dtype (default = bf16; not "
                                       "fp8)."),
                io.Combo.Input("attention", options=["auto", "sdpa", "flex"], default="auto", optional=True,
                               tooltip="Prefill attention. auto = sdpa: exact, no compilation. flex runs the "
                                       "block-causal prefill in one compiled call (CUDA); first use compiles for a "
                                       "while."),
                io.Combo.Input("plan", options=list(PLAN_CHOICES), default="auto", optional=True,
                               tooltip=PLAN_TOOLTIP),
                io.Combo.Input("compile", options=list(COMPILE_MODES), default="off", optional=True,
                               tooltip=COMPILE_TOOLTIP),
                io.String.Input("devices", default="", optional=True, tooltip=DEVICES_TOOLTIP),
                io.Combo.Input("parallel", options=list(PARALLEL_MODES), default="off", optional=True,
                               tooltip=PARALLEL_TOOLTIP),
            ],
            outputs=[Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, model_name=None, devices="", parallel="off", **kwargs):
        problem = file_problem(cls, "diffusion_models", model_name, devices=devices, parallel=parallel, **kwargs)
        if problem is not True:
            return problem
        if devices not in ("", None) or parallel != "off":
            try:
                path = bridge.model_path("diffusion_models", model_name) if model_name is not None else None
            except FileNotFoundError:  # gone since it was listed: the heads are checked when the loader runs
                path = None
            problem = rank_problem(devices, parallel, path)  # before any worker starts (nodes/parallel.py)
        return problem or loader_pairs_problem(devices=devices, parallel=parallel, **kwargs) or True

    @classmethod
    def fingerprint_inputs(cls, model_name=None, **kwargs):
        return file_changed_key("diffusion_models", model_name)

    @classmethod
    def execute(cls, model_name, weight_dtype, attention="auto", plan="auto", compile="off",  # noqa: A002 (its name)
                devices="", parallel="off", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        path = checked_path(cls, "diffusion_models", model_name, weight_dtype=weight_dtype, attention=attention,
                             plan=plan, compile=compile, parallel=parallel)
        require(loader_pairs_problem(compile=compile, devices=devices, parallel=parallel, plan=plan) or True)
        chosen = dict(compile=compile, plan=plan, weights=weight_dtype)  # the model's options record (model/options.py)
        split = split_model(devices, parallel, path, weight_dtype, attention)
        if split is not None:  # loaded by the workers on their devices, on the first run (nodes/parallel.py)
            bridge.log.info("qi21: %s will run split over %s (%s)", path.name, ", ".join(split.devices), parallel)
            return io.NodeOutput(with_options(split, devices=split.devices, parallel=parallel, **chosen))
        runs_on = bridge.compute_device()
        # for a GPU the weights wait on the file and are read straight to where the memory plan places them, not
        # copied whole into RAM first (a 32 GB host holding the offloaded text encoder too is killed otherwise)
        model = load_or_free(load_dit, path, weight_dtype=default_dtype(weight_dtype, runs_on),
                             device=bridge.offload_device(), attention=attention, defer=runs_on.type != "cpu")
        model = with_options(model, fresh=True, build=lambda new: compile_blocks(new, compile), **chosen)
        bridge.log.info("qi21: loaded %s (%s layout, variant %s from %s)", path.name, model.source.layout,
                        model.source.variant, model.source.variant_from)
        return io.NodeOutput(model)


class QI21TextEncoderLoader(io.ComfyNode):
    """The Qwen3-VL 8B text encoder with its tokenizer and image processor."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21TextEncoderLoader",
            display_name="Qwen-Image 2.1 Text Encoder Loader",
            category=CATEGORY,
            description="Loads Qwen3-VL 8B (qwen3vl_8b_bf16.safetensors or a diffusers folder). The tokenizer comes "
                        "from the diffusers folder, a tokenizer folder next to the file, or ComfyUI's bundled one.",
            inputs=[
                io.Combo.Input("text_encoder_name", options=bridge.model_choices("text_encoders"),
                               tooltip="qwen3vl_8b_bf16.safetensors in models/text_encoders, or a diffusers "
                                       "Qwen-Image-2.1 folder in models/diffusers."),
                io.Combo.Input("weight_dtype", options=["default", "bf16", "fp16", "fp32"], default="default",
                               tooltip="default keeps the file's bf16 (16.3 GB) on a GPU and on a CPU with native "
                                       "bf16 (AMX, AVX512-BF16), fp32 on other CPUs. fp32 doubles memory for no "
                                       "visible gain; fp16 is untested on the real weights."),
                device_input(TEXT_ENCODER_DEVICE_TOOLTIP),
            ],
            outputs=[TextEncoder.Output(display_name="text_encoder")],
        )

    @classmethod
    def validate_inputs(cls, text_encoder_name=None, device=None, **kwargs):
        return device_problem(cls, device) or file_problem(cls, "text_encoders", text_encoder_name, device=device,
                                                           **kwargs)

    @classmethod
    def fingerprint_inputs(cls, text_encoder_name=None, **kwargs):
        return file_changed_key("text_encoders", text_encoder_name)

    @classmethod
    def execute(cls, text_encoder_name, weight_dtype, device="default", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        chosen = device_of(cls, device)  # None: the compute device
        path = checked_path(cls, "text_encoders", text_encoder_name, weight_dtype=weight_dtype, device=device)
        runs_on = chosen or bridge.compute_device()
        encoder = load_or_free(load_text_encoder, path, weight_dtype=default_dtype(weight_dtype, runs_on),
                               device=bridge.offload_device(), fallback_tokenizer_dir=bridge.comfy_tokenizer_dir(),
                               defer=runs_on.type != "cpu")  # for a GPU: read from the file when placed
        encoder.preferred_device = chosen
        return io.NodeOutput(encoder)


class QI21VAELoader(io.ComfyNode):
    """The 64-channel RGBA VAE (16x compression)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QI21VAELoader",
            display_name="Qwen-Image 2.1 VAE Loader",
            category=CATEGORY,
            description="Loads the RGBA VAE (qwen_image_2.1_vae_bf16.safetensors or a diffusers folder).",
            inputs=[
                io.Combo.Input("vae_name", options=bridge.model_choices("vae"),
                               tooltip="qwen_image_2.1_vae_bf16.safetensors in models/vae, or a diffusers "
                                       "Qwen-Image-2.1 folder in models/diffusers."),
                io.Combo.Input("weight_dtype", options=["default", "bf16", "fp32"], default="default",
                               tooltip="default keeps the file's precision on a GPU and on a CPU with native bf16 "
                                       "(bf16 for an fp16 file: the decoder overflows fp16), fp32 on other CPUs. fp32 "
                                       "is exact but twice the memory and slower."),
                device_input(VAE_DEVICE_TOOLTIP),
            ],
            outputs=[VAE.Output(display_name="vae")],
        )

    @classmethod
    def validate_inputs(cls, vae_name=None, device=None, **kwargs):
        return device_problem(cls, device) or file_problem(cls, "vae", vae_name, device=device, **kwargs)

    @classmethod
    def fingerprint_inputs(cls, vae_name=None, **kwargs):
        return file_changed_key("vae", vae_name)

    @classmethod
    def execute(cls, vae_name, weight_dtype, device="default", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(cls, unknown)
        chosen = device_of(cls, device)  # None: the compute device
        path = checked_path(cls, "vae", vae_name, weight_dtype=weight_dtype, device=device)
        weight_dtype = default_dtype(weight_dtype, chosen or bridge.compute_device())
        vae = load_or_free(load_vae, path, weight_dtype=weight_dtype, device=bridge.offload_device())
        vae.preferred_device = chosen  # read by the VAE nodes (nodes/placement.py: component_device)
        return io.NodeOutput(vae)
