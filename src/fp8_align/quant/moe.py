"""Block FP8 for routed experts: per-expert, per-shard weight quantization and the MoE forward.

Layout (vLLM's fused-MoE layout): `w13` [E, 2I, H] holds each expert's gate rows [0, I) then its
up rows [I, 2I); `w2` [E, H, I] its down projection. Each of gate, up and down is quantized with
its own 128x128 grid, exactly as the checkpoint's separate `gate_proj`/`up_proj`/`down_proj`
tensors are, so the scales are `s13` [E, 2 ceil(I/128), ceil(H/128)] (gate grid rows, then up
grid rows) and `s2` [E, ceil(H/128), ceil(I/128)], float32. When I is a multiple of 128 this is
the single [2I/128, H/128] grid per expert that vLLM's block-FP8 MoE kernels index.

`block_fp8_moe_reference` is the recipe's forward for one MoE layer: the oracle for the CPU
custom op and the GPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8_align.quant.blockwise import DEFAULT_BLOCK_SIZE
from fp8_align.quant.dispatch import quantize_weights_into
from fp8_align.quant.groupwise import quantize_activation_groupwise
from fp8_align.quant.linear import fp8_block_gemm
from fp8_align.rounding import DEFAULT_SCALE_RULE
from fp8_align.quant.scales import FP8_DTYPE

#: Shard names of one expert, in vLLM's loader terms: gate (w1), up (w3), down (w2).
EXPERT_SHARDS = ("w1", "w3", "w2")


def _blocks(size: int) -> int:
    return -(-size // DEFAULT_BLOCK_SIZE[0])


@dataclass(frozen=True)
class ExpertShardRows:
    """Where one shard of one expert lives: `param` ("w13" or "w2"), rows of that expert's codes
    and rows of its scale grid."""

    param: str
    rows: slice
    scale_rows: slice


def expert_shard_rows(shard: str, intermediate_size: int, hidden_size: int) -> ExpertShardRows:
    """Rows of shard `shard` ("w1" gate, "w3" up, "w2" down) within one expert's `w13`/`w2`
    codes and scales, for per-partition intermediate size I and hidden size H."""
    if shard == "w1":
        return ExpertShardRows("w13", slice(0, intermediate_size), slice(0, _blocks(intermediate_size)))
    if shard == "w3":
        blocks = _blocks(intermediate_size)
        return ExpertShardRows("w13", slice(intermediate_size, 2 * intermediate_size), slice(blocks, 2 * blocks))
    if shard == "w2":
        return ExpertShardRows("w2", slice(0, hidden_size), slice(0, _blocks(hidden_size)))
    raise ValueError(f"expert shard must be one of {EXPERT_SHARDS}, got {shard!r}")


def expert_scale_shapes(num_experts: int, intermediate_size: int, hidden_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of `s13` and `s2` (see the module docstring)."""
    return (
        (num_experts, 2 * _blocks(intermediate_size), _blocks(hidden_size)),
        (num_experts, _blocks(hidden_size), _blocks(intermediate_size)),
    )


def quantize_experts_into(
    w13: torch.Tensor,
    w2: torch.Tensor,
    c13: torch.Tensor,
    s13: torch.Tensor,
    c2: torch.Tensor,
    s2: torch.Tensor,
    pow2_scale: bool,
    experts: list[int] | None = None,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> None:
    """Quantize BF16 experts shard by shard into existing codes and scales.

    w13 [E, 2I, H] and w2 [E, H, I] (bf16/fp16/fp32, finite); c13/c2 the same shapes in
    float8_e4m3fn; s13/s2 float32 as `expert_scale_shapes`. `experts`: the expert indices to
    write (default all). `scale_rule`: see `fp8_align.quant.scales`. One grouped launch on CUDA
    (`quantize_weights_into`).
    """
    intermediate, hidden = w2.shape[2], w2.shape[1]
    weights, codes, scales = [], [], []
    for e in range(w13.shape[0]) if experts is None else experts:
        for shard in EXPERT_SHARDS:
            where = expert_shard_rows(shard, intermediate, hidden)
            src, dst, dst_scale = (w13, c13, s13) if where.param == "w13" else (w2, c2, s2)
            weights.append(src[e, where.rows])
            codes.append(dst[e, where.rows])
            scales.append(dst_scale[e, where.scale_rows])
    quantize_weights_into(weights, codes, scales, pow2_scale, scale_rule)


def quantize_experts(
    w13: torch.Tensor, w2: torch.Tensor, pow2_scale: bool, scale_rule: str = DEFAULT_SCALE_RULE
) -> tuple[torch.Tensor, ...]:
    """(c13, s13, c2, s2) of BF16 experts w13 [E, 2I, H], w2 [E, H, I] (see `quantize_experts_into`)."""
    num_experts, hidden, intermediate = w2.shape
    s13_shape, s2_shape = expert_scale_shapes(num_experts, intermediate, hidden)
    c13 = torch.empty(w13.shape, dtype=FP8_DTYPE, device=w13.device)
    c2 = torch.empty(w2.shape, dtype=FP8_DTYPE, device=w2.device)
    s13 = torch.empty(s13_shape, dtype=torch.float32, device=w13.device)
    s2 = torch.empty(s2_shape, dtype=torch.float32, device=w2.device)
    quantize_experts_into(w13, w2, c13, s13, c2, s2, pow2_scale, scale_rule=scale_rule)
    return c13, s13, c2, s2


def block_fp8_moe_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    c13: torch.Tensor,
    s13: torch.Tensor,
    c2: torch.Tensor,
    s2: torch.Tensor,
    act_pow2: bool,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> torch.Tensor:
    """One MoE layer's routed experts in block FP8 (SiLU-gated MLP experts).

    x [T, H] bf16/fp16; topk_weights [T, k] (any float; used in FP32); topk_ids [T, k] integer
    local expert ids (negative: not on this rank, skipped); c13/s13/c2/s2 as `quantize_experts`
    (float8 codes, or float32 holding exactly those values). Per expert: its tokens' activations
    quantized in 1x128 groups; gate and up GEMMs (`fp8_block_gemm`, FP32 accumulation) rounded
    to x.dtype; silu(gate) * up in FP32 rounded to x.dtype, quantized again in 1x128 groups; the
    down GEMM rounded to x.dtype; weighted by the token's routing weight and summed over its k
    experts in FP32. Activation scales follow `act_pow2` and `scale_rule` (`fp8_align.quant.scales`).
    Returns [T, H] in x.dtype.
    """
    intermediate, hidden = c2.shape[2], c2.shape[1]
    gate, up = expert_shard_rows("w1", intermediate, hidden), expert_shard_rows("w3", intermediate, hidden)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        x_fp8, x_scale = quantize_activation_groupwise(
            x[tokens], pow2_scale=act_pow2, check_inputs=False, scale_rule=scale_rule
        )
        g = fp8_block_gemm(x_fp8, x_scale, c13[e, gate.rows], s13[e, gate.scale_rows], out_dtype=x.dtype)
        u = fp8_block_gemm(x_fp8, x_scale, c13[e, up.rows], s13[e, up.scale_rows], out_dtype=x.dtype)
        h = (torch.nn.functional.silu(g.float()) * u.float()).to(x.dtype)
        h_fp8, h_scale = quantize_activation_groupwise(h, pow2_scale=act_pow2, check_inputs=False, scale_rule=scale_rule)
        y = fp8_block_gemm(h_fp8, h_scale, c2[e], s2[e], out_dtype=x.dtype)
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots].float()[:, None])
    return out.to(x.dtype)
