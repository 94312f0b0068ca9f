"""Make the repository importable as `qi21` whatever its folder is called.

ComfyUI imports the pack by its folder name (often `ComfyUI-QwenImage21`, which is not a valid module
name), so the tests register the repository root under one stable package name instead.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "qi21"


def _register_pack() -> None:
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        PACKAGE, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)


_register_pack()
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield
