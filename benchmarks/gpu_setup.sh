#!/usr/bin/env bash
# Prepares a bare lent GPU machine for the GPU benchmarks, from what travels with the working tree (RESULTS.md,
# "GPU speed", says how each part is made here):
#   .host.tar.xz     ComfyUI 0.3.64's Python packages and top-level modules, unpacked into .host/ComfyUI
#   .whl/*.whl       wheels the machine lacks that ComfyUI's sampler path imports (diskcache, torchsde, trampoline)
#   .whl_fa4/*.whl   the FlashAttention-4 packages (flash-attn-4, nvidia-cutlass-dsl and its base and core libraries,
#                    quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext, einops, cuda-bindings, cuda-pathfinder)
#   .whl_av/*.whl    av, which ComfyUI's comfy_api imports (gpu_compose.py's EasyCache node)
#   .fa4*/cu13.tar.xz.NN  the nvidia-cutlass-dsl cu13 library, unpacked and xz-compressed in parts: it is larger than
#                    one call's transfer limit, so its parts come over several calls to the same warm machine, one
#                    folder a call (benchmarks/gpu_pack.sh --fa4 makes .whl_fa4, .fa4, .fa4b and .fa4c: carry .host,
#                    .whl, .whl_fa4 and .fa4 in the first call, .fa4b in the second, .fa4c in the third, each within
#                    30 s of the last, each sourcing this with 3)
# Usage: source benchmarks/gpu_setup.sh PARTS   (PARTS: how many .fa4 parts make the whole archive)
# Everything lands under /tmp, which outlives a call while the machine stays warm; run it at the start of each call.
parts_expected=${1:?number of .fa4 parts}
mkdir -p /tmp/site /tmp/fa4parts
if [ -f .host.tar.xz ] && [ ! -d .host/ComfyUI/comfy ]; then
  mkdir -p .host/ComfyUI && tar xJf .host.tar.xz -C .host/ComfyUI || return 1
fi
# Each folder once per machine: pip's --target --upgrade replaces a whole top-level folder, which would drop the cu13
# library unpacked into nvidia_cutlass_dsl/ below.
for folder in .whl .whl_fa4 .whl_av; do
  if ls $folder/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.installed$folder ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $folder/*.whl && touch /tmp/site/.installed$folder || return 1
  fi
done
cp .fa4*/cu13.tar.xz.* /tmp/fa4parts/ 2>/dev/null
parts_here=$(ls /tmp/fa4parts | wc -l)
if [ "$parts_here" -eq "$parts_expected" ] && [ -f /tmp/site/.installed.whl_fa4 ] && [ ! -f /tmp/site/.fa4_unpacked ]; then
  cat /tmp/fa4parts/cu13.tar.xz.* | xz -d | tar x -C /tmp/site && touch /tmp/site/.fa4_unpacked || return 1
fi
# PYTHONPATH does not read .pth files (nvidia-cutlass-dsl puts its packages on the path with one): site does.
echo 'import site; site.addsitedir("/tmp/site")' > /tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "gpu_setup: .fa4 parts $parts_here of $parts_expected; FA4 library $([ -f /tmp/site/.fa4_unpacked ] && echo ready || echo not yet)"
