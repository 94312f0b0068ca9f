"""Make the repository importable as `qi21` whatever its folder is called.

ComfyUI imports the pack by its folder name (often `ComfyUI-QwenImage21`, which is not a valid module
name), so the tests register the repository root under one stable package name instead.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))
from pack_import import import_pack  # noqa: E402

import_pack()
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield
