"""`fp8-align prepare-deepgemm`: the shapes it compiles for and how it splits the work, and the
engine warm-up's check of the cache (CPU, DeepGEMM stood in for).

The compile itself needs an SM90 GPU and DeepGEMM: tests/test_gpu_deepgemm_cache.py runs it on the box.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fp8_align.cli import main
from fp8_align.vllm_plugin.kernels.deepgemm_cache import split_work
from fp8_align.vllm_plugin.kernels.deepgemm_inventory import LinearShape, decoder_linear_shapes, parse_shapes

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip


def test_dense_shapes_match_vllm_merged_layers() -> None:
    """qkv/o/gate_up/down as vLLM stacks them, per tensor-parallel rank."""
    assert [(s.name, s.n, s.k, s.shards) for s in decoder_linear_shapes(QWEN3_8B)] == [
        ("qkv_proj", 6144, 4096, (4096, 1024, 1024)),
        ("o_proj", 4096, 4096, (4096,)),
        ("gate_up_proj", 24576, 4096, (12288, 12288)),
        ("down_proj", 4096, 12288, (4096,)),
    ]
    tp8 = {s.name: s for s in decoder_linear_shapes(QWEN3_8B, tensor_parallel_size=8)}
    assert tp8["qkv_proj"].shards == (512, 128, 128) and tp8["down_proj"].k == 1536
    # 16 ranks over 8 KV heads: each rank holds one (replicated) KV head.
    assert decoder_linear_shapes(QWEN3_8B, tensor_parallel_size=16)[0].shards == (256, 128, 128)


def test_smollm2_shapes_that_deepgemm_cannot_take() -> None:
    """SmolLM2-135M: head dim 64 x 3 KV heads gives 192-row K/V shards, off DeepGEMM's 128 grid."""
    smol = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
    eligible = {s.name: s.runs_on_deepgemm for s in decoder_linear_shapes(smol)}
    assert eligible == {"qkv_proj": False, "o_proj": False, "gate_up_proj": False, "down_proj": False}
    assert LinearShape("x", 256, 128, (128, 128)).runs_on_deepgemm


#: Qwen3-30B-A3B's config.json fields the shapes depend on.
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip


def test_moe_shapes_are_the_attention_linears() -> None:
    """Qwen3-30B-A3B: every layer's MLP is routed experts (grouped GEMMs, not listed), so the
    linears are qkv_proj and o_proj: the 5120x2048 and 2048x4096 session 16 prepared by hand."""
    assert [(s.name, s.n, s.k, s.shards) for s in decoder_linear_shapes(QWEN3_30B_A3B)] == [
        ("qkv_proj", 5120, 2048, (4096, 512, 512)),
        ("o_proj", 2048, 4096, (2048,)),
    ]
    dense_layer = decoder_linear_shapes({**QWEN3_30B_A3B, "mlp_only_layers": [0]})
    assert [(s.name, s.n, s.k) for s in dense_layer[2:]] == [("gate_up_proj", 12288, 2048), ("down_proj", 2048, 6144)]


def test_mla_shapes_are_the_ones_vllm_built_for_moonlight() -> None:
    """Moonlight-16B-A3B's config: the [N, K] and shards of every fp8_align linear a vLLM 0.25.1
    engine of that shape logged on an H200 (session 17,
    benchmarks/logs/session17_h200_vllm025/fp8_align.log), and nothing else."""
    from benchmarks.rollout.checkpoints import MOONLIGHT_16B_A3B

    got = {(s.n, s.k, s.shards) for s in decoder_linear_shapes(MOONLIGHT_16B_A3B)}
    assert got == {
        (576, 2048, (576,)), (3072, 2048, (3072,)), (4096, 512, (4096,)), (2048, 2048, (2048,)),  # MLA
        (22528, 2048, (11264, 11264)), (2048, 11264, (2048,)),  # layer 0's dense MLP
        (5632, 2048, (2816, 2816)), (2048, 2816, (2048,)),  # the shared experts
    }  # fmt: skip
    runs = {s.name: s.runs_on_deepgemm for s in decoder_linear_shapes(MOONLIGHT_16B_A3B)}
    assert runs["kv_a_proj_with_mqa"] is False and sum(runs.values()) == 7


@pytest.mark.parametrize(
    "config, message",
    [({**QWEN3_8B, "q_lora_rank": 1536, "kv_lora_rank": 512}, "q_lora_rank"),
     ({**QWEN3_8B, "num_experts": 60, "shared_expert_intermediate_size": 5632}, "shared_expert_intermediate_size"),
     ({**QWEN3_8B, "model_type": "llama4_text", "num_local_experts": 16}, "llama4_text"),
     ({**QWEN3_8B, "model_type": "deepseek_v2", "kv_lora_rank": 512}, "deepseek_v2")],
)  # fmt: skip
def test_architectures_not_described_are_refused(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"{message}.*--shapes"):
        decoder_linear_shapes(config)


