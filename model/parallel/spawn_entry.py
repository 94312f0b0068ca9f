"""The first code a new worker process runs (`runpy.run_path` on this file, from `pool.py`), not an importable module.

A spawned process starts a fresh interpreter that does not know the pack: ComfyUI imported it under its folder
name from a path that is not on `sys.path`, the tests under the name `qi21`. Pickling the worker's function by
reference would fail there, so the process's target is the standard library's `runpy.run_path` on this file, given
the pack's name and folder in `init_globals` (plain strings and the queues). It registers the pack as a bare package
(its `__init__.py`, which imports ComfyUI's node API, is not run: a worker needs `model/` only) and runs
`worker_main.py` as the process's main module inside it, so that everything sent later over the job queue
(conditioning, model recipes, job functions) unpickles by the same names as in the coordinator.
"""

import runpy
import sys
import types


def _start(package: str, root: str, arguments: dict) -> None:
    if package not in sys.modules:
        module = types.ModuleType(package)
        module.__path__ = [root]
        module.__package__ = package
        sys.modules[package] = module
    runpy.run_module(f"{package}.model.parallel.worker_main", init_globals={"QI21_WORKER": arguments},
                     run_name="__qi21_worker__")


if __name__ == "__qi21_worker__":
    _start(**globals()["QI21_SPAWN"])
