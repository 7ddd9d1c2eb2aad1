"""`fp8-align prepare-deepgemm`: the shapes it compiles for and how it splits the work (CPU).

The compile itself needs an SM90 GPU and DeepGEMM: tests/test_gpu_kernels.py runs it on the box.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8_align.cli import main
from fp8_align.vllm_plugin.kernels.deepgemm_cache import LinearShape, dense_linear_shapes, parse_shapes, split_work

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip


def test_dense_shapes_match_vllm_merged_layers() -> None:
    """qkv/o/gate_up/down as vLLM stacks them, per tensor-parallel rank."""
    assert [(s.name, s.n, s.k, s.shards) for s in dense_linear_shapes(QWEN3_8B)] == [
        ("qkv_proj", 6144, 4096, (4096, 1024, 1024)),
        ("o_proj", 4096, 4096, (4096,)),
        ("gate_up_proj", 24576, 4096, (12288, 12288)),
        ("down_proj", 4096, 12288, (4096,)),
    ]
    tp8 = {s.name: s for s in dense_linear_shapes(QWEN3_8B, tensor_parallel_size=8)}
    assert tp8["qkv_proj"].shards == (512, 128, 128) and tp8["down_proj"].k == 1536
    # 16 ranks over 8 KV heads: each rank holds one (replicated) KV head.
    assert dense_linear_shapes(QWEN3_8B, tensor_parallel_size=16)[0].shards == (256, 128, 128)


def test_smollm2_shapes_that_deepgemm_cannot_take() -> None:
    """SmolLM2-135M: head dim 64 x 3 KV heads gives 192-row K/V shards, off DeepGEMM's 128 grid."""
    smol = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
    eligible = {s.name: s.runs_on_deepgemm for s in dense_linear_shapes(smol)}
    assert eligible == {"qkv_proj": False, "o_proj": False, "gate_up_proj": False, "down_proj": False}
    assert LinearShape("x", 256, 128, (128, 128)).runs_on_deepgemm


@pytest.mark.parametrize(
    "config, message",
    [({**QWEN3_8B, "num_experts": 128}, "num_experts"), ({**QWEN3_8B, "kv_lora_rank": 512}, "kv_lora_rank")],
)
def test_moe_and_mla_configs_are_refused(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dense_linear_shapes(config)


def test_tensor_parallel_that_does_not_split_is_refused() -> None:
    with pytest.raises(ValueError, match="does not split"):
        dense_linear_shapes(QWEN3_8B, tensor_parallel_size=3)


def test_parse_shapes() -> None:
    assert [(s.n, s.k) for s in parse_shapes("6144x4096, 4096X12288")] == [(6144, 4096), (4096, 12288)]
    for bad in ("6144", "ax4096", ""):
        with pytest.raises(ValueError):
            parse_shapes(bad)


def test_split_work_deals_every_m_once() -> None:
    m_values = {(6144, 4096): list(range(1, 11)), (4096, 4096): [1, 2, 3]}
    parts = split_work(m_values, 4)
    assert len(parts) == 4
    dealt = sorted((shape, m) for part in parts for shape, values in part.items() for m in values)
    assert dealt == sorted([("6144x4096", m) for m in range(1, 11)] + [("4096x4096", m) for m in (1, 2, 3)])
    assert max(map(lambda p: sum(map(len, p.values())), parts)) - min(map(lambda p: sum(map(len, p.values())), parts)) <= 1
    assert len(split_work({(1, 1): [1]}, 8)) == 1  # no idle workers


def test_cli_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Errors before any GPU work: neither or both sources, an MoE config, a missing config."""
    assert main(["prepare-deepgemm"]) == 2
    assert "one of --model and --shapes" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_8B, "num_experts": 8}))
    assert main(["prepare-deepgemm", "--model", str(tmp_path)]) == 2
    assert "--shapes" in capsys.readouterr().err
    assert main(["prepare-deepgemm", "--model", str(tmp_path / "missing")]) == 2
    assert main(["prepare-deepgemm", "--shapes", "12x"]) == 2
