#!/usr/bin/env bash
# The XQA decode session on the GPU box (issue #16), one or more stages per device call:
#   bash benchmarks/xqa_box_run.sh STAGE...   STAGE: setup | tests | rollout-VARIANT[,VARIANT...]
# Needs the vLLM kit staged in /root/stage and .flashinfer_aot/ (scripts/build_flashinfer_aot.sh)
# carried. setup installs the prebuilt XQA modules into FlashInfer's AOT directory and sets
# FLASHINFER_DISABLE_JIT=1 (nothing may compile on the box; a missing module raises, naming it).
# Rollouts: Qwen3-8B shape, 512 x (512 in, 2048 out), variants joined into one report under
# /root/rollout_work (the same machine across calls). Output: $OUT/xqa_results.tgz.
set -uo pipefail
out="${OUT:-/tmp/out}/xqa"; mkdir -p "$out"
source benchmarks/gpu_box_setup.sh >/dev/null || exit 1
aot=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)")
mkdir -p "$aot" && cp -r .flashinfer_aot/aot/* "$aot/" || exit 1
export FLASHINFER_DISABLE_JIT=1 VLLM_LOGGING_LEVEL=INFO
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    setup) ls "$aot" ;;
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs -s tests/test_gpu_xqa.py > "$out/pytest_xqa.txt" 2>&1
      grep -E "XQA|xqa|passed|failed|Error" "$out/pytest_xqa.txt" | tail -25 ;;
    rollout-*)
      variants="${stage#rollout-}"
      python3 benchmarks/rollout_throughput.py --shapes long --variants "$variants" --results "$out" > "$out/rollout_${variants//,/_}.log" 2>&1
      tail -12 "$out/rollout_${variants//,/_}.log"
      cp /root/rollout_work/*/*.log "$out/" 2>/dev/null ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
tar -C "${OUT:-/tmp/out}" -czf "${OUT:-/tmp/out}/xqa_results.tgz" xqa && rm -rf "$out"
