#!/usr/bin/env bash
# Makes, in this checkout's ignored folders, what a bare GPU machine (no ComfyUI, no internet) lacks for
# benchmarks/gpu_suite.sh; carry both folders with the working tree (about 16 MB):
#   .host/ComfyUI  ComfyUI (from COMFYUI_PATH, default /opt/ComfyUI) without its tests and git history
#   .whl/          the pure-Python wheels ComfyUI's sampler path imports that the machine lacks (pip download)
# Usage: COMFYUI_PATH=/path/to/ComfyUI-0.3.64 benchmarks/gpu_pack.sh
set -eu
cd "$(dirname "$0")/.."
source_dir=${COMFYUI_PATH:-/opt/ComfyUI}
[ -f "$source_dir/comfy/model_base.py" ] || { echo "no ComfyUI at $source_dir: set COMFYUI_PATH" >&2; exit 1; }
rm -rf .host/ComfyUI && mkdir -p .host/ComfyUI
tar -C "$source_dir" --exclude=.git --exclude=tests --exclude=tests-unit --exclude=__pycache__ -cf - . \
  | tar -C .host/ComfyUI -xf -
chmod -R u+w .host/ComfyUI
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl diskcache torchsde trampoline
du -sh .host .whl
