#!/usr/bin/env bash
# Re-measures the GPU figures of the README's Results table (and benchmarks/RESULTS.md's few-step and region-only
# rows) in one call on one H200, within 9 minutes, writing each benchmark's JSON and log into OUTDIR (8 files).
#
#   benchmarks/gpu_suite.sh OUTDIR            # on the GPU machine (it runs from the repository root)
#   benchmarks/gpu_suite.sh OUTDIR --smoke    # the same chain at toy sizes on the CPU (needs COMFYUI_PATH)
#   benchmarks/gpu_suite.sh OUTDIR --a14b     # the Wan 2.2 A14B row alone (about 5 minutes: it does not fit beside
#                                             # the rest in 9 minutes)
#
# In priority order, each given what is left of the 9 minutes (a part cut short leaves its log saying so):
#   1. gpu_compose.py   Wan 2.1 1.3B, 480p x 81, N=50: plain, miss, hit, EasyCache, miss/hit + EasyCache, and the
#                       region-only hit at target shares 10/30/50 % alone and on EasyCache (the kept keys and values
#                       within the memory plain sampling needs: streamed from pinned host memory beyond it), and at
#                       10 % with all of them resident on the GPU; peak memory of each
#   2. gpu_backbones.py HunyuanVideo 13B, 480p x 81, N=20: plain, miss, hit, region-only hits at 10/30/50 %
#   3. few_step.py      Wan 2.1 1.3B at 4 and 8 steps: plain, miss, hit, region-only hit at 30 %
#   4. gpu_backbones.py LTX-Video 2B, 1216x704 x 257, N=20: plain, miss, hit, region-only hit at 30 %
# Attention: FlashAttention-4 where it is installed (the block-sparse steps and the region steps' target; the README's
# region-only row was measured with it), else FlexAttention and the host's SDPA. Its wheels and CUDA library travel
# over three calls to the same warm machine before this one (benchmarks/gpu_setup.sh says which call carries which);
# the JSON of each benchmark says whether it loaded (fa4_installed). The machine needs ComfyUI in .host/ComfyUI
# (benchmarks/gpu_pack.sh makes it here, with the wheels in .whl/; carry both).
set -u
out=${1:?usage: benchmarks/gpu_suite.sh OUTDIR [--smoke | --a14b]}
mode=${2:-}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out" || exit 1
out=$(cd "$out" && pwd)
started=$(date +%s)
budget=${CARNATOR_SUITE_SECONDS:-540}            # 9 minutes; a smoke run on a busy CPU takes longer:
[ "$mode" = "--smoke" ] && budget=${CARNATOR_SUITE_SECONDS:-3600}

if [ "$mode" != "--smoke" ]; then
  # shellcheck source=/dev/null
  source benchmarks/gpu_setup.sh 0 || exit 1
  if ! python3 -c "import av" 2>/dev/null; then
    # ComfyUI's comfy_api (EasyCache's node imports it) imports PyAV for its video types, never used here: a stand-in
    # package answers those imports (every attribute a placeholder class)
    mkdir -p /tmp/site/av/subtitles
    for file in av/__init__.py av/container.py av/subtitles/__init__.py av/subtitles/stream.py; do
      echo 'def __getattr__(name): return type(name, (), {})' > "/tmp/site/$file"
    done
  fi
fi
python3 -c "import platform, torch; print(platform.platform(), 'python', platform.python_version(), 'torch',
  torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"

left() { echo $(( budget - ($(date +%s) - started) )); }

# part NAME SECONDS_NEEDED SCRIPT ARGS...: runs the benchmark with what is left of the budget, its output in OUTDIR
part() {
  local name=$1 needed=$2; shift 2
  local remaining; remaining=$(left)
  if [ "$remaining" -lt "$needed" ]; then
    echo "$name: not run, ${remaining} s of the budget left and it needs about ${needed} s" | tee "$out/$name.log"
    return
  fi
  echo "[$(( $(date +%s) - started )) s] $name (up to ${remaining} s)"
  timeout --signal=INT "$remaining" python3 "$@" --out "$out/$name.json" > "$out/$name.log" 2>&1
  local status=$?
  [ $status -eq 0 ] || echo "$name: exit status $status (124: cut at the end of the budget)" | tee -a "$out/$name.log"
  tail -n 30 "$out/$name.log"
}

if [ "$mode" = "--smoke" ]; then
  part gpu_compose 0 benchmarks/gpu_compose.py --smoke --skip-cfg5 --repeats 1 --easycache-thresholds 0.4
  part backbones_hunyuan 0 benchmarks/gpu_backbones.py --smoke --quick --only hunyuan-13b --steps 10 --resume 5
  part few_step 0 benchmarks/few_step.py --smoke --steps 4,8 --repeats 1
  part backbones_ltxv 0 benchmarks/gpu_backbones.py --smoke --quick --only ltxv-2b --steps 10 --resume 5 \
    --region-shares 0.3
elif [ "$mode" = "--a14b" ]; then
  part backbones_wan14b 300 benchmarks/gpu_backbones.py --quick --only wan2.2-a14b --video 49x704x1280 \
    --region-shares 0.3
else
  part gpu_compose 200 benchmarks/gpu_compose.py --skip-cfg5 --repeats 1 --easycache-thresholds 0.4
  part backbones_hunyuan 170 benchmarks/gpu_backbones.py --quick --only hunyuan-13b --video 81x480x832
  part few_step 60 benchmarks/few_step.py --steps 4,8 --repeats 1
  part backbones_ltxv 60 benchmarks/gpu_backbones.py --quick --only ltxv-2b --video 257x704x1216 --region-shares 0.3
fi
echo "suite: $(( $(date +%s) - started )) s; files in $out"
