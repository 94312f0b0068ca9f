"""Pure PyTorch implementation of Qwen-Image 2.1. Never imports ComfyUI."""
