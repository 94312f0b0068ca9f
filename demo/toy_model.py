"""The toy Qwen-Image 2.1 that was trained here (demo/train_toy.py): the released architecture at a small size,
trained on the procedural shapes of demo/toy_data.py, so it draws what its captions ask for.

Random weights test exactness; this model shows what a lossy option does to a picture (benchmarks/quality.py variants),
and it is what the main job (demo/run_workflows.py) runs by default. Its numbers bound nothing about the real
model; they rank options and show which ones move a picture.

The committed files (demo/toy/, diffusers' key layout, bf16) hold the trained Base and Turbo DiTs and the VAE;
the text encoder is the tiny seeded one of `tiny_checkpoints` (frozen during training: the DiT learnt its
outputs, which tests/test_toy_model.py pins). `write_toy_checkpoints(root)` writes the whole set in every file
layout the loaders read, like `write_tiny_checkpoints`, with these weights in place of random ones.
"""

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..model.loaders.trained_for import TRAINED_FOR_KEY, TrainedFor
from ..model.transformer.dit import DiTConfig
from ..model.vae.autoencoder import QwenImage21VAEConfig
from .tiny_checkpoints import ModelWeights, write_tiny_checkpoints

#: The toy DiT: 4 blocks of 8 heads x 32 (width 256: every quantized format's block size divides its rows), the
#: released RoPE split and SwiGLU ratio; its text width is the tiny text encoder's hidden size.
TOY_DIT = DiTConfig(num_layers=4, num_heads=8, head_dim=32, context_in_dim=16, mlp_ratio=3, axes_dims_rope=(4, 14, 14))
#: The toy VAE: the released stages, 64 latent channels and 16x compression, 8/12 channels wide.
TOY_VAE = QwenImage21VAEConfig(base_dim=8, decoder_base_dim=12, z_dim=64, dim_mult=(1, 2, 4, 8, 8), num_res_blocks=2,
                               temporal_downsample=(False, True, True, True))

TOY_DIR = Path(__file__).resolve().parent / "toy"
BASE_FILE, TURBO_FILE, VAE_FILE, LOG_FILE = ("transformer_base.safetensors", "transformer_turbo.safetensors",
                                              "vae.safetensors", "training_log.json")

#: The target size the toy was trained at (and the size its references take: the VLM's minimum).
TOY_SIZE = 256
#: What every DiT file `write_toy_checkpoints` writes declares in its header (model/loaders/trained_for.py), so a
#: sampler on the toy at another size or scale says what to expect: at 384x384 and 512x512 it drew the asked
#: background with a few stray specks and no shape (one prompt, seed 0, 20 steps; a 1024x1024 graph ran 223 s into a
#: near-black picture with specks), and under CFG its colours drift (blue to green, red to yellow: 62% of prompts
#: right at cfg 4 against 95% at cfg 1, docs/toy-model.md).
TOY_TRAINED_FOR = TrainedFor("the toy model", ((TOY_SIZE, TOY_SIZE),), (1.0,),
                             expect_size="specks, not the asked shapes", expect_cfg="colours off the prompt")


def toy_available(folder: Path = TOY_DIR) -> bool:
    return all((Path(folder) / name).is_file() for name in (BASE_FILE, TURBO_FILE, VAE_FILE))


def toy_weights(folder: Path = TOY_DIR) -> ModelWeights:
    """The trained weights as `write_tiny_checkpoints` takes them. Raises FileNotFoundError naming the missing file
    and the command that makes it."""
    folder = Path(folder)
    for name in (BASE_FILE, TURBO_FILE, VAE_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: train the toy with `python demo/train_toy.py`.")
    return ModelWeights(TOY_DIT, TOY_VAE, load_file(folder / BASE_FILE), load_file(folder / TURBO_FILE),
                        load_file(folder / VAE_FILE))


def training_log(folder: Path = TOY_DIR) -> dict:
    path = Path(folder) / LOG_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_toy_checkpoints(root: Path, folder: Path = TOY_DIR) -> dict[str, Path]:
    """The trained toy in every file layout under `root` (a ComfyUI models folder): see `write_tiny_checkpoints`.
    Every DiT file (single files and the diffusers folders' shards) declares `TOY_TRAINED_FOR` in its header."""
    paths = write_tiny_checkpoints(root, weights=toy_weights(folder))
    shards = [file for repo in ("diffusers_base", "diffusers_turbo")
              for file in sorted((paths[repo] / "transformer").glob("*.safetensors"))]
    for file in (paths["dit"], paths["turbo_dit"], *shards):
        declare_trained_for(file, TOY_TRAINED_FOR)
    return paths


def declare_trained_for(file: Path, trained: TrainedFor) -> None:
    """Rewrite a safetensors file with `trained` in its header metadata; its tensors keep their bytes. (The committed
    files in demo/toy/ carry no marker: their SHA-256 are what `train_toy.py --check` rebuilds.)"""
    with safe_open(str(file), framework="pt") as handle:
        metadata = handle.metadata() or {}
    save_file(load_file(file), str(file), metadata={**metadata, TRAINED_FOR_KEY: trained.to_json()})
