# Source on the GPU box from the repository root after benchmarks/box/gpu_box_setup.sh:
#   source benchmarks/box/gpu_model_setup.sh
# Reassembles SmolLM2-135M-Instruct (BF16) from the parts benchmarks/box/pack_smollm2_for_box.sh made:
# smol.zst.part_NN copied to /root/stage by earlier calls on this machine (or carried in this one
# under .gpumodel/), .gpumodel/{meta.tar,model.sha256} and the bundle's zstd (.gpukit/bin)
# carried in this call. Checks the sha256 and exports FP8_ALIGN_CACHE so that
# `fp8_align.error_bench.default_model.smollm2_checkpoint()` finds the checkpoint.
export FP8_ALIGN_CACHE=/root/fp8_align_cache
_kit="${FP8_ALIGN_GPUKIT:-.gpukit}"
_target="$FP8_ALIGN_CACHE/smollm2-135m-instruct-bf16"
if [ ! -f "$_target/fp8_align_converted.json" ]; then
  mkdir -p /root/stage "$_target"
  cp .gpumodel/smol.zst.part_* /root/stage/ 2>/dev/null || true
  cat /root/stage/smol.zst.part_* | LD_LIBRARY_PATH="$_kit/bin:${LD_LIBRARY_PATH:-}" "$_kit/bin/zstd" -d -q -f -o "$_target/model.safetensors" || return 1
  _got=$(sha256sum "$_target/model.safetensors" | cut -c1-64)
  if [ "$_got" != "$(cat .gpumodel/model.sha256)" ]; then
    echo "gpu_model_setup: sha256 mismatch ($_got): copy every smol.zst.part_NN to /root/stage"; rm -rf "$_target"; return 1
  fi
  tar -C "$_target" -xf .gpumodel/meta.tar || return 1
fi
echo "SmolLM2-135M-Instruct BF16 ready in $_target"
