"""The peers' caches on the toy written as a diffusers folder (benchmarks/step_cache_peers.py): diffusers 0.42.1's
FirstBlockCache, TaylorSeerCache, MagCache and SeaCache through the transformer's `enable_cache`, and cache-dit's
DBCache (asked in its own venv, `CACHE_DIT_PYTHON`, whose failure is recorded).

The loop is the Qwen-Image 2.1 pipeline's denoising loop (as tests/oracle.py writes it: the released scheduler, our
Conditioning turned into the transformer's inputs), one `cache_context` around each call as the pipelines do, with the
step index, sigma and step count SeaCache asks for. Each peer runs without the 2.1 KV cache (the whole sequence every
step): with it, FirstBlockCache and MagCache compare the first call's residual (prefix + target rows, the cache's
extract call) with the next call's (target rows only) and fail on the shapes (`KV_CACHE_FAILURE`), so the peers are
judged against the same loop without a cache, their own exact path.
"""

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

BASE_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                      base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                      time_shift_type="exponential")
CACHE_DIT_PYTHON = Path("/work/venv-cachedit/bin/python")


def register_block() -> None:
    """diffusers' block-level caches need the 2.1 block's return layout: one tensor, no encoder stream."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TransformerBlock

    TransformerBlockRegistry.register(QwenImage21TransformerBlock, TransformerBlockMetadata(
        return_hidden_states_index=None, return_encoder_hidden_states_index=None))


def load_transformer(models: Path, turbo: bool = False):
    from diffusers import QwenImage21Transformer2DModel

    folder = models / "diffusers" / ("Qwen-Image-2.1-Turbo" if turbo else "Qwen-Image-2.1") / "transformer"
    return QwenImage21Transformer2DModel.from_pretrained(folder).eval()


def peer_configs(calibrated_mag_ratios=None) -> dict:
    """Each diffusers peer setting: name -> a factory of its config (fresh state per run)."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, SeaCacheConfig, TaylorSeerCacheConfig

    configs = {
        "diffusers FirstBlockCache 0.05": lambda: FirstBlockCacheConfig(threshold=0.05),
        "diffusers FirstBlockCache 0.1": lambda: FirstBlockCacheConfig(threshold=0.1),
        "diffusers FirstBlockCache 0.2": lambda: FirstBlockCacheConfig(threshold=0.2),
        "diffusers TaylorSeer (defaults: interval 5, order 1)": lambda: TaylorSeerCacheConfig(),
        "diffusers TaylorSeer interval 3": lambda: TaylorSeerCacheConfig(cache_interval=3),
        # SeaCache reads its indicator from `raw_vision_callback`, written for Cosmos3 / Wan; without one (none
        # exists for 2.1) it never skips: run to show it
        "diffusers SeaCache 0.25 (default)": lambda: SeaCacheConfig(),
    }
    if calibrated_mag_ratios is not None:
        ratios = list(calibrated_mag_ratios)
        configs["diffusers MagCache 0.06 (default)"] = lambda: MagCacheConfig(
            num_inference_steps=len(ratios), mag_ratios=ratios)
        configs["diffusers MagCache 0.12"] = lambda: MagCacheConfig(
            threshold=0.12, num_inference_steps=len(ratios), mag_ratios=ratios)
    return configs


