# Source on the GPU box from the repository root, after benchmarks/box/gpu_box_setup.sh:
#   source benchmarks/box/te_box_setup.sh
# Installs the TransformerEngine 2.20.2 bundle made by benchmarks/box/pack_te_for_box.sh into /root/te_site
# (its te.part_NN copied to /root/stage by earlier calls on this machine, or carried in this one
# under .gpute/, with .gpute/ID carried in this call), building TE's torch extension
# (transformer_engine_torch, a CppExtension of 33 C++ files: g++ and ninja, no nvcc) against the
# box's torch once per bundle. Appends /root/te_site to PYTHONPATH after the vLLM kit (whose
# nvidia-cudnn-frontend 1.32.0 also satisfies TE's >= 1.29). Build log: /root/te_build.log
# (and $OUT/te_build.log when $OUT is set, with the built wheel); versions: /root/te_env.txt.
_te_id=$(cat .gpute/ID 2>/dev/null || echo none)
_te_unzip() {  # _te_unzip DEST WHEEL...: extract wheels (zip files) into DEST
  python3 -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" "$@"
}
_te_site=/root/te_site
if [ "$(cat $_te_site/.complete 2>/dev/null)" != "$_te_id" ]; then
  mkdir -p /root/stage && cp .gpute/te.part_* /root/stage/ 2>/dev/null || true
  _te_tar=/root/te_bundle.tar
  cat /root/stage/te.part_* > "$_te_tar"
  _got=$(sha256sum "$_te_tar" | cut -c1-16)
  if [ "$_got" != "$_te_id" ]; then
    echo "te_box_setup: parts in /root/stage do not match bundle $_te_id (got $_got): copy every te.part_NN"; return 1
  fi
  rm -rf "$_te_site" /root/te_wheels && mkdir -p "$_te_site" && tar -C /root -xf "$_te_tar" && mv /root/wheels /root/te_wheels
  _te_unzip "$_te_site" $(ls /root/te_wheels/*.whl | grep -v nvidia_cuda_c) || return 1
  # Build-only headers (crt/host_config.h, nv/target, cub), kept out of the runtime path.
  rm -rf /root/te_build_headers && _te_unzip /root/te_build_headers /root/te_wheels/nvidia_cuda_c*.whl || return 1
  rm -rf /root/te_src /root/te_built && mkdir -p /root/te_src /root/te_built && tar -C /root/te_src -xzf /root/te_wheels/transformer_engine_torch-2.20.2.tar.gz
  _started=$(date +%s)
  # A wheel built on an earlier box (same torch 2.11.0+cu130, Python 3.12) may be carried in .gpute/
  # or staged in /root/stage: then nothing is compiled.
  _prebuilt=$(ls .gpute/transformer_engine_torch-2.20.2-*.whl /root/stage/transformer_engine_torch-2.20.2-*.whl 2>/dev/null | head -1)
  if [ -n "$_prebuilt" ]; then
    cp "$_prebuilt" /root/te_built/ && echo "te_box_setup: prebuilt $(basename "$_prebuilt")" > /root/te_build.log
  else ( cd /root/te_src/transformer_engine_torch-2.20.2 && \
    PYTHONPATH="$_te_site:$PYTHONPATH" CPATH="/root/te_build_headers/nvidia/cu13/include${CPATH:+:$CPATH}" NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=1 \
    NVTE_WITH_NCCL_EP=0 MAX_JOBS=16 python3 -m pip wheel -v --no-build-isolation --no-deps -w /root/te_built . ) \
    > /root/te_build.log 2>&1
  fi
  _rc=$?
  echo "te_box_setup: transformer_engine_torch build rc=$_rc in $(( $(date +%s) - _started )) s" | tee -a /root/te_build.log
  [ -z "${OUT:-}" ] || cp /root/te_build.log "$OUT/te_build.log"
  [ "$_rc" = 0 ] || { tail -40 /root/te_build.log; return 1; }
  [ -z "${OUT:-}" ] || cp /root/te_built/transformer_engine_torch-*.whl "$OUT/"
  _te_unzip "$_te_site" /root/te_built/transformer_engine_torch-*.whl || return 1
  echo "$_te_id" > "$_te_site/.complete"
fi
export PYTHONPATH="$PYTHONPATH:$_te_site"
# TE dlopens cuDNN, NVRTC and cuRAND from *_HOME, then /usr/local/cuda, before Python packages; the
# box's /usr/local/cuda holds an older cuDNN (9.14) than torch's (9.19), and loading it first breaks
# torch's cuDNN check. Point TE at torch's own CUDA libraries.
_nv=$(python3 -c "import os, torch; print(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), 'nvidia'))")
# The cuDNN sub-libraries are found by soname: put torch's first on the loader path too (the system
# /lib/x86_64-linux-gnu holds 9.14's, and mixing the two fails with undefined cudnn symbols).
[ -d "$_nv/cudnn" ] && export CUDNN_HOME="$_nv/cudnn" LD_LIBRARY_PATH="$_nv/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -d "$_nv/cu13" ] && export NVRTC_HOME="$_nv/cu13" CURAND_HOME="$_nv/cu13"
python3 - > /root/te_env.txt 2>&1 <<'PY' || { cat /root/te_env.txt; find /usr/local/cuda*/ -name "libcudnn.so*" 2>/dev/null | head -3; return 1; }
import importlib.metadata as md
import torch
torch.backends.cudnn.version()  # torch's cuDNN first
import transformer_engine.pytorch as te
import transformer_engine_torch  # noqa: F401
import megatron.core
from transformer_engine.pytorch.quantization import check_fp8_block_scaling_support
print(f"transformer_engine={md.version('transformer_engine')} transformer_engine_cu13={md.version('transformer_engine_cu13')} "
      f"transformer_engine_torch={md.version('transformer_engine_torch')} megatron_core={md.version('megatron_core')} "
      f"torch={torch.__version__} cudnn={torch.backends.cudnn.version()}")
import transformer_engine.common as tec
print(f"te_cudnn_lib={tec._CUDNN_LIB_CTYPES._name}")
print(f"fp8_block_scaling_support={check_fp8_block_scaling_support()}")
PY
cat /root/te_env.txt
[ -z "${OUT:-}" ] || cp /root/te_env.txt "$OUT/te_env.txt"
