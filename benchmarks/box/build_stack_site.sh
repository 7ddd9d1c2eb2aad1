#!/usr/bin/env bash
# The RL stacks' packages for the GPU stack-sync tests (tests/test_gpu_stack_sync.py,
# tests/test_gpu_stack_sync_tp.py), as one folder the box puts on PYTHONPATH:
#   bash benchmarks/box/build_stack_site.sh [DEST=.whl/site]
# verl 0.9.1 and the modules its vLLM worker extension imports, and OpenRLHF 0.11.2's package
# tree (its wheel is tagged cp311; what the tests import is pure Python), for the box's Python 3.12
# on x86-64. About 10 MiB: carry DEST, then `PYTHONPATH=$PWD/.whl/site:$PYTHONPATH` on the box.
set -euo pipefail
dest="${1:-.whl/site}"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
binary=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pip download --no-deps -q -d "$work" "${binary[@]}" \
  verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 omegaconf==2.3.0 codetiming==1.4.0 orjson==3.13.0 pylatexenc==2.11
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
