"""`make_bitwise` on the GPU (CUDA, vLLM 0.22): an HF model converted in place, scored through its
own forward (benchmarks/on_policy_bitwise.py --make-bitwise, `ConvertedModel`), against a bitwise
engine's log-probs: SmolLM2 and the 4-layer Qwen3-8B shape, FP8 FP32 scales, an FP8 KV cache,
greedy and sampled at T = 1, batch sizes 1 and 7, 32 new tokens. Every token's log-prob must be
the engine's bits, through `BitwiseForward` and through the converted model alike. The full proof
(batch sizes up to 512, more variants, tensor parallel size 2) is the benchmark's own run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import on_policy_bitwise

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_converted_models_log_probs_are_the_engines_bits(tmp_path: Path) -> None:
    out = tmp_path / "on_policy_bitwise_make_bitwise.json"
    code = on_policy_bitwise.main([
        "--out", str(out), "--models", "smollm2,qwen3-8b-4l", "--variants", "fp8", "--kv-cache-dtypes", "fp8",
        "--batch-sizes", "1,7", "--max-tokens", "32", "--work", str(tmp_path / "work"), "--make-bitwise",
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0, report["failures"]
    assert len(report["rows"]) == 8
    for row in report["rows"]:
        assert row["max_abs_dlogp"] == 0.0, row
        assert row["max_abs_dlogp_make_bitwise"] == 0.0, row
