"""A worker process's main module: run by spawn_entry.py (`runpy.run_module`) once the pack is registered in the new
process, with the worker's arguments in `QI21_WORKER`; importing it does nothing."""

from .worker import serve

if __name__ == "__qi21_worker__":
    serve(**globals()["QI21_WORKER"])
