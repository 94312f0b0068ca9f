"""How far bf16 drifts from fp32 through 32 random blocks, for ours and for diffusers (CPU, one run).

Random weights make a deep network chaotic: bf16 rounding differences grow block after block, so a bf16
comparison of two implementations says little by itself. This measures both against the fp32 reference on
the same weights (width 512 = 4 heads of 128, 32 blocks, text width 4096, a 256-token target), so the GPU
benchmark's bf16 "relative difference" can be read against the reference's own bf16 drift.

    python benchmarks/bf16_drift.py
"""

import copy

import torch

import bench_gpu  # a sibling (this folder is on sys.path when run as a script); imports the pack as `qi21`
from qi21.model.loaders.dit_keys import convert_state_dict
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT


def relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    from diffusers import QwenImage21Transformer2DModel

    bench_gpu.TARGET = bench_gpu.REFERENCE = (16, 16)
    torch.manual_seed(0)
    fp32 = QwenImage21Transformer2DModel(num_layers=32, num_attention_heads=4, context_in_dim=4096).eval()
    with torch.no_grad():
        for name, param in fp32.named_parameters():
            if param.ndim == 1:
                param.copy_(0.1 * torch.randn_like(param) + (0.0 if "text_norm" in name else 1.0))
            else:
                param.normal_(0, param.shape[1] ** -0.5)
    theirs = copy.deepcopy(fp32).to(torch.bfloat16)
    ours = QwenImage21DiT(DiTConfig(num_layers=32, num_heads=4), dtype=torch.bfloat16)
    ours.load_state_dict(convert_state_dict(theirs.state_dict()))
    t = torch.tensor([0.8])
    print("refs | diffusers bf16 vs fp32 | ours bf16 vs fp32 | ours vs diffusers (both bf16)")
    with torch.inference_mode():
        for references in (0, 1):
            prefix, target, kwargs = bench_gpu.inputs(references, 1, torch.device("cpu"), torch.bfloat16)
            kwargs32 = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
            tokens = target.shape[1]
            exact = fp32(timestep=t, **kwargs32)[0][:, -tokens:]
            reference = theirs(timestep=t, **kwargs)[0][:, -tokens:]
            mine = ours(target, t, [prefix])
            print(f"{references} | {relative(reference, exact):.3f} | {relative(mine, exact):.3f} | "
                  f"{relative(mine, reference):.3f}")


if __name__ == "__main__":
    main()
