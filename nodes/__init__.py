"""ComfyUI nodes (V3 schema) and the one bridge module to ComfyUI services.

Not written yet: the node contract is fixed in the design notes (DESIGN.md section 2) and lands with the
nodes issue. Nothing here is imported by the package root until then.
"""
