#!/usr/bin/env bash
# Set up the CPU environment (scripts/setup_cpu_env.sh) and run the whole test suite.
# GPU tests are collected and skipped here; run `pytest -m gpu` on a Hopper machine.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup_cpu_env.sh"
cd "$root"
# Two pytest-xdist workers (each engine test leaves a core idle for a while), each file whole on one
# worker, in tests/conftest.py's order (longest first); `-n 0` after it runs serially.
exec "${FP8_ALIGN_VENV:-$root/.venv}/bin/python" -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
