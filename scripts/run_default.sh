#!/usr/bin/env bash
# Set up the CPU environment and run fp8_align's main job, `fp8-align bench-error`, on its embedded
# default (SmolLM2-135M-Instruct, the shipped prompt set, BF16 and FP8 vLLM engines; ~2-2.5 min on 2 CPU
# cores). Extra arguments go to bench-error, e.g. `--variants all`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup_cpu_env.sh"
exec "${FP8_ALIGN_VENV:-$root/.venv}/bin/fp8-align" bench-error "$@"
