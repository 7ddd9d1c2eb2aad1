"""Lab step on the GPU box (vLLM 0.25+, FlashInfer JIT on): compile FlashInfer's modules once, before
the rollout's engines start, so that no engine's start time holds a FlashInfer compile.

    python3 benchmarks/box/flashinfer_warm.py      (after benchmarks/box/xqa_box_run.sh setup, FLASHINFER_JIT=1)

The tiny Qwen3 of `tiny_qwen3.py` (Qwen3-8B's attention geometry) in
vLLM's online block FP8 (quantization="fp8_per_block", VLLM_USE_DEEP_GEMM=1 as the `_dg` variants)
with an FP8 KV cache on attention_backend="FLASHINFER": prefill and XQA decode modules, and the
block-scale FP8 GEMM vLLM sends small M to. They land in FlashInfer's JIT cache
(~/.cache/flashinfer), which every engine of the box reads. Prints the seconds this took.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ["VLLM_USE_DEEP_GEMM"] = "1"
os.environ.setdefault("DG_JIT_CACHE_DIR", "/root/dg_flashinfer_warm")

from vllm import LLM, SamplingParams  # noqa: E402

from benchmarks.box.tiny_qwen3 import save_tiny_qwen3  # noqa: E402

MODEL = Path("/tmp/qwen3_tiny_flashinfer_warm")


def main() -> None:
    model = save_tiny_qwen3(MODEL)
    start = time.perf_counter()
    llm = LLM(model=str(model), quantization="fp8_per_block", kv_cache_dtype="fp8", attention_backend="FLASHINFER",
              dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=16, gpu_memory_utilization=0.3, seed=0)  # fmt: skip
    out = llm.generate([{"prompt_token_ids": list(range(1, 25))}] * 4, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    print(f"FlashInfer warm: engine start + generate {time.perf_counter() - start:.1f} s, {len(out[0].outputs[0].token_ids)} tokens", flush=True)


if __name__ == "__main__":
    main()
