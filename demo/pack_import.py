"""Register the repository as package `qi21`, whatever its folder is called (ComfyUI imports the pack by its
folder name, e.g. `ComfyUI-QwenImage21`, which is not a valid module name). The one copy of this for the
tests, the benchmarks, the demo, the workflow builder and the ComfyUI test harness. It imports nothing from the
pack and edits no `sys.path`, so it can be loaded before the pack exists as a package: by name from a script in
demo/ (Python puts a script's own folder on `sys.path`), by its file path from anywhere else
(`importlib.util.spec_from_file_location`: tests/conftest.py, workflows/build_workflows.py, benchmarks/)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "qi21"


def import_pack(name: str = PACKAGE):
    """The repository as package `name` (registered on first use; every later call returns the same module)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
