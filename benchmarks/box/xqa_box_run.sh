#!/usr/bin/env bash
# The XQA decode / DeepGEMM rollout session on the GPU box (issue #16), stages per device call:
#   bash benchmarks/box/xqa_box_run.sh STAGE...
#   STAGE: setup | dg-prepare[=MODEL] | dg-probe | tests | tests-moe | probe-nvcc | profile | rollout-VARIANT[,VARIANT...]
# Needs the vLLM kit staged in /root/stage and .flashinfer_aot/ (benchmarks/box/build_flashinfer_aot.sh)
# carried. setup installs the prebuilt XQA modules into FlashInfer's AOT directory and sets
# FLASHINFER_DISABLE_JIT=1 (nothing may compile on the box; a missing module raises, naming it).
# dg-prepare[=MODEL] fills DeepGEMM's JIT cache /root/dg_cache for the linears of a rollout model
# (benchmarks/rollout/checkpoints.py: qwen3-8b, the default, qwen3-30b-a3b, moonlight-16b-a3b;
# `fp8-align prepare-deepgemm --model`, 16 processes; session 16's `dg-prepare-moe` is
# `dg-prepare=qwen3-30b-a3b`; of an MoE model it compiles the routed experts' grouped kernels
# too); the _dg rollout variants start with it. dg-probe times DeepGEMM's grouped GEMM
# per M on its expert shapes (benchmarks/box/deepgemm_grouped_probe.py); tests-moe runs the MoE
# and MLA GPU tests (Triton and DeepGEMM experts, the tiny Moonlight); probe-nvcc says whether the box has a CUDA compiler;
# profile records the decode step of the best Qwen3-8B configuration at batch 512 (after dg-prepare;
# $PROFILE_ARGS, default by the bundle's vLLM: `--batch fp8_align_kv_xqa_dg=512` on 0.22,
# `--batch fp8_align_kv_dg=512 --attention-backend FLASHINFER` on 0.25.1).
# Rollouts: Qwen3-8B shape, $ROLLOUT_ARGS (default: both shapes, vLLM's V2 model runner for every
# variant), variants joined into one report under /root/rollout_work (the same machine across
# calls). Output: $OUT/xqa_results.tgz.
# FLASHINFER_JIT=1: FlashInfer compiles its modules on the box (nvcc there since session 16)
# instead of the carried prebuilt ones: no .flashinfer_aot, FLASHINFER_DISABLE_JIT unset. With
# FP8_ALIGN_GPUKIT=.gpukit25 (the vLLM 0.25.1 bundle) and ROLLOUT_ARGS with --attention-backend
# FLASHINFER this runs the vLLM 0.25.1 peer comparison (issue #26, item 2).
set -uo pipefail
out="${OUT:-/tmp/out}/xqa"; mkdir -p "$out"
source benchmarks/box/gpu_box_setup.sh >/dev/null || exit 1
export VLLM_LOGGING_LEVEL=INFO
if [ "${FLASHINFER_JIT:-0}" = 1 ]; then
  unset FLASHINFER_DISABLE_JIT
else
  aot=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)")
  mkdir -p "$aot" && cp -r .flashinfer_aot/aot/* "$aot/" || exit 1
  export FLASHINFER_DISABLE_JIT=1
fi
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    setup) [ "${FLASHINFER_JIT:-0}" = 1 ] && echo "FlashInfer JIT on: $(command -v nvcc)" || ls "$aot" ;;
    dg-prepare*)
      # the model's config.json from benchmarks/rollout/checkpoints.py; its linears' shapes from that
      model="${stage#dg-prepare}"; model="${model#=}"; model="${model:-qwen3-8b}"
      mkdir -p "/root/dg_config/$model" && python3 -c "import json, sys; from benchmarks.rollout.checkpoints import MODELS; \
        json.dump(MODELS[sys.argv[1]].config, open(sys.argv[2], 'w'))" "$model" "/root/dg_config/$model/config.json" || exit 1
      python3 -m fp8_align.cli prepare-deepgemm --model "/root/dg_config/$model" --cache-dir /root/dg_cache \
        --json "$out/deepgemm_prepare_$model.json" > "$out/deepgemm_prepare_$model.log" 2>&1
      tail -c 1500 "$out/deepgemm_prepare_$model.log"; du -sh /root/dg_cache ;;
    dg-probe)
      DG_JIT_CACHE_DIR=/root/dg_probe_cache python3 benchmarks/box/deepgemm_grouped_probe.py "$out/deepgemm_grouped_probe.json" \
        > "$out/deepgemm_grouped_probe.log" 2>&1; tail -20 "$out/deepgemm_grouped_probe.log" ;;
    tests-moe)
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs -s tests/test_gpu_moe_deepgemm.py tests/test_gpu_moe.py tests/test_gpu_mla.py \
        > "$out/pytest_moe.txt" 2>&1
      grep -E "reference|passed|failed|Error|error" "$out/pytest_moe.txt" | tail -25 ;;
    profile)
      # the best configuration of the bundle's vLLM: fp8_align's XQA route on 0.22, FlashInfer's on 0.25+
      case "$(python3 -c 'import vllm; print(vllm.__version__)')" in
        0.22.*) best="--batch fp8_align_kv_xqa_dg=512" ;;
        *) best="--batch fp8_align_kv_dg=512 --attention-backend FLASHINFER" ;;
      esac
      # shellcheck disable=SC2086
      python3 benchmarks/decode_profile.py --results "$out/profile" ${PROFILE_ARGS:-$best} \
        --deepgemm-cache /root/dg_cache --model-runner v2 > "$out/decode_profile.log" 2>&1
      tail -5 "$out/decode_profile.log" ;;
    probe-nvcc)
      { which nvcc; ls -d /usr/local/cuda*/bin/nvcc; nvcc --version; python3 -c "import torch.utils.cpp_extension as c; print('CUDA_HOME', c.CUDA_HOME)"; } 2>&1 | tail -8 ;;
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs -s tests/test_gpu_xqa.py tests/test_gpu_deepgemm_cache.py \
        > "$out/pytest_xqa_dg.txt" 2>&1
      grep -E "XQA|xqa|cold|passed|failed|Error" "$out/pytest_xqa_dg.txt" | tail -25 ;;
    rollout-*)
      variants="${stage#rollout-}"
      # shellcheck disable=SC2086
      python3 benchmarks/rollout_throughput.py ${ROLLOUT_ARGS:---shapes short,long --model-runner v2} \
        --deepgemm-cache /root/dg_cache --variants "$variants" --results "$out" > "$out/rollout_${variants//,/_}.log" 2>&1
      tail -12 "$out/rollout_${variants//,/_}.log"
      cp /root/rollout_work/*/*.log "$out/" 2>/dev/null ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
tar -C "${OUT:-/tmp/out}" -czf "${OUT:-/tmp/out}/xqa_results.tgz" xqa && rm -rf "$out"
