"""The repository as package `qi21` for the benchmark scripts, through the one shared helper demo/pack_import.py
loaded by its file path (run as a script, Python puts benchmarks/, not the repository, on sys.path). Every
benchmark imports this sibling first."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("qi21_pack_import", Path(__file__).resolve().parents[1] / "demo"
                                               / "pack_import.py")
_helper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helper)
_helper.import_pack()
