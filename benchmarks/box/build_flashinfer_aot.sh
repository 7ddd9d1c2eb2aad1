#!/usr/bin/env bash
# Build FlashInfer's XQA FP8-KV decode modules for Hopper (sm_90a) on this CPU machine, for the
# offline GPU box (no nvcc there, so FlashInfer cannot JIT). Pinned to what vLLM 0.22.0 pins
# (flashinfer-python 0.6.11.post2, apache-tvm-ffi 0.1.9) and to the CUDA 13.0 compiler wheels
# torch 2.11's cuda-toolkit 13.0.2 pins. Needs .venv (torch, for FlashInfer's imports) and g++.
#   bash benchmarks/box/build_flashinfer_aot.sh [OUT=.flashinfer_aot] [HEAD_DIM:GROUP_RATIO:PAGE_SIZE ...]
# Result: OUT/aot/<module>/<module>.so + OUT/manifest.json. On the box, copy OUT/aot/* into
# FlashInfer's AOT directory (`python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)"`);
# FLASHINFER_DISABLE_JIT=1 then names any module still missing instead of compiling.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="$(realpath -m "${1:-$root/.flashinfer_aot}")"; shift || true
env_dir="$root/.cache/flashinfer_aot_env"
DRIVER_SYMBOLS="cuGetErrorName cuTensorMapEncodeTiled"
site="$env_dir/site"
if [ ! -f "$env_dir/.complete" ]; then
  rm -rf "$env_dir"
  "$root/.venv/bin/python" -m pip install -q --no-deps --target "$site" \
    flashinfer-python==0.6.11.post2 apache-tvm-ffi==0.1.9 ninja==1.13.2 \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 \
    nvidia-cuda-runtime==13.0.96 nvidia-ml-py==13.615.71 einops==0.8.2 tabulate==0.10.0 click==8.5.1
  cuda="$site/nvidia/cu13"
  # FlashInfer links -L$CUDA_HOME/lib64{,/stubs} -lcudart -lcuda: give the wheels that layout,
  # and a libcuda stub (soname libcuda.so.1) defining the driver functions XQA calls, so the
  # module records libcuda.so.1 as NEEDED and the box's driver resolves them at load time.
  ln -sfn lib "$cuda/lib64"
  ln -sfn libcudart.so.13 "$cuda/lib/libcudart.so"
  mkdir -p "$cuda/lib/stubs"
  printf 'int %s(void) { return 0; }\n' $DRIVER_SYMBOLS > "$env_dir/libcuda_stub.c"
  gcc -shared -o "$cuda/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$env_dir/libcuda_stub.c"
  ln -sfn libcuda.so "$cuda/lib/stubs/libcuda.so.1"  # only for the load check below (no driver here)
  touch "$env_dir/.complete"
fi
export CUDA_HOME="$site/nvidia/cu13" FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$env_dir/workspace"
export PATH="$CUDA_HOME/bin:$site/bin:$PATH" PYTHONPATH="$site" LD_LIBRARY_PATH="$CUDA_HOME/lib:$CUDA_HOME/lib/stubs:${LD_LIBRARY_PATH:-}"
rm -rf "$env_dir/workspace" "$out" && mkdir -p "$out"  # every module compiled and linked afresh
"$root/.venv/bin/python" "$root/benchmarks/box/build_flashinfer_aot.py" "$out" ${1:+--specs "$@"}
for so in "$out"/aot/*/*.so; do
  readelf -d "$so" | grep -q 'NEEDED.*libcuda.so.1' || { echo "$so does not link libcuda.so.1"; exit 1; }
  for sym in $(nm -D --undefined-only "$so" | awk '{print $2}' | grep '^cu[A-Z]' || true); do
    case " $DRIVER_SYMBOLS " in *" $sym "*) ;; *) echo "$so needs driver symbol $sym: add it to DRIVER_SYMBOLS"; exit 1;; esac
  done
done
echo "built into $out: $(ls "$out/aot" | wc -l) modules"
