#!/usr/bin/env bash
# Build the vLLM bundle for the GPU box, of the release asked for, ready to stage:
#   bash benchmarks/box/build_gpukit.sh 0.22.0 [DEST=.gpukit] [EXTRA_REQ...]   # e.g. .gpukit_ray ray==2.60.0
#   bash benchmarks/box/build_gpukit.sh 0.25.1 [DEST=.gpukit25] [EXTRA_REQ...]   # e.g. ray==2.60.0
#   bash benchmarks/box/build_gpukit.sh 0.33.0 [DEST=.gpukit33]   # torch 2.14.0 inside: about 1.5 GB, ~30 staging calls
# Runs ../shared/gpu-kit/build.sh with a wheel cache of this release's own (~/.cache/gpukit-VERSION):
# build.sh takes the newest wheel of each name in its cache, so one cache shared by two lists
# builds the newer release's bundle for both (session 17's "0.22" bundle was vLLM 0.25.1). Then
# re-splits the parts to 45 MiB (one part and the ~7 MiB working tree fit a 64 MiB call), checks
# the vLLM inside the parts, and writes DEST/VLLM_VERSION, which gpu_box_setup.sh compares with
# the vLLM it unpacks (carry it with ID, bin and unpack.sh).
set -euo pipefail
version="${1:?usage: build_gpukit.sh VLLM_VERSION [DEST] [EXTRA_REQ...]}"
case "$version" in
  0.22.0) list=../shared/gpu-kit/vllm-0.22.0.txt; default_dest=.gpukit ;;
  0.25.1) list=benchmarks/box/gpukit/vllm-0.25.1.txt; default_dest=.gpukit25 ;;
  0.33.0) list=benchmarks/box/gpukit/vllm-0.33.0.txt; default_dest=.gpukit33 ;;
  *) echo "build_gpukit.sh: no package list for vLLM $version (0.22.0, 0.25.1, 0.33.0)" >&2; exit 2 ;;
esac
dest="${2:-$default_dest}"; shift $(( $# > 2 ? 2 : $# ))
GPUKIT_CACHE="$HOME/.cache/gpukit-$version" bash ../shared/gpu-kit/build.sh "$dest" "$list" "$@" > /dev/null
cat "$dest"/part_* > "$dest/bundle" && rm "$dest"/part_* && split -b 45m -d "$dest/bundle" "$dest/part_"
inside=$(zstd -d -q < "$dest/bundle" | tar -t | sed -n 's|^kit/vllm-\([^/]*\)\.dist-info/.*|\1|p' | sort -u)
rm "$dest/bundle"
[ "$inside" = "$version" ] || { echo "build_gpukit.sh: $dest holds vLLM '$inside', not $version" >&2; exit 1; }
echo "$version" > "$dest/VLLM_VERSION"
ls -l "$dest" | sed 1d
