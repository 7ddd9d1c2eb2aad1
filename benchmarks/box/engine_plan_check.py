"""Lab check on the GPU box (issue #26, fast by default): start a tiny Qwen3-shaped fp8_align engine
with an FP8 KV cache and no other setting, and print what `vllm_plugin.engine_plan` chose
(its INFO line goes to the engine log) and how many decode steps went to XQA.

    python3 benchmarks/box/engine_plan_check.py      (after benchmarks/box/xqa_box_run.sh setup)
"""

from __future__ import annotations

from pathlib import Path

from vllm import LLM, SamplingParams

from benchmarks.box.tiny_qwen3 import save_tiny_qwen3
from fp8_align.vllm_plugin.kv import xqa_decode

MODEL = Path("/tmp/qwen3_tiny")


def main() -> None:
    llm = LLM(model=str(save_tiny_qwen3(MODEL)), quantization="fp8_align", kv_cache_dtype="fp8", dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=256, max_num_batched_tokens=128, max_num_seqs=16, gpu_memory_utilization=0.3, seed=0)  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(1, 25))}] * 4, params, use_tqdm=False)
    print("XQA decode calls:", xqa_decode.decode_calls, "tokens:", len(out[0].outputs[0].token_ids), flush=True)


if __name__ == "__main__":
    main()