def test_tensor_parallel_that_does_not_split_is_refused() -> None:
    with pytest.raises(ValueError, match="does not split"):
        decoder_linear_shapes(QWEN3_8B, tensor_parallel_size=3)


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
    """Errors before any GPU work: neither or both sources, a config it does not describe, a missing config."""
    assert main(["prepare-deepgemm"]) == 2
    assert "one of --model and --shapes" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_8B, "q_lora_rank": 1536, "kv_lora_rank": 512}))
    assert main(["prepare-deepgemm", "--model", str(tmp_path)]) == 2
    assert "--shapes" in capsys.readouterr().err
    assert main(["prepare-deepgemm", "--model", str(tmp_path / "missing")]) == 2
    assert main(["prepare-deepgemm", "--shapes", "12x"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_refuses_to_prepare_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """Valid shapes on a machine without CUDA: exit 2 and one line, before any compile process starts."""
    assert main(["prepare-deepgemm", "--shapes", "6144x4096"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_engine_warm_up_warns_before_compiling_into_a_cold_cache_and_marks_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`DeepGemmBlockFp8Kernel.warm_up` in an engine (its config, DeepGEMM and the GPU stood in for):
    a cache without marks for the model gets one warning before the first compile, with the number
    of kernels of every cold shape of the dense model and the prepare-deepgemm command; each shape is
    marked once warmed up, so a later engine start (a new process) finds it prepared and warns not."""
    from fp8_align.vllm_plugin.kernels import deepgemm_inventory, gpu

    cache, checkpoint = (tmp_path / "dg").resolve(), tmp_path / "qwen3"
    checkpoint.mkdir()
    monkeypatch.setenv(deepgemm_inventory.JIT_CACHE_ENV_VAR, str(cache))
    engine = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(model=str(checkpoint), hf_text_config=SimpleNamespace(to_dict=lambda: QWEN3_8B)),
    )
    monkeypatch.setattr(gpu, "get_current_vllm_config_or_none", lambda: engine)
    monkeypatch.setattr(gpu, "deepgemm_warmup_m_values", lambda n, max_tokens, device: [1, 2, 4, 8][: 3 + (n == 24576)])
    monkeypatch.setattr(gpu.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    compiled: list[tuple[int, int]] = []
    monkeypatch.setattr(gpu.DeepGemmBlockFp8Kernel, "run_for_m_values", lambda self, layer, m: compiled.append(tuple(layer.weight.shape)))
    logged: dict[str, list[str]] = {"info": [], "warning": []}
    for level in logged:
        monkeypatch.setattr(gpu.logger, level, lambda message, *args, _level=level: logged[_level].append(message % args))

    def start_engine(*shapes: tuple[int, int]) -> None:
        """Warm up one layer per shape in a fresh process (no warm-ups or warnings of its own yet)."""
        monkeypatch.setattr(deepgemm_inventory, "_warmups", {})
        monkeypatch.setattr(gpu, "_COLD_CACHES_WARNED", set())
        for n, k in shapes:
            gpu.DeepGemmBlockFp8Kernel().warm_up(SimpleNamespace(weight=torch.empty(n, k, device="meta")))

    start_engine((6144, 4096), (6144, 4096), (4096, 4096))
    assert compiled == [(6144, 4096), (4096, 4096)]  # once per shape
    assert logged["warning"] == [
        f"fp8_align: DeepGEMM's JIT cache {cache} is not marked prepared for this engine (4 layer shapes: N=6144 K=4096, "
        "N=4096 K=4096, N=24576 K=4096, N=4096 K=12288, up to 256 batched tokens): this start compiles up to 13 DeepGEMM "
        "kernels one after another (~0.8 s each on an H100, ~0 min) before the engine serves. DeepGEMM stays the GEMM. Next time, "
        "fill the cache ahead in parallel (once per GPU model and vLLM version): `fp8-align prepare-deepgemm --model "
        f"{checkpoint} --cache-dir {cache} --max-num-batched-tokens 256` and start the engine with DG_JIT_CACHE_DIR={cache}"
    ]
    assert [w.prepared for w in deepgemm_inventory.warmups()] == [False, False]
    assert logged["info"][0].startswith("fp8_align: DeepGEMM warm-up N=6144 K=4096: 3 M values in ") and logged["info"][0].endswith("(not marked prepared: compiled where missing)")

    logged["warning"].clear()
    start_engine((6144, 4096), (4096, 4096))
    assert logged["warning"] == [] and [w.prepared for w in deepgemm_inventory.warmups()] == [True, True]
    assert logged["info"][-1].endswith("(JIT cache marked prepared)")
