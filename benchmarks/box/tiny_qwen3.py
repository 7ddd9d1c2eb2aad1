"""The tiny Qwen3 of the box's engine checks (engine_plan_check.py, flashinfer_warm.py): Qwen3-8B's
attention geometry (head dim 128, 4 query heads per KV head) in two layers of hidden size 1024."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def save_tiny_qwen3(path: Path) -> Path:
    """Write the model's random BF16 checkpoint (seed 0) to `path` unless it is there; returns `path`."""
    if not path.exists():
        torch.manual_seed(0)
        config = Qwen3Config(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=16,
                             num_key_value_heads=4, head_dim=128, vocab_size=4096, max_position_embeddings=512)  # fmt: skip
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path
