"""What each tensor-parallel rank should hold: the reference quantization of its slice of the HF weights."""

from __future__ import annotations

import torch

from fp8_align.quant import quantize_weight_blockwise

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