def denoise(transformer, cond, noise, steps: int, negative=None, cfg: float = 1.0) -> torch.Tensor:
    """The Base pipeline's loop over `steps` sigmas (no KV cache), `(1, 64, h, w)` latents; with `negative` and cfg
    > 1 true CFG as the pipeline does it: a second call per step in its own cache context ("uncond"), so each cache
    keeps one state per prompt."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    batch, _, height, width = noise.shape
    tokens = height * width
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(BASE_SCHEDULER)
    config = scheduler.config
    mu = config.base_shift + (config.max_shift - config.base_shift) * (tokens - config.base_image_seq_len) / (
        config.max_image_seq_len - config.base_image_seq_len)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps), mu=mu)
    latents = noise.flatten(2).transpose(1, 2)
    img_shapes = [[(1, h, w) for h, w in cond.ref_shapes] + [(1, height, width)]] * batch

    def branch(c):
        mask = torch.cat([c.image_slots, torch.ones(tokens // 4, dtype=torch.bool)])[None].expand(batch, -1)
        return dict(encoder_hidden_states=c.text[None].expand(batch, -1, -1), img_mask=mask, img_shapes=img_shapes)

    branches = [("cond", branch(cond))] + ([("uncond", branch(negative))] if negative is not None and cfg > 1 else [])
    for i, t in enumerate(scheduler.timesteps):
        x = latents if cond.references is None else torch.cat([cond.references[None].expand(batch, -1, -1),
                                                               latents], 1)
        preds = []
        for name, kwargs in branches:
            with transformer.cache_context(name, step_index=i, sigma=scheduler.sigmas[i], num_inference_steps=steps):
                out = transformer(hidden_states=x, timestep=t.expand(batch).to(x.dtype) / 1000, return_dict=False,
                                  **kwargs)[0]
            preds.append(out[:, -tokens:])
        v = preds[0] if len(preds) == 1 else preds[1] + cfg * (preds[0] - preds[1])
        latents = scheduler.step(v, t, latents, return_dict=False)[0]
    return latents.transpose(1, 2).reshape(batch, 64, height, width)


def calibrate_mag_ratios(transformer, cond, noise, steps: int, negative=None, cfg: float = 1.0) -> list:
    """MagCache's own calibration (calibrate=True, one run, no step skipped): the ratios it prints at the end (with
    CFG, the last prompt's: one list for both, as the config takes one)."""
    from diffusers.hooks import MagCacheConfig

    printed = io.StringIO()
    transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=steps))
    try:
        with torch.no_grad(), contextlib.redirect_stdout(printed):
            denoise(transformer, cond, noise, steps, negative, cfg)
    finally:
        transformer.disable_cache()
    lists = [line.strip() for line in printed.getvalue().splitlines() if line.strip().startswith("[")]
    ratios = [float(v) for v in lists[-1].strip("[]").split(",")] if lists else []
    if len(ratios) != steps:
        raise RuntimeError(f"MagCache's calibration gave {len(ratios)} ratios for {steps} steps.")
    return ratios


KV_CACHE_FAILURE = ("with the 2.1 KV cache (extract on the first call, cached after) FirstBlockCache and MagCache "
                    "compare the extract call's residual (prefix + target rows) with a cached call's (target rows "
                    "only): RuntimeError, the size of tensor a (256) must match the size of tensor b (282)")

CACHE_DIT_SCRIPT = """
import sys, torch
from diffusers import QwenImage21Transformer2DModel
import cache_dit, diffusers
from cache_dit import BlockAdapter, DBCacheConfig, ForwardPattern
print("versions", diffusers.__version__, torch.__version__, cache_dit.__version__)
tr = QwenImage21Transformer2DModel.from_pretrained(sys.argv[1]).eval()
cache_dit.enable_cache(BlockAdapter(transformer=tr, blocks=tr.transformer_blocks,
                                    forward_pattern=ForwardPattern.Pattern_3),
                       cache_config=DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0,
                                                  residual_diff_threshold=0.08, num_inference_steps=40))
tokens, text = 16, 8
mask = torch.cat([torch.zeros(text, dtype=torch.bool), torch.ones(tokens // 4, dtype=torch.bool)])[None]
try:
    with torch.no_grad():
        tr(hidden_states=torch.randn(1, tokens, 64), timestep=torch.tensor([0.5]),
           encoder_hidden_states=torch.randn(1, text, tr.config.context_in_dim), img_mask=mask,
           img_shapes=[[(1, 4, 4)]], return_dict=False)
    print("ran")
except Exception as error:
    print("failed", type(error).__name__ + ":", str(error).splitlines()[0])
"""


def try_cache_dit(models: Path) -> str:
    """Whether cache-dit 1.5.3 (its own venv) adapts the 2.1 transformer: its versions and the outcome, one line."""
    if not CACHE_DIT_PYTHON.is_file():
        return f"not run: no {CACHE_DIT_PYTHON} (python -m venv --system-site-packages /work/venv-cachedit && " \
               "/work/venv-cachedit/bin/pip install cache-dit==1.5.3)"
    folder = models / "diffusers" / "Qwen-Image-2.1" / "transformer"
    done = subprocess.run([str(CACHE_DIT_PYTHON), "-c", CACHE_DIT_SCRIPT, str(folder)], capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("versions", "ran", "failed"))]
    return "; ".join(lines) or f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"


if __name__ == "__main__":
    print(try_cache_dit(Path(sys.argv[1])))
