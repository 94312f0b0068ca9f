"""Developer tools that run the pack without ComfyUI: a tiny random checkpoint set in every real file layout
(`tiny_checkpoints.py`) and a headless runner for the shipped API-format workflows (`run_workflows.py`).
Nothing here is imported by ComfyUI or by the nodes."""
