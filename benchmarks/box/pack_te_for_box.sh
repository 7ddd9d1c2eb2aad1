#!/usr/bin/env bash
# Pack TransformerEngine 2.20.2 (+ megatron-core 0.19.2) for the offline GPU box (Python 3.12,
# torch 2.11.0+cu130): the binary core wheel, the Python metapackage, the torch-extension sdist
# (built on the box by benchmarks/box/te_box_setup.sh: it has g++ 13, ninja and torch's CUDA headers,
# plus the crt and libcu++ headers of nvidia-cuda-crt / nvidia-cuda-cccl, which CUDA 13's
# cuda_runtime.h and cuda_fp16.h include)
# and TE's runtime Python dependencies, as one tar split into parts that fit the device tool's
# 64 MiB carry limit, plus ID (sha256 of the tar, first 16 hex digits).
#   bash benchmarks/box/pack_te_for_box.sh [.gpute]        (run from the repository root; ~300 MB download)
# Versions are pinned here; the sdist is checked against its PyPI sha256.
set -euo pipefail
out="${1:-.gpute}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels"
pin=(--no-deps --only-binary :all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$work/wheels")
pip download -q "${pin[@]}" transformer-engine==2.20.2 transformer-engine-cu13==2.20.2 megatron-core==0.19.2 \
  onnx==1.23.2 onnxscript==0.7.2 onnx_ir==1.1.0 ml_dtypes==0.6.0 nvdlfw-inspect==0.2.2
# CUDA 13 moved crt/host_config.h and libcu++ (nv/target, cub) out of the runtime headers; torch's
# own CUDA wheels lack them. Build-only: the extension needs no CUDA compiler, only these headers.
pip download -q --no-deps --only-binary :all: -d "$work/wheels" nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
sdist=transformer_engine_torch-2.20.2.tar.gz
sdist_sha=4c40ced8a6261649e689076f198d4feaf02277b1ba18931a66eccdaceb33c43e
curl -sSfL -o "$work/wheels/$sdist" "https://files.pythonhosted.org/packages/3d/fb/c9ce298a38c22ed1059923a01cac7e1f4e4f7281d39a8679c8118febe079/$sdist"
echo "$sdist_sha  $work/wheels/$sdist" | sha256sum -c --quiet
mkdir -p "$out" && rm -f "$out"/te.part_* "$out"/ID  # a prebuilt transformer_engine_torch wheel there stays
tar -C "$work" -cf "$work/te.tar" wheels
split -b 48M -d -a 2 "$work/te.tar" "$out/te.part_"
sha256sum "$work/te.tar" | cut -c1-16 > "$out/ID"
grep -qx '/.gpute/' .git/info/exclude 2>/dev/null || echo '/.gpute/' >> .git/info/exclude
ls -l "$out" && (cd "$work/wheels" && ls -1)
