#!/usr/bin/env bash
# The bitwise on-policy session on the GPU box (issue #24), stages per device call:
#   bash benchmarks/box/bitwise_box_run.sh STAGE...
#   STAGE: stage (copy the carried .gpukit/part_* and .gpumodel/smol.zst.part_* to /root/stage)
#        | setup (kit + SmolLM2) | tests | proof[=MODELS] | cost[=PARTS]
# Output under $OUT: env.txt, pytest_bitwise.txt, on_policy_bitwise.json, on_policy_cost.json, logs.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out" /root/stage
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    stage) cp .gpukit/part_* .gpumodel/smol.zst.part_* /root/stage/ 2>/dev/null; ls -l /root/stage ;;
    setup)
      source benchmarks/box/gpu_box_setup.sh >/dev/null || exit 1
      source benchmarks/box/gpu_model_setup.sh || exit 1 ;;
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs tests/test_gpu_bitwise.py > "$out/pytest_bitwise.txt" 2>&1
      tail -25 "$out/pytest_bitwise.txt" ;;
    proof*)
      models="${stage#proof}"; models="${models#=}"
      python3 benchmarks/on_policy_bitwise.py --out "$out/on_policy_bitwise${models:+_${models//,/_}}.json" \
        ${models:+--models "$models"} --work /root/bitwise_work > "$out/on_policy_bitwise${models:+_${models//,/_}}.log" 2>&1
      echo "rc=$?"; tail -40 "$out/on_policy_bitwise${models:+_${models//,/_}}.log"
      tail -c 20000 /root/bitwise_work/*.log > "$out/bitwise_engine_logs.txt" 2>/dev/null ;;
    cost*)
      parts="${stage#cost}"; parts="${parts#=}"
      python3 benchmarks/on_policy_cost.py --out "$out/on_policy_cost.json" ${parts:+--parts "$parts"} --work /root/cost_work \
        > "$out/on_policy_cost.log" 2>&1
      echo "rc=$?"; tail -20 "$out/on_policy_cost.log"
      tail -c 8000 /root/cost_work/*.log > "$out/cost_engine_logs.txt" 2>/dev/null ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
