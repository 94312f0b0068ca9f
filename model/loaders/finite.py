"""NaN and infinity in weights, found where the weights are read instead of at the first sampling step.

A NaN in one LoRA matrix, one fp8 `weight_scale` or one GGUF block scale turns every latent to NaN within a step,
and the sampler can then only say that the latents broke. Each reader calls `check_finite` on what it has just
read (LoRA matrices, quantized scales, GGUF block scales and float tensors), so the error names the file and the
tensor. The check is one `aminmax` pass per tensor (a NaN or an infinity survives a min/max; nothing the size of
the tensor is allocated), about 50 ms for a 4096 x 12288 bf16 matrix on two CPU threads; fp8, which has no
min/max kernel, is checked by its NaN/inf bit patterns (one mask and one max).
"""

import torch

from .safetensors_io import CheckpointError

#: The smallest magnitude byte (sign bit cleared) that is NaN, or for e5m2 NaN or inf, in each fp8 format: e4m3fn's
#: only NaN is 0x7F (0x7E is 448, its largest number); e5m2's exponent is all ones from 0x7C up.
_FP8_SPECIAL = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}


def nonfinite(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds a NaN or an infinity (integer tensors never do)."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return False
    special = _FP8_SPECIAL.get(tensor.dtype)
    if special is not None:
        return bool((tensor.view(torch.uint8) & 0x7F).amax() >= special)  # one mask and one max
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        tensor = tensor.float()  # other 8-bit floats: small scale tensors only
    low, high = torch.aminmax(tensor)
    return not bool(torch.isfinite(low) & torch.isfinite(high))


def check_finite(tensor: torch.Tensor, what: str, where: str, instead: str = "", error=CheckpointError) -> None:
    """Raise `error` naming the file (`where`) and the tensor (`what`) when `tensor` is not finite."""
    if nonfinite(tensor):
        raise error(
            f"{where}: {what} holds NaN or infinite values, which would turn every image into NaN at the first step. "
            f"The file is damaged or was written by a broken tool; download it again{instead}."
        )
