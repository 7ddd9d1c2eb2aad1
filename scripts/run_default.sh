#!/usr/bin/env bash
# Set up the CPU environment and run fp8_align's main job on its embedded default.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup_cpu_env.sh"
exec "${FP8_ALIGN_VENV:-$root/.venv}/bin/fp8-align" doctor "$@"
