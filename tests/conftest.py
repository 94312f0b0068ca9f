"""What every test module shares: the repository imported as package `qi21`, a fixed seed, and the tiny random
checkpoint set written once per test run.

ComfyUI imports the pack by its folder name (often `ComfyUI-QwenImage21`, which is not a valid module name), so
the tests register the repository root under one stable package name instead, with the helper the demo, the
benchmarks and the workflow builder use (demo/pack_import.py, loaded by its path: pytest puts tests/, not the
repository, on `sys.path`). The helper modules beside this file (`*_fixtures.py`, `oracle.py`) are imported by
name.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch


def _import_pack():
    path = Path(__file__).resolve().parents[1] / "demo" / "pack_import.py"
    spec = importlib.util.spec_from_file_location("qi21_pack_import", path)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    return helper.import_pack()


_import_pack()
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="module")
def benchmark_script():
    """`benchmark_script(name)` -> the module benchmarks/<name>.py, with benchmarks/ on `sys.path` for the test module
    (the scripts import their siblings and benchmarks/parts/ by name, as when run from benchmarks/)."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(folder)


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _default_is_fp32_on_this_cpu(monkeypatch):
    """The suite was written for the loaders' `default` = fp32 on a CPU; on a CPU with native bf16 (AMX) it keeps the
    file's bf16 (model/loaders/checkpoint.py `default_weight_dtype`). Pinned so that results and tolerances do not
    depend on which CPU runs the suite; tests/test_default_dtype.py checks the choice both ways."""
    from qi21.model.loaders import checkpoint

    monkeypatch.setattr(checkpoint, "cpu_has_native_bf16", lambda: False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """The tiny random checkpoint set in every real file layout (demo/tiny_checkpoints.py), written once per run:
    `{"root": the models folder, "dit", "turbo_dit", "text_encoder", "vae", "tokenizer", "diffusers_base",
    "diffusers_turbo": its files and folders}`. Shared by every module, so never written to: a module that needs
    more files in the folder copies it first (test_bad_inputs.py)."""
    from qi21.demo.tiny_checkpoints import write_tiny_checkpoints  # imported here: a broken pack fails its tests only

    return write_tiny_checkpoints(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def toy_models(tmp_path_factory) -> dict[str, Path]:
    """The trained toy (demo/toy/) in every real file layout, each DiT file declaring what it was trained for
    (demo/toy_model.py `write_toy_checkpoints`), written once per run: the same keys as `tiny_models`. Shared by every
    module that runs the toy, so never written to."""
    from qi21.demo.toy_model import write_toy_checkpoints

    return write_toy_checkpoints(tmp_path_factory.mktemp("toy_models"))


@pytest.fixture(scope="module")
def models_root(tiny_models) -> Path:
    """The tiny set as the loaders' models folder for one module (reset afterwards)."""
    from qi21.nodes import bridge

    bridge.set_models_root(tiny_models["root"])
    yield tiny_models["root"]
    bridge.set_models_root(None)


@pytest.fixture(scope="module")
def dit_pair():
    """(diffusers' transformer, our DiT) with the same random fp32 weights (dit_fixtures.tiny_pair), per module."""
    from dit_fixtures import tiny_pair

    return tiny_pair()
