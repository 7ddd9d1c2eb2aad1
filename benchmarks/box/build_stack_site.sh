#!/usr/bin/env bash
# The RL stacks' packages for the GPU stack-sync tests (tests/test_gpu_stack_sync.py,
# tests/test_gpu_stack_sync_tp.py), as one folder the box puts on PYTHONPATH:
#   bash benchmarks/box/build_stack_site.sh [DEST=.whl/site]
# verl 0.9.1 and the modules its vLLM worker extension imports, and OpenRLHF 0.11.2's package
# tree (its wheel is tagged cp311; what the tests import is pure Python), for the box's Python 3.12
# on x86-64. About 10 MiB: carry DEST, then `PYTHONPATH=$PWD/.whl/site:$PYTHONPATH` on the box.
# Also the wheels verl's FSDP engine module imports beyond those (peft, datasets and its pyarrow
# and pandas, ...; benchmarks/verl_scorer.py), for the same Python, as one tar split into parts of
# 45 MiB: DEST/../verl_deps/verl_deps.part_NN, staged to /root/stage one call each and installed
# there by benchmarks/box/verl_deps_setup.sh. And NeMo RL's DTensor-policy pins (the end of this file).
set -euo pipefail
dest="${1:-.whl/site}"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
binary=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pip download --no-deps -q -d "$work" "${binary[@]}" \
  verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 omegaconf==2.3.0 codetiming==1.4.0 orjson==3.13.0 pylatexenc==2.11 trl==1.16.0
pip download --no-deps -q -d "$work" --no-binary antlr4-python3-runtime antlr4-python3-runtime==4.9.3 openrlhf==0.11.2
rm -rf "$dest"; mkdir -p "$dest"
for wheel in "$work"/*.whl; do python3 -m zipfile -e "$wheel" "$dest"; done
for data in "$dest"/*.data; do  # OpenRLHF's package sits in its wheel's purelib
  for lib in purelib platlib; do [ -d "$data/$lib" ] && cp -r "$data/$lib"/. "$dest"/; done
  rm -rf "$data"
done
rm -rf "$dest"/tests "$dest"/scripts  # top-level folders of some wheels: `tests` would shadow this repository's
tar -xzf "$work"/antlr4-python3-runtime-4.9.3.tar.gz -C "$work"
cp -r "$work"/antlr4-python3-runtime-4.9.3/src/antlr4 "$dest"/
du -sh "$dest"
deps="$(dirname "$dest")/verl_deps"
rm -rf "$deps"; mkdir -p "$deps" "$work/verl_deps"
pip download --no-deps -q -d "$work/verl_deps" "${binary[@]}" \
  peft==0.21.2 datasets==5.2.0 multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0 dill==0.4.1
tar -C "$work/verl_deps" -cf - . | split -b 45M -d -a 2 - "$deps/verl_deps.part_"
ls -l "$deps"
# NeMo RL's DTensor-policy pins (its uv.lock at 7ea279a; NeMo RL refuses transformers >= 5.12) with
# hydra, omegaconf and NVML's bindings, for benchmarks/stack_bitwise.py --stack nemo_rl: one
# zstd tar, DEST/../nemo_rl_site.tar.zst (about 7 MiB), unpacked on the box by xqa_box_run.sh's
# `nemo_rl` stage into /root/nemo_rl_site, which it puts first on PYTHONPATH.
site="$work/nemo_rl_site"; mkdir -p "$site" "$work/nemo_rl"
pip download --no-deps -q -d "$work/nemo_rl" "${binary[@]}" transformers==5.5.4 tokenizers==0.22.2 huggingface-hub==1.24.0 \
  hydra-core==1.3.2 omegaconf==2.3.1 nvidia-ml-py==13.610.43
for wheel in "$work"/nemo_rl/*.whl; do python3 -m zipfile -e "$wheel" "$site"; done
cp -r "$work"/antlr4-python3-runtime-4.9.3/src/antlr4 "$site"/
tar -C "$work" -cf - nemo_rl_site | zstd -q -19 -T0 -o "$(dirname "$dest")/nemo_rl_site.tar.zst" -f
ls -l "$(dirname "$dest")/nemo_rl_site.tar.zst"
