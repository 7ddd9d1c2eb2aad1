"""Bitwise at tensor parallel size 2 (two CUDA GPUs, vLLM 0.22): an `FP8Config(on_policy="bitwise")`
engine with `tensor_parallel_size=2` and an FP8 KV cache, against `BitwiseForward(...,
tensor_parallel_size=2)` on one GPU, through benchmarks/on_policy_bitwise.py (the 4-layer
Qwen3-8B shape, FP32 scales, greedy and sampled, batch sizes 1 and 7, 32 new tokens).

Every token's log-prob must be the engine's bits, and the same tokens scored as a one-GPU engine
computes them (`max_abs_dlogp_unsharded_trainer`) must not be: the ranks' BF16 partial sums are
what the sharded trainer reproduces. The full proof (batch sizes up to 512, more variants) is
the benchmark's own run, in benchmarks/results/multi_gpu/.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import on_policy_bitwise

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (tensor parallel size 2)"),
]


def test_two_rank_engine_log_probs_are_the_sharded_trainers_bits(tmp_path: Path) -> None:
    out = tmp_path / "on_policy_bitwise_tp2.json"
    code = on_policy_bitwise.main([
        "--out", str(out), "--models", "qwen3-8b-4l", "--variants", "fp8", "--kv-cache-dtypes", "fp8",
        "--batch-sizes", "1,7", "--max-tokens", "32", "--work", str(tmp_path / "work"), "--tensor-parallel-size", "2",
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0, report["failures"]
    assert report["rows"] and all(row["tensor_parallel_size"] == 2 for row in report["rows"])
    for row in report["rows"]:
        assert row["max_abs_dlogp"] == 0.0, row
        assert row["max_abs_dlogp_unsharded_trainer"] > 0.0, row
    assert all(entry["probe_logprobs_equal"] for entry in report["invariance"]), report["invariance"]
