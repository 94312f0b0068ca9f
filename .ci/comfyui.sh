#!/usr/bin/env bash
# A real ComfyUI for the tests that need a server (tests/test_comfyui_*.py, test_comfy_samplers.py,
# test_many_workers.py): usage `.ci/comfyui.sh DEST`, run from the repository root. Follows ../shared/comfyui.md:
# the 2026-08 snapshot in ../shared/comfyui copied to DEST/comfyui (shared/ is read-only in CI), its own venv in
# DEST/comfyvenv with the local CPU torch, ComfyUI's requirements without torch/torchvision/torchaudio (pinned so
# nothing pulls a CUDA torch) and spandrel without its torchvision dependency, as in the docstring of
# tests/test_comfyui_server.py. torchvision and torchaudio stay missing: the test harness puts its empty stand-ins
# (tests/comfyui/stubs/) on the server's PYTHONPATH. Last, ComfyUI's own `--quick-test-for-ci` start with this pack
# installed, the same way, so a set-up that cannot start a server fails here and not in the tests.
# Exits non-zero at the first failing step; .ci/run then says so and lets those tests skip.
set -euo pipefail

dest=$1
shared=../shared/comfyui
[ -f "$shared/main.py" ] || { echo "no ComfyUI snapshot at $shared (see ../shared/comfyui.md)"; exit 1; }
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)

cp -r "$shared" "$dest/comfyui"
chmod -R u+w "$dest/comfyui"  # the copy keeps shared/'s read-only modes
python3 -m venv "$dest/comfyvenv"
py="$dest/comfyvenv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "torch==2.13.0"
echo "torch==2.13.0" > "$dest/torch_pin.txt"
grep -v -E '^(torch|torchvision|torchaudio|spandrel)$' "$dest/comfyui/requirements.txt" > "$dest/requirements.txt"
"$py" -m pip install -q -c "$dest/torch_pin.txt" -r "$dest/requirements.txt"
"$py" -m pip install -q --no-deps spandrel
"$py" -m pip install -q -c "$dest/torch_pin.txt" "gguf==0.19.0"  # the GGUF server test (the test extra's pin)

# ComfyUI's start-up check, the pack linked into a scratch base directory, the stand-ins the harness would use
base="$dest/quick_test"
mkdir -p "$base/custom_nodes" "$base/standins"
ln -s "$(pwd)" "$base/custom_nodes/comfyui-qwen-image21"
for module in torchvision torchaudio; do
    if ! "$py" -c "import $module" 2>/dev/null; then
        ln -s "$(pwd)/tests/comfyui/stubs/$module" "$base/standins/$module"
        ln -sf "$(pwd)/tests/comfyui/stubs/qi21_test_standin.py" "$base/standins/qi21_test_standin.py"
    fi
done
(cd "$dest/comfyui" && PYTHONPATH="$base/standins" "$py" main.py --cpu --quick-test-for-ci \
    --base-directory "$base" --database-url sqlite:///:memory: --disable-api-nodes) > "$base/quick_test.log" 2>&1 \
    || { tail -40 "$base/quick_test.log"; echo "ComfyUI --quick-test-for-ci failed"; exit 1; }
if ! grep -q "comfyui-qwen-image21" "$base/quick_test.log" || grep -q "IMPORT FAILED" "$base/quick_test.log"; then
    tail -40 "$base/quick_test.log"
    echo "ComfyUI started but did not load this pack"
    exit 1
fi
echo "ComfyUI ready: QI21_COMFYUI=$dest/comfyui QI21_COMFYUI_PYTHON=$py"
