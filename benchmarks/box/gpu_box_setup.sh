# Source this on the GPU box from the repository root: `source benchmarks/box/gpu_box_setup.sh`.
#
# 1. Unpacks the vLLM bundle (0.22.0 by default) into /root/kit (once per bundle; needs every .gpukit part
#    already copied to /root/stage and .gpukit/{ID,bin,unpack.sh} carried in this call, or an
#    earlier call on this machine having done it).
# 2. Registers fp8_align's `vllm.general_plugins` entry point without pip: a dist-info in
#    /tmp/ep (vLLM loads plugins in its engine and worker processes from entry points only).
# 3. Exports PYTHONPATH and the vLLM settings the box needs, and writes the versions to
#    $OUT/env.txt when $OUT is set.
#    FP8_ALIGN_GPUKIT names the bundle folder (default .gpukit; e.g. .gpukit25 for a vLLM 0.25.1
#    bundle). Bundles come from `bash benchmarks/box/build_gpukit.sh VERSION`, whose VLLM_VERSION
#    file (carried with ID, bin, unpack.sh) must name the vLLM unpacked, or setup fails.
kit="${FP8_ALIGN_GPUKIT:-.gpukit}"
if [ -f "$kit/unpack.sh" ]; then
  [ -f "$kit/VLLM_VERSION" ] || { echo "gpu_box_setup: carry $kit/VLLM_VERSION (bundles come from benchmarks/box/build_gpukit.sh)"; return 1; }
  bash "$kit/unpack.sh" || return 1  # extracts only when /root/kit holds another bundle
  unpacked=$(sed -n 's/^Version: //p' /root/kit/vllm-*.dist-info/METADATA)
  [ "$unpacked" = "$(cat "$kit/VLLM_VERSION")" ] || { echo "gpu_box_setup: /root/kit holds vLLM $unpacked, $kit was built for $(cat "$kit/VLLM_VERSION")"; return 1; }
elif [ ! -f /root/kit/.complete ]; then
  echo "gpu_box_setup: /root/kit missing and $kit not carried: stage the parts first"; return 1
fi
mkdir -p /tmp/ep/fp8_align-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: fp8-align\nVersion: 0.1.0\n' > /tmp/ep/fp8_align-0.1.0.dist-info/METADATA
printf '[vllm.general_plugins]\nfp8_align = fp8_align.vllm_plugin:register\n' > /tmp/ep/fp8_align-0.1.0.dist-info/entry_points.txt
export PYTHONPATH="/root/kit:$PWD/src:/tmp/ep:$PWD"
# PYTHONFAULTHANDLER: a process that dies of a signal (an engine core in CUDA-graph capture, session 40) prints its Python stack
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
python3 - > /tmp/fp8_align_env.txt <<'EOF' || { cat /tmp/fp8_align_env.txt; return 1; }
import importlib.metadata as md, subprocess, sys, datetime
import torch, triton, transformers, vllm
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
assert "fp8_align.vllm_plugin:register" in eps, f"fp8_align entry point not visible: {eps}"
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
print(f"date_utc={datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
print(f"gpu={smi}")
print(f"python={sys.version.split()[0]} torch={torch.__version__} cuda={torch.version.cuda} triton={triton.__version__} "
      f"transformers={transformers.__version__} vllm={vllm.__version__} vllm_dist={md.version('vllm')}")
print(f"vllm.general_plugins={eps}")
EOF
cat /tmp/fp8_align_env.txt
[ -z "${OUT:-}" ] || cp /tmp/fp8_align_env.txt "$OUT/env.txt"
