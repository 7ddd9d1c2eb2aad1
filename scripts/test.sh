#!/usr/bin/env bash
# Set up the CPU environment (scripts/setup_cpu_env.sh) and run the whole test suite.
# GPU tests are collected and skipped here; run `pytest -m gpu` on a Hopper machine.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup_cpu_env.sh"
cd "$root"
exec "${FP8_ALIGN_VENV:-$root/.venv}/bin/python" -m pytest "$@"
