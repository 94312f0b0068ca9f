"""Train the toy Qwen-Image 2.1 (demo/toy_model.py) on the procedural shapes of demo/toy_data.py, on the CPU.

    python demo/train_toy.py            # ~1 h on 2 cores; writes demo/toy/*.safetensors + training_log.json
    python demo/train_toy.py --quick    # a few steps of every phase (the determinism test runs this twice)
    python demo/train_toy.py --check demo/toy   # rebuild what DIR's log says into a temporary folder: same bytes?
    python demo/train_toy.py --resume demo/toy   # the same, the VAE phase skipped (its file loaded)
    python demo/train_toy.py --resume demo/toy --stage1 FILE   # the same, the DiT's stage 1 too (its file loaded)

One recipe (`RECIPE`, which made the committed files) and the quick one; the recipes tried before it are rows of
docs/toy-model.md, with their settings. The training log (`training_log.json`) is written by this script only: the
recipe, the precision, each phase's seconds and the SHA-256 of every file written, which `--check` compares.

Phases, each seeded, in one process with 2 threads (the same torch build, thread count and `--precision` rebuild
the files bit for bit; another thread count changes the float sums and so the files):
1. **VAE** (the released architecture at widths 8/12) as an autoencoder on 128 px crops around a shape: L2 + L1
   reconstruction (the shape's pixels weighted 5x) and a light KL to N(0, 1), so the decoder tolerates the DiT's
   imperfect latents; channels-last tensors (the CPU's convolutions run 2-3x faster on them). Then frozen, its latent
   space re-expressed (an exact change of variables in the two 1x1 convolutions around it) so that the released
   `latents_mean` / `latents_std` normalise it to zero mean and unit variance: every loader and node treats the toy's
   latents like the real ones.
2. **Data**: scenes and edit pairs rendered, VAE-encoded and text-encoded once. The text encoder is the demo's
   seeded tiny Qwen3-VL (frozen, as the real one is); an edit's reference goes through its vision tower and the
   VAE exactly as the reference node sends it.
3. **DiT** (4 blocks, width 256) by flow matching through the pack's own forward (block-causal attention, the
   t = 0 prefix rows, the ragged prefixes of a batch): `x_s = (1 - s) x0 + s noise`, target `noise - x0`, sigmas
   drawn logit-normal and shifted as the official schedule shifts 256x256 (mu 0.5), and a share drawn from
   [0.85, 1]: where the picture is still noise, only the prompt says what to draw, and the shifted logit-normal
   almost never goes there (a first model trained without it drew shapes but ignored its prompts). The shape's
   latent tokens weigh more in the loss (a small shape is a few % of the tokens, yet all of what the prompt
   says). 10% of text-to-image prompts are empty so CFG has an unconditional model. fp32, or with `--precision
   bf16` bf16 autocast (fp32 weights): twice the speed of fp32 on a CPU with native bf16 (AVX-512, AMX), a 14th of
   it on an AVX2 CPU, which emulates bf16; bf16 gives other files. EMA weights are kept. Under autograd the pack's
   blocks split their row buffer once (not a slice per prompt) and the target rows attend to concatenated keys (the
   CPU kernel's log-sum-exp merge has no gradient): tests/test_training_gradients.py checks the derivative. Two
   stages: new weights, then more steps from stage 1's EMA (a fresh optimizer and warm-up). Stage 1 may
   train on the text-to-image scenes box-downscaled to `stage1_size` (128 px: 8x8 latent tokens), and with
   `small_edits` on the edits too: the VLM still reads the 256 px reference (its minimum), the DiT gets the
   reference's 128 px latents in the first slots of that reading (`shrunk_reference`), and with `full_size_ids`
   every row of the smaller stage gets the RoPE ids of the full-size row it stands for, so the full size starts
   from what the smaller one learnt (without them, 500 steps at 256 px after 5,200 at 128 drew 60% / 55%). A
   128 px step costs ~0.3 of a full one. `RECIPE` (`moreedits`) takes 4,600 steps of 8 at 128 px + 780 at 256
   (half of them edits): the asked colour and side for 95% of held-out prompts and 95% of the edits at cfg 1, 58.3
   minutes on 2 AVX2 cores in fp32 (docs/toy-model.md has what the other recipes drew).
4. **Turbo**: a copy distilled onto the stored 8 sigmas: the Base model's many-step Euler trajectories between
   each pair of stored sigmas are the targets of one student step.
"""

import argparse
import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file

if __name__ == "__main__" and not (__package__ or "").endswith(".demo"):
    # Run as a script: register the repository as package `qi21` and run this module inside it (as
    # run_workflows.py does), where its relative imports of the pack resolve.
    if __package__:
        from .pack_import import import_pack
    else:
        from pack_import import import_pack

    sys.exit(importlib.import_module(f"{import_pack().__name__}.demo.train_toy").main())

