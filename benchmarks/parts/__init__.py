"""What the question scripts one folder up import: the sections and helpers too large or too shared to live inside
one script (gpu_check's sections, weight streaming, speed's roofline, the fp8 recipes, the pad-and-crop picture),
and the diffusers-loop node comfyui.py copies into a server. Nothing here is run by itself: each part is reached
through a script (`python benchmarks/SCRIPT.py QUESTION`), which puts benchmarks/ on `sys.path`."""
