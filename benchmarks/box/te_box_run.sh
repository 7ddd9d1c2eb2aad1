#!/usr/bin/env bash
# The real-TransformerEngine session on the GPU box (issue #17), one stage per device call:
#   bash benchmarks/box/te_box_run.sh STAGE...     STAGE: setup | tests | align | bench-pow2 | bench-fp32 | ops
# Needs the vLLM kit, SmolLM2 and the TE bundle staged in /root/stage (docs/dev/gpu_box.md);
# every stage re-sources the setup scripts (cheap once installed). Output under $OUT/te/.
set -uo pipefail
out="${OUT:-/tmp/out}/te"; mkdir -p "$out"
source benchmarks/box/gpu_box_setup.sh >/dev/null || exit 1
source benchmarks/box/gpu_model_setup.sh >/dev/null || exit 1
source benchmarks/box/te_box_setup.sh || exit 1
export VLLM_LOGGING_LEVEL=WARNING
bench=(python3 -m fp8_align.cli bench-error --device cuda --training-side megatron-te,engine-kernels --json-only --no-plots)
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    setup) ;;
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs tests/test_gpu_megatron_te.py tests/test_megatron_ext.py \
        "tests/test_gpu_kernels.py::test_engine_kernel_training_linear_is_bit_identical_to_the_engine_layer" \
        "tests/test_gpu_kernels.py::test_engine_kernel_training_linear_trains" > "$out/pytest_te_pow2.txt" 2>&1
      tail -5 "$out/pytest_te_pow2.txt"
      NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_megatron_te.py \
        -k "fp8 or te_linear" > "$out/pytest_te_fp32.txt" 2>&1
      tail -5 "$out/pytest_te_fp32.txt" ;;
    align)
      python3 -m benchmarks.te_alignment --out "$out/te_alignment_pow2.json" > "$out/te_alignment_pow2.log" 2>&1; tail -3 "$out/te_alignment_pow2.log"
      NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 python3 -m benchmarks.te_alignment --out "$out/te_alignment_fp32.json" \
        > "$out/te_alignment_fp32.log" 2>&1; tail -3 "$out/te_alignment_fp32.log" ;;
    bench-pow2)
      "${bench[@]}" --variants bf16,fp8_pow2 --out "$out/bench_pow2" > "$out/bench_pow2.log" 2>&1; tail -30 "$out/bench_pow2.log" ;;
    bench-fp32)
      NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 "${bench[@]}" --variants fp8,fp8_te_rule,fp8_bf16_ends --out "$out/bench_fp32" \
        > "$out/bench_fp32.log" 2>&1; tail -30 "$out/bench_fp32.log" ;;
    ops)  # which Megatron-TE ops differ from the bitwise engine's (issue #24 item 7)
      python3 -m benchmarks.megatron_te_ops --out "$out/megatron_te_ops_pow2.json" > "$out/megatron_te_ops_pow2.log" 2>&1
      echo "rc=$?"; grep '^{' "$out/megatron_te_ops_pow2.log" | cut -c1-220
      NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 python3 -m benchmarks.megatron_te_ops --out "$out/megatron_te_ops_fp32.json" \
        > "$out/megatron_te_ops_fp32.log" 2>&1
      echo "rc=$?"; grep '^{' "$out/megatron_te_ops_fp32.log" | cut -c1-220 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
tar -C "${OUT:-/tmp/out}" -czf "${OUT:-/tmp/out}/te_results.tgz" te && rm -rf "$out"
