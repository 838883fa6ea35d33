#!/usr/bin/env bash
# Makes, in this checkout's ignored folders, what a bare GPU machine (no ComfyUI, no internet) lacks for
# benchmarks/gpu_suite.sh; carry both folders with the working tree (about 16 MB):
#   .host/ComfyUI  ComfyUI (from COMFYUI_PATH, default /opt/ComfyUI) without its tests and git history
#   .whl/          the pure-Python wheels ComfyUI's sampler path imports that the machine lacks (pip download)
# Usage: COMFYUI_PATH=/path/to/ComfyUI-0.3.64 benchmarks/gpu_pack.sh
#        benchmarks/gpu_pack.sh --fa4   FlashAttention-4 for Python 3.12 and CUDA 13 instead: its wheels in .whl_fa4/
#                                       and the cu13 library, xz-compressed, in three parts .fa4/, .fa4b/ and .fa4c/
#                                       sized to travel one a call beside the tree (benchmarks/gpu_setup.sh says how)
set -eu
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fa4" ]; then
  wheels="flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
    nvidia-cutlass-dsl-libs-core==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
    einops==0.8.1 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1"
  download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$@"
  }
  rm -rf .whl_fa4 .fa4 .fa4b .fa4c && mkdir -p .whl_fa4 .fa4 .fa4b .fa4c
  # shellcheck disable=SC2086
  download .whl_fa4 $wheels
  work=$(mktemp -d)
  download "$work" nvidia-cutlass-dsl-libs-cu13==4.8.1
  mkdir "$work/lib" && (cd "$work/lib" && unzip -q ../nvidia_cutlass_dsl_libs_cu13-*.whl &&
    rm -rf nvidia_cutlass_dsl/cu13/lib/stubs)        # the aarch64 and QNX stubs
  tar -C "$work/lib" -cf - . | xz -T0 -6 > "$work/cu13.tar.xz"
  head -c 10000000 "$work/cu13.tar.xz" > .fa4/cu13.tar.xz.00
  tail -c +10000001 "$work/cu13.tar.xz" | head -c 40000000 > .fa4b/cu13.tar.xz.01
  tail -c +50000001 "$work/cu13.tar.xz" > .fa4c/cu13.tar.xz.02
  rm -rf "$work"
  du -sh .whl_fa4 .fa4 .fa4b .fa4c
  exit 0
fi
source_dir=${COMFYUI_PATH:-/opt/ComfyUI}
[ -f "$source_dir/comfy/model_base.py" ] || { echo "no ComfyUI at $source_dir: set COMFYUI_PATH" >&2; exit 1; }
rm -rf .host/ComfyUI && mkdir -p .host/ComfyUI
tar -C "$source_dir" --exclude=.git --exclude=tests --exclude=tests-unit --exclude=__pycache__ -cf - . \
  | tar -C .host/ComfyUI -xf -
chmod -R u+w .host/ComfyUI
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl diskcache torchsde trampoline
du -sh .host .whl
