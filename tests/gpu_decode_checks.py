"""Shared by the GPU decode tests (tests/test_gpu_xqa.py, tests/test_gpu_flashinfer_scales.py): a
small Qwen3 with Qwen3-8B's attention geometry, its engine settings, and greedy decode log-probs
compared between two engines."""

from __future__ import annotations

from typing import Any

import torch

#: A small Qwen3 with the Qwen3-8B attention geometry (head dim 128, 4 query heads per KV head):
#: the XQA module prebuilt for 128:4:16 serves it.
XQA_ENGINE_MODEL = dict(
    hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
    head_dim=128, vocab_size=4096, max_position_embeddings=512,
)  # fmt: skip
ENGINE_KWARGS = {"gpu_memory_utilization": 0.25, "max_model_len": 256, "seed": 0, "dtype": "bfloat16", "enable_prefix_caching": False}


def logprob_rows(results: list[Any]) -> tuple[list[list[int]], list[list[float]]]:
    """Token ids and the sampled tokens' log-probs per request of a `vllm.LLM.generate` result."""
    tokens = [list(r.outputs[0].token_ids) for r in results]
    logprobs = [[step[t].logprob for t, step in zip(toks, r.outputs[0].logprobs)] for toks, r in zip(tokens, results)]
    return tokens, logprobs


def decode_diffs(tokens: list[list[int]], logprobs: list[list[float]], reference: list[dict]) -> torch.Tensor:
    """|dlogp| of decode tokens (position >= 1) against `reference` rows, up to the first token where
    the greedy paths part (after that the two engines see different contexts)."""
    diffs = []
    for row, (toks, lps) in enumerate(zip(tokens, logprobs)):
        for t in range(1, len(toks)):
            if toks[: t + 1] != reference[row]["token_ids"][: t + 1]:
                break
            diffs.append(abs(lps[t] - reference[row]["logprobs"][t]))
    return torch.tensor(diffs)
