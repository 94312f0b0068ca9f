"""Developer tools that run the pack without ComfyUI: a tiny random checkpoint set in every real file layout
(`tiny_checkpoints.py`) and a headless runner for the shipped API-format workflows (`run_workflows.py`, with the
core nodes it needs in `core_nodes.py`).

A subpackage of the pack, `qi21.demo` once `pack_import.import_pack()` has registered the repository as `qi21`;
its modules import the pack relatively. `python demo/run_workflows.py` does that registration itself. Nothing
here is imported by ComfyUI or by the nodes, and the registry archive leaves this folder out (.comfyignore).
"""
