"""The files Comfy-Org publishes for Qwen-Image 2.1 (`../shared/design/ECOSYSTEM.md` section 1, read from the
repository's file list): the one table every download-link test reads.

Download form: `https://huggingface.co/Comfy-Org/Qwen-Image-2.1/resolve/main/<folder>/<file>` (the repository has no
`split_files/` folder; the official templates' `properties.models` use this form).
"""

REPOSITORY = "https://huggingface.co/Comfy-Org/Qwen-Image-2.1"
DOWNLOAD = REPOSITORY + "/resolve/main"

#: models folder -> the file names published there
PUBLISHED = {
    "diffusion_models": (
        "qwen_image_2.1_bf16.safetensors",
        "qwen_image_2.1_int8_convrot.safetensors",
        "qwen_image_2.1_turbo_bf16.safetensors",
        "qwen_image_2.1_turbo_int8_convrot.safetensors",
    ),
    "text_encoders": (
        "qwen3vl_8b_bf16.safetensors",
        "qwen3vl_8b_int8_convrot.safetensors",
        "qwen3vl_8b_w4a8.safetensors",
        "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors",  # the prompt enhancers (not text encoders)
        "qwen3.5_9b_qwen_image_2.1_pe_i2i.int8_convrot.safetensors",
    ),
    "vae": ("qwen_image_2.1_vae_bf16.safetensors",),
    "loras": (
        "p_q_image_2.1_5_steps_v0.1_comfyui_bf16.safetensors",
        "p_q_image_2.1_6_steps_v0.2_comfyui_bf16.safetensors",
        "p_q_image_2.1_6_steps_upsampled_v0.2_comfyui_bf16.safetensors",
        "p_q_image_2.1_8_steps_v0.1_comfyui_bf16.safetensors",
        "qwen_image_2.1_turbo_lora_avg_rank_178_bf16.safetensors",
    ),
    "model_patches": (
        "qwen_image_2.1_fun_controlnet_union_bf16.safetensors",
        "qwen_image_2.1_fun_controlnet_union_int8_convrot.safetensors",
    ),
}


def download_url(folder: str, name: str) -> str:
    return f"{DOWNLOAD}/{folder}/{name}"


def folder_of(name: str) -> str | None:
    """The folder a published file lives in, or None when Comfy-Org publishes no file of that name."""
    return next((folder for folder, names in PUBLISHED.items() if name in names), None)