from ..model.encoders.conditioning import Conditioning
from ..model.encoders.pipeline import encode_prepared, encode_prompt
from ..model.encoders.references import prepare_reference
from ..model.loaders.text_encoder import load_text_encoder
from ..model.sampling.schedule import TURBO_SIGMAS, schedule_mu
from ..model.transformer.dit import PrefixInputs, QwenImage21DiT
from ..model.transformer.layout import SequenceLayout
from ..model.transformer.training import with_training_paths
from ..model.vae.autoencoder import QwenImage21VAE
from ..model.vae.latents import LATENT_TOKENS_PER_SLOT, RELEASED_LATENT_FORMAT
from .tiny_checkpoints import diffusers_to_dit, dit_to_diffusers, vae_to_diffusers, write_tiny_checkpoints
from .toy_data import SIZE, Scene, random_edit, random_scene
from .toy_model import BASE_FILE, LOG_FILE, TOY_DIR, TOY_DIT, TOY_VAE, TURBO_FILE, VAE_FILE

GRID = (SIZE // 16, SIZE // 16)
#: The DiT after its first stage (not committed).
STAGE1_FILE = "transformer_base_stage1.safetensors"
#: The recipe that made the committed files (`moreedits`; docs/toy-model.md has the others, as rows). high: the
#: share of each batch at sigmas in [0.85, 1]; shape_weight: the loss weight of the shape's tokens (1 elsewhere);
#: stage1_size: stage 1's picture size (128 px: 8x8 latent tokens); small_edits: the edits in stage 1 too, their
#: reference shrunk; full_size_ids: stage 1 at the full size's RoPE ids; edit_share{1,2}: each stage's share of edits.
RECIPE = dict(vae_steps=900, vae_images=1200, t2i=2400, two_shape=500, edits=1500, high=0.5, shape_weight=3.0,
              stage1_size=128, small_edits=True, full_size_ids=True, dit1_steps=4600, dit1_lr=1.2e-3,
              edit_share1=0.45, dit2_steps=780, dit2_lr=8e-4, edit_share2=0.5, turbo_paths=96, turbo_steps=100,
              batch=8)
#: A few steps of every phase, with every switch of `RECIPE` on (the determinism test and `--check`'s test run it).
#: Its data and teacher paths are as small as still feed every phase (the test trains it three times).
QUICK = dict(RECIPE, vae_steps=3, vae_images=8, t2i=4, two_shape=2, edits=4, dit1_steps=3, dit1_lr=1.5e-3,
             dit2_steps=2, dit2_lr=1e-3, turbo_paths=2, turbo_steps=2, teacher_substeps=1, batch=2, edit_share1=0.5)
RECIPES = {"moreedits": RECIPE, "quick": QUICK}
HIGH_SIGMAS = (0.85, 1.0)
#: The DiT's compute dtype (`--precision`): fp32 unless bf16 is asked for (fast only where the CPU has it natively).
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def pixels(image) -> torch.Tensor:
    """PIL RGBA -> `(4, H, W)` in [-1, 1], as the reference node hands pixels to the VAE."""
    return prepare_reference(image, resolution=0).pixels[0]


def small_pixels(image, size: int) -> torch.Tensor:
    """PIL RGBA -> `(4, size, size)` in [-1, 1], box-downscaled: `pixels`' numbers at a size the reference node
    refuses (below the VLM's 256 px), for text-to-image targets only."""
    small = np.asarray(image.convert("RGBA").resize((size, size), Image.Resampling.BOX), dtype=np.float32)
    return torch.from_numpy(small).permute(2, 0, 1) / 127.5 - 1


def tail_mean(values: list, count: int) -> float | None:
    """The mean of the last `count` values (None for a phase of no steps)."""
    return sum(values[-count:]) / len(values[-count:]) if values else None


def rounded(value):
    return None if value is None else round(value, 5)


def cosine(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


# -- 1. VAE ----------------------------------------------------------------------------------------------------
def train_vae(images: torch.Tensor, centres: list, steps: int, log) -> QwenImage21VAE:
    """Crops of 128 px around a shape (a crop of plain background teaches nothing about colour), the shape's pixels
    weighted 5x in the loss: flat backgrounds are most of every image and would otherwise win."""
    generator = torch.Generator().manual_seed(1)
    vae = QwenImage21VAE(TOY_VAE).to(memory_format=torch.channels_last).requires_grad_(True)
    opt = torch.optim.Adam(vae.parameters(), lr=1e-3)
    z, crop = TOY_VAE.z_dim, 128
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine(step, steps, 1e-3, 50)
        pick = torch.randint(len(images), (8,), generator=generator).tolist()
        shift = (torch.randint(-40, 41, (8, 2), generator=generator)).tolist()
        crops = []
        for i, (dx, dy) in zip(pick, shift):
            cx, cy = centres[i]
            left = min(max(0, (cx + dx - crop // 2) // 16 * 16), SIZE - crop)
            top = min(max(0, (cy + dy - crop // 2) // 16 * 16), SIZE - crop)
            crops.append(images[i][:, top : top + crop, left : left + crop])
        # channels last: the CPU's convolutions run several times faster on it than on planar tensors
        x = torch.stack(crops).contiguous(memory_format=torch.channels_last)
        background = x[:, :, :1, :1]  # every crop's corner is background (a shape sits 40 px inside at most)
        weight = 1 + 4 * ((x - background).abs().amax(dim=1, keepdim=True) > 0.2).float()
        moments = vae.quant_conv(vae.encoder(x))
        mean, logvar = moments[:, :z], moments[:, z:].clamp(-20, 4)
        sample = mean + torch.randn(mean.shape, generator=generator) * (0.5 * logvar).exp()
        out = vae.decoder(vae.post_quant_conv(sample))
        error = out - x
        recon = (weight * (error.pow(2) + 0.1 * error.abs())).mean() / weight.mean()
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).mean()
        loss = recon + 1e-3 * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"vae {step:4d}/{steps} recon {recon.item():.5f} kl {kl.item():.3f}")
    vae.requires_grad_(False).eval()
    return vae


@torch.no_grad()
def fit_latent_space(vae: QwenImage21VAE, images: torch.Tensor) -> None:
    """Re-express the latent space so the released statistics normalise it to mean 0, variance 1 (per channel
    centred, one global scale: a channel the KL switched off stays near 0 instead of being blown up to noise).

    The encoder's mean is the first z rows of `quant_conv` and the decoder starts with `post_quant_conv`, both
    1x1 convolutions, so `raw' = a * raw + b` is folded exactly into their weights."""
    z = TOY_VAE.z_dim
    raw = torch.cat([vae._encode_mean(images[i : i + 32]) for i in range(0, len(images), 32)])
    centre = raw.mean(dim=(0, 2, 3))
    scale = (raw - centre[None, :, None, None]).pow(2).mean().sqrt()
    mean, std = (torch.tensor(v) for v in (RELEASED_LATENT_FORMAT.mean, RELEASED_LATENT_FORMAT.std))
    a, b = std / scale, mean - std * centre / scale  # raw' = a raw + b  <=>  (raw' - mean) / std = (raw - c) / s
    q = vae.quant_conv
    q.weight[:z] *= a[:, None, None, None]
    q.bias[:z] = a * q.bias[:z] + b
    q.bias[z:] += 2 * a.log()  # the log-variance rows follow (unused by inference)
    p = vae.post_quant_conv  # p(raw) must equal p_old((raw' - b) / a)
    p.bias += -(p.weight[:, :, 0, 0] @ (b / a))
    p.weight /= a[None, :, None, None]


# -- 2. data ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def encode_latents(vae: QwenImage21VAE, batch: torch.Tensor) -> torch.Tensor:
    """`(N, 4, H, W)` pixels -> `(N, h*w, 64)` normalised packed tokens, as the sampler reads a target."""
    out = []
    for i in range(0, len(batch), 32):
        normalised = RELEASED_LATENT_FORMAT.normalize(vae.encode(batch[i : i + 32]).float())
        out.append(normalised.flatten(2).transpose(1, 2))
    return torch.cat(out)


@functools.cache
def background_pixels(background: str, size: int = SIZE) -> torch.Tensor:
    plain = Scene((), background).render()
    return pixels(plain) if size == SIZE else small_pixels(plain, size)


def shape_tokens(*drawn: tuple[torch.Tensor, str]) -> torch.Tensor:
    """`(h*w,)` 1.0 at the latent tokens the shapes of any `(pixels, background)` touch (pixels away from the
    plain background), else 0."""
    mask = torch.stack([(image - background_pixels(background, image.shape[-1])).abs().amax(0) > 0.1
                        for image, background in drawn])
    return F.max_pool2d(mask.any(0).float()[None, None], 16).flatten()


def build_data(vae, text_encoder, sizes: dict, rng: random.Random, log) -> tuple[list, list | None]:
    """(conditioning, target tokens, kind, shape tokens) for every training example, and the text-to-image ones
    again at `stage1_size` px when that is smaller (else None); an edit's shape tokens are where the shape is in the
    source or the target (where it must appear or go)."""
    captions = {}

    def condition(caption):
        if caption not in captions:
            captions[caption] = encode_prompt(text_encoder, caption)
        return captions[caption]

    vae.to(memory_format=torch.channels_last)  # 2-3x faster convolutions on the CPU
    scenes = [random_scene(rng) for _ in range(sizes["t2i"])]
    scenes += [random_scene(rng, two_shapes=True) for _ in range(sizes["two_shape"])]
    data, small = [], [] if sizes["stage1_size"] < SIZE else None
    for start in range(0, len(scenes), 256):  # a few hundred pictures at a time: a small heap trains faster
        chunk = scenes[start : start + 256]
        drawn = [s.render() for s in chunk]  # each scene drawn once
        images = torch.stack([pixels(image) for image in drawn])
        targets = encode_latents(vae, images)
        added = [(condition(s.caption(rng.randrange(3) if len(s.items) == 1 else 0)), t, "t2i",
                  shape_tokens((image, s.background))) for s, image, t in zip(chunk, images, targets)]
        data += added
        if small is not None:  # the same scenes and captions, smaller
            shrunk = torch.stack([small_pixels(image, sizes["stage1_size"]) for image in drawn])
            small += [(c, t, kind, shape_tokens((image, s.background)))
                      for (c, _, kind, _), s, image, t in zip(added, chunk, shrunk, encode_latents(vae, shrunk))]
    log(f"data: {len(scenes)} text-to-image scenes, {len(captions)} distinct captions")
    edits = [random_edit(rng) for _ in range(sizes["edits"])]
    small_edits = small is not None and sizes.get("small_edits", False)
    for start in range(0, len(edits), 256):
        chunk = edits[start : start + 256]
        drawn = [e.target.render() for e in chunk]
        images = torch.stack([pixels(image) for image in drawn])
        targets = encode_latents(vae, images)
        for edit, image, target, target_image in zip(chunk, images, targets, drawn):
            source_image = edit.source.render()
            source = prepare_reference(source_image, resolution=0)
            reference = encode_prepared(vae, source)
            condition_full = encode_prompt(text_encoder, edit.instruction, [reference])
            data.append((condition_full, target, edit.kind,
                         shape_tokens((source.pixels[0], edit.source.background), (image, edit.target.background))))
            if small_edits:
                side = sizes["stage1_size"]
                source_small, target_small = (small_pixels(i, side) for i in (source_image, target_image))
                latents = encode_latents(vae, torch.stack([source_small, target_small]))
                small.append((shrunk_reference(condition_full, latents[0], side // 16), latents[1], edit.kind,
                              shape_tokens((source_small, edit.source.background),
                                           (target_small, edit.target.background))))
    log(f"data: {len(edits)} edit pairs" + (f", also at {sizes['stage1_size']} px" if small_edits else ""))
    return data, small


def shrunk_reference(condition: Conditioning, tokens: torch.Tensor, side: int) -> Conditioning:
    """An edit's conditioning with its one reference at `side x side` latent tokens (a smaller picture) instead of
    the size the VLM saw (the 256 px the VLM needs at least): the VLM's reading of the picture stays, and only the
    reference's slots shrink to fit the smaller latents. A slot's own text state is never used (the DiT puts the
    reference's latent tokens there), so the surplus slots are dropped and the text around them kept as it is."""
    slots = condition.image_slots
    keep_slots = side * side // LATENT_TOKENS_PER_SLOT
    surplus = slots & (slots.cumsum(0) > keep_slots)  # the slots past the first `keep_slots`
    keep = ~surplus
    return Conditioning(text=condition.text[keep], image_slots=slots[keep], references=tokens,
                        ref_shapes=((side, side),), latent_format=condition.latent_format)


# -- 3. DiT ----------------------------------------------------------------------------------------------------
def new_dit(seed: int) -> QwenImage21DiT:
    """Small normal weights, adaLN-zero: the modulation and the output projection start at 0, so every block
    starts as the identity and the first prediction is 0."""
    generator = torch.Generator().manual_seed(seed)
    dit = QwenImage21DiT(TOY_DIT)
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if name in ("modulation.weight", "proj_out.weight", "norm_out.weight"):
                p.zero_()
            elif name.endswith(("norm_q", "norm_k")):
                p.fill_(1.0)
            elif name == "txt_in.text_norm.weight":
                p.zero_()  # stored as scale - 1
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return dit.requires_grad_(True)


def training_sigmas(count: int, generator, high: float = 0.0, tokens: int = GRID[0] * GRID[1]) -> torch.Tensor:
    """Logit-normal u, shifted as the Base schedule shifts a target of `tokens` latent tokens (exponential; mu 0.5
    at 256x256); a share `high` of them uniform in `HIGH_SIGMAS` instead."""
    u = torch.sigmoid(torch.randn(count, generator=generator))
    shift = math.exp(schedule_mu(tokens))
    sigmas = shift / (shift + 1 / u - 1)
    lo, hi = HIGH_SIGMAS
    noisy = lo + (hi - lo) * torch.rand(count, generator=generator)
    return torch.where(torch.rand(count, generator=generator) < high, noisy, sigmas)


@functools.cache
def full_size_ids(layout: SequenceLayout, factor: int) -> SequenceLayout:
    """`layout` (a picture and its references box-downscaled `factor` times) with the RoPE ids of the full-size
    layout: each image row at the ids of the full-size token it summarises (rows and columns 0, f, 2f, ... of the
    full grid: `-8, -6, ..., 6` for 8 of 16), the text after a reference and the target's frame advanced as the
    full-size reference advances them. A smaller stage then draws a side and a size at the ids where the full size
    draws them, instead of at ids the full size gives the middle of the picture."""
    blocks = layout.block_ids.tolist()
    positions, shift = [], 0
    for row, (frame, height, width) in enumerate(layout.prefix_positions.tolist()):
        ref = blocks[row]
        if ref < 0:  # text: (p, p, p)
            positions.append((frame + shift,) * 3)
            continue
        positions.append((frame + shift, factor * height, factor * width))
        if row + 1 == len(blocks) or blocks[row + 1] != ref:  # the reference ends: later text moves on
            shift += (factor - 1) * max(layout.ref_shapes[ref])
    target = layout.target_positions.clone()
    target[:, 0] += shift
    target[:, 1:] *= factor
    return dataclasses.replace(layout, prefix_positions=torch.tensor(positions, dtype=torch.long).reshape(-1, 3),
                               target_positions=target, derived={})


def velocity(dit, x, sigma, conditions, dtype: torch.dtype = torch.bfloat16, full_side: int | None = None):
    """The DiT's prediction (fp32 weights, fp32 out) for square targets `x` `(B, side**2, 64)`, computed under
    autocast to `dtype` unless that is fp32; with `full_side` (latent tokens a side at full size), a smaller target
    gets the full size's RoPE ids (`full_size_ids`)."""
    side = math.isqrt(x.shape[1])
    layouts = [c.layout((side, side)) for c in conditions]
    if full_side is not None and full_side != side:
        layouts = [full_size_ids(layout, full_side // side) for layout in layouts]
    prefixes = [PrefixInputs(layout=layout, text=c.text, references=c.references)
                for layout, c in zip(layouts, conditions)]
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = dit(x, sigma, prefixes, sample_prefix=list(range(len(conditions))))
    return out.float()


def example_pools(data) -> tuple[list[int], list[int]]:
    """(indices of the edit pairs, indices of the text-to-image examples) in `data`: built once per stage."""
    edits = [i for i, example in enumerate(data) if example[2] != "t2i"]
    return edits, [i for i, example in enumerate(data) if example[2] == "t2i"]


def draw_examples(data, batch: int, generator, edit_share: float | None = None, pools=None) -> list[int]:
    """`batch` indices into `data`, uniform over it; with `edit_share`, that share (on average) drawn from the edits
    and the rest from the text-to-image examples (a stage whose text-to-image reading is learnt spends more on
    edits than their count in the data would give them). `pools`: `example_pools(data)`, when the caller keeps it."""
    if edit_share is None:
        return torch.randint(len(data), (batch,), generator=generator).tolist()
    edits, plain = pools or example_pools(data)
    from_edits = (torch.rand(batch, generator=generator) < edit_share).tolist()
    picks = torch.randint(2**31 - 1, (batch,), generator=generator).tolist()
    return [(edits if e else plain)[k % len(edits if e else plain)] for e, k in zip(from_edits, picks)]


def ema_update(ema, model, step: int) -> None:
    decay = min(0.998, (1 + step) / (10 + step))
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 1 - decay)


def train_dit(data, null, sizes: dict, log, checkpoint=None, stage: int = 1, start: QwenImage21DiT | None = None,
              dtype: torch.dtype = torch.bfloat16) -> tuple[QwenImage21DiT, float]:
    """Flow matching (module docstring, phase 3); returns the EMA weights and the final loss.

    Stage 1 starts from a new DiT; stage 2 from stage 1's (bf16-rounded) EMA weights with a fresh optimizer, its own
    random numbers and a second warm-up and cosine: a stage 2 started from the stage-1 file is the same run."""
    steps, peak = sizes[f"dit{stage}_steps"], sizes[f"dit{stage}_lr"]
    batch = sizes["batch"]
    generator = torch.Generator().manual_seed(3 if stage == 1 else 6)
    dit = with_training_paths(new_dit(2) if start is None else copy.deepcopy(start).requires_grad_(True))
    ema = with_training_paths(copy.deepcopy(dit).requires_grad_(False), False)  # runs as inference: the teacher
    opt = torch.optim.AdamW(dit.parameters(), lr=peak, betas=(0.9, 0.99), weight_decay=0.0)
    losses = []
    edit_share = sizes.get(f"edit_share{stage}")
    pools = None if edit_share is None else example_pools(data)
    full_side = GRID[0] if sizes.get("full_size_ids") else None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine(step, steps, peak, 100 if stage == 1 else 50)
        pick = draw_examples(data, batch, generator, edit_share, pools)
        drop = (torch.rand(batch, generator=generator) < 0.1).tolist()
        conditions = [null if d and data[i][2] == "t2i" else data[i][0] for i, d in zip(pick, drop)]
        x0 = torch.stack([data[i][1] for i in pick])
        weight = 1 + (sizes["shape_weight"] - 1) * torch.stack([data[i][3] for i in pick])[:, :, None]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = training_sigmas(batch, generator, sizes["high"], tokens=x0.shape[1])
        xs = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        error = velocity(dit, xs, sigma, conditions, dtype, full_side) - (noise - x0)
        loss = (weight * error.pow(2)).mean() / weight.mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        ema_update(ema, dit, step)
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log(f"dit stage {stage} {step:5d}/{steps} loss {tail_mean(losses, 100):.4f}")
        if checkpoint is not None and (step + 1) % 500 == 0:
            checkpoint(ema)  # the EMA so far, to look at while training goes on
    return ema, tail_mean(losses, 100)


# -- 4. Turbo --------------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_paths(teacher, data, null, count: int, batch: int, dtype: torch.dtype = torch.bfloat16,
                  substeps: int = 5) -> list[tuple]:
    """Base's Euler trajectories through the stored sigmas (`substeps` per interval, twice as many in the last,
    which ends at 0): `(conditioning, x at each stored sigma + the end)`."""
    generator = torch.Generator().manual_seed(4)
    sigmas = list(TURBO_SIGMAS) + [0.0]
    paths = []
    for _ in range(0, count, batch):
        pick = torch.randint(len(data), (batch,), generator=generator).tolist()
        conditions = [data[i][0] for i in pick]
        x = torch.randn(batch, GRID[0] * GRID[1], 64, generator=generator)
        points = [x]
        for hi, lo in zip(sigmas[:-1], sigmas[1:]):
            sub = 2 * substeps if lo == 0 else substeps
            for k in range(sub):
                s, s_next = hi + (lo - hi) * k / sub, hi + (lo - hi) * (k + 1) / sub
                v = velocity(teacher, x, torch.full((batch,), s), conditions, dtype)
                x = x + (s_next - s) * v
            points.append(x)
        paths += [(conditions[b], torch.stack([p[b] for p in points])) for b in range(batch)]
    return paths


def train_turbo(base, paths, steps: int, batch: int, log,
                dtype: torch.dtype = torch.bfloat16) -> tuple[QwenImage21DiT, float]:
    generator = torch.Generator().manual_seed(5)
    student = with_training_paths(copy.deepcopy(base).requires_grad_(True))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)
    sigmas = torch.tensor(list(TURBO_SIGMAS) + [0.0])
    losses = []
    for step in range(steps):
        pick = torch.randint(len(paths), (batch,), generator=generator).tolist()
        hop = torch.randint(len(TURBO_SIGMAS), (batch,), generator=generator)
        x = torch.stack([paths[i][1][h] for i, h in zip(pick, hop.tolist())])
        x_next = torch.stack([paths[i][1][h + 1] for i, h in zip(pick, hop.tolist())])
        s, s_next = sigmas[hop], sigmas[hop + 1]
        target = (x_next - x) / (s_next - s)[:, None, None]  # the one step that lands where Base's many land
        loss = F.mse_loss(velocity(student, x, s, [paths[i][0] for i in pick], dtype), target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"turbo {step:4d}/{steps} loss {tail_mean(losses, 50):.4f}")
    return with_training_paths(student.requires_grad_(False), False), tail_mean(losses, 50)


# -- the run ---------------------------------------------------------------------------------------------------
def bf16_copy(module: torch.nn.Module) -> dict:
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def train(out: Path, recipe: str = "moreedits", log=print, resume: Path | None = None, stage1: Path | None = None,
          command: str = "python demo/train_toy.py", precision: str = "fp32") -> dict:
    """All phases of `RECIPES[recipe]`; `resume` (a folder with this script's VAE) skips the VAE phase, drawing the
    same random numbers, and `stage1` (this script's stage-1 DiT file) the DiT's first stage, so the result is the
    same as a run from the start. `precision` (`PRECISIONS`) is the DiT's compute dtype: bf16 and fp32 give
    different files. Returns the training log it wrote to `out`, with the SHA-256 of every file written."""
    if recipe not in RECIPES or precision not in PRECISIONS:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)} and precision one of {sorted(PRECISIONS)}; "
                         f"got {recipe!r}, {precision!r}")
    sizes, dtype = RECIPES[recipe], PRECISIONS[precision]
    torch.manual_seed(0)
    torch.set_num_threads(2)
    rng = random.Random(0)
    timings, started = {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # the demo's seeded text encoder, frozen
        text_encoder = load_text_encoder(write_tiny_checkpoints(Path(tmp))["text_encoder"], weight_dtype="fp32")
    text_encoder.model.requires_grad_(False)

    scenes = [random_scene(rng, two_shapes=rng.random() < 0.2) for _ in range(sizes["vae_images"])]
    centres = [rng.choice(scene.items).centre for scene in scenes]
    out.mkdir(parents=True, exist_ok=True)
    if resume is None:
        images = torch.stack([pixels(scene.render()) for scene in scenes])
        vae = train_vae(images, centres, sizes["vae_steps"], log)
        fit_latent_space(vae, images)
        del images  # freed before the data phase fills the heap
    else:
        vae = QwenImage21VAE(TOY_VAE)
        vae.load_state_dict({k: v.view_as(vae.state_dict()[k]) for k, v in load_file(resume / VAE_FILE).items()
                             if k in vae.state_dict()})
        vae.requires_grad_(False).eval()
    save_file(vae_to_diffusers(bf16_copy(vae), TOY_VAE), out / VAE_FILE)
    vae.load_state_dict({k: v.float() for k, v in bf16_copy(vae).items()})  # the committed (bf16) weights
    timings["vae_s"] = time.perf_counter() - started

    # a stage 1 loaded from its file needs no smaller pictures (the random draws are the same either way)
    data, small = build_data(vae, text_encoder, sizes if stage1 is None else dict(sizes, stage1_size=SIZE), rng, log)
    null = encode_prompt(text_encoder, "")
    timings["data_s"] = time.perf_counter() - started - sum(timings.values())

    def checkpoint(ema):
        save_file(dit_to_diffusers(bf16_copy(ema)), out / BASE_FILE)

    if stage1 is None:
        base, stage1_loss = train_dit(data if small is None else small, null, sizes, log, checkpoint, dtype=dtype)
        base.load_state_dict({k: v.float() for k, v in bf16_copy(base).items()})  # as its file holds them
        save_file(dit_to_diffusers(bf16_copy(base)), out / STAGE1_FILE)
    else:
        base, stage1_loss = new_dit(2).requires_grad_(False), None
        base.load_state_dict(diffusers_to_dit({k: v.float() for k, v in load_file(stage1).items()}))
    timings["dit1_s"] = time.perf_counter() - started - sum(timings.values())
    base, dit_loss = train_dit(data, null, sizes, log, checkpoint, stage=2, start=base, dtype=dtype)
    base.load_state_dict({k: v.float() for k, v in bf16_copy(base).items()})  # the committed (bf16) weights
    save_file(dit_to_diffusers(bf16_copy(base)), out / BASE_FILE)
    timings["dit2_s"] = time.perf_counter() - started - sum(timings.values())

    paths = (teacher_paths(base, data, null, sizes["turbo_paths"], sizes["batch"], dtype,
                           sizes.get("teacher_substeps", 5))  # RECIPE: 5, as the committed log records it
             if sizes["turbo_steps"] else [])
    turbo, turbo_loss = train_turbo(base, paths, sizes["turbo_steps"], sizes["batch"], log, dtype)
    timings["turbo_s"] = time.perf_counter() - started - sum(timings.values())

    save_file(dit_to_diffusers(bf16_copy(turbo)), out / TURBO_FILE)
    written = [VAE_FILE, *([STAGE1_FILE] if stage1 is None else []), BASE_FILE, TURBO_FILE]
    record = dict(recipe=recipe, precision=precision, sha256={name: sha256(out / name) for name in written},
                  sizes=sizes, seconds={k: round(v, 1) for k, v in timings.items()},
                  total_s=round(time.perf_counter() - started, 1),
                  final_loss=dict(dit_stage1=rounded(stage1_loss), dit=rounded(dit_loss), turbo=rounded(turbo_loss)),
                  torch=torch.__version__, threads=torch.get_num_threads(), command=command,
                  compute=str(dtype).removeprefix("torch."), cpu=torch.backends.cpu.get_cpu_capability(),
                  resumed=resume is not None, stage1=None if stage1 is None else str(stage1))
    (out / LOG_FILE).write_text(json.dumps(record, indent=1) + "\n")
    log(json.dumps(record))
    return record


def check(folder: Path, log=print, into: Path | None = None) -> bool:
    """Whether a rebuild gives the same bytes as `folder`: its training log names the recipe, the precision and the
    SHA-256 of every file; the same run from scratch into a temporary folder (or `into`, kept) is compared, file by
    file, with the files in `folder` (and the log with them: a file changed since its log was written is named too).

    fp32 results are the same run to run on one machine but depend on the CPU's kernels (AVX2 and AVX-512 sum in
    other orders): the log records the CPU capability it was made with, and a different one here is said first."""
    path = Path(folder) / LOG_FILE
    if not path.is_file():
        raise SystemExit(f"--check: {path} is missing: a folder written by this script holds it")
    record = json.loads(path.read_text())
    recorded = record.get("sha256")
    if not recorded or record.get("recipe") not in RECIPES:
        raise SystemExit(f"--check: {path} records no SHA-256 of its files or no recipe of {sorted(RECIPES)}: it "
                         f"was not written by this script")
    precision = record.get("precision") or {"float32": "fp32", "bfloat16": "bf16"}[record["compute"]]
    here = {name: sha256(Path(folder) / name) if (Path(folder) / name).is_file() else None for name in recorded}
    for name, digest in sorted(recorded.items()):
        if here[name] != digest:
            log(f"{name}: the file in {folder} is {'missing' if here[name] is None else 'not what its log records'}")
    made_on, here_cpu = record.get("cpu"), torch.backends.cpu.get_cpu_capability()
    if made_on and made_on != here_cpu:
        log(f"note: {path} was made on a CPU with {made_on} kernels and this one runs {here_cpu}: fp32 sums in "
            f"another order on other kernels, so other bytes are expected here (the same bytes need {made_on})")
    log(f"rebuilding recipe {record['recipe']} in {precision} (the committed recipe takes ~1 h on 2 cores)")
    command = f"python demo/train_toy.py --check {folder}" + (f" --out {into}" if into else "")
    with contextlib.nullcontext(into) if into else tempfile.TemporaryDirectory() as out:
        rebuilt = train(Path(out), record["recipe"], log, precision=precision, command=command)["sha256"]
    same = True
    for name in sorted(recorded):
        ok = here[name] is not None and here[name] == rebuilt.get(name)
        same &= ok
        log(f"{name}: {'same bytes' if ok else 'DIFFERENT bytes'} (rebuilt {rebuilt.get(name, 'nothing')[:16]}, "
            f"{folder}: {(here[name] or 'missing')[:16]})")
    log("the rebuild gives the same bytes" if same else "the rebuild DIFFERS")
    return same


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="where the files go (default demo/toy/; with --check: keep the rebuilt files there)")
    parser.add_argument("--quick", action="store_true",
                        help="a few steps of every phase (tests, smoke runs); default: the recipe of the committed "
                             "files (moreedits; docs/toy-model.md has the recipes tried before it)")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                        help="the DiT's compute dtype: fp32 (default), or bf16 autocast (fast only on CPUs with "
                             "native bf16, AVX-512 / AMX; other files)")
    parser.add_argument("--resume", type=Path, default=None,
                        help="a folder with this script's vae.safetensors: skip the VAE phase (same result)")
    parser.add_argument("--stage1", type=Path, default=None,
                        help=f"this script's {STAGE1_FILE}: skip the DiT's first stage (same result)")
    parser.add_argument("--check", type=Path, default=None, metavar="DIR",
                        help="rebuild what DIR's training log records (recipe, precision) into a temporary folder and "
                             "say whether every file has the same bytes as DIR's; exit 1 if not")
    args = parser.parse_args(argv)
    log = lambda line: print(line, flush=True)  # noqa: E731
    if args.check is not None:
        if args.quick or args.resume or args.stage1 or args.precision != "fp32":
            parser.error("--check takes the recipe and precision from DIR's training log: give it alone")
        return 0 if check(args.check, log, into=args.out) else 1
    command = " ".join(["python demo/train_toy.py", *(sys.argv[1:] if argv is None else argv)])
    train(args.out or TOY_DIR, "quick" if args.quick else "moreedits", log=log, resume=args.resume, stage1=args.stage1,
          command=command, precision=args.precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
