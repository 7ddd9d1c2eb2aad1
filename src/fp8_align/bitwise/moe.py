"""The routed experts of a bitwise Mixture-of-Experts layer (Qwen3-MoE), composed of the bitwise ops.

`moe_experts` takes the routing (`torch.ops.fp8_align.bitwise_moe_route`) and computes each
(token, slot) pair's SiLU-gated block-FP8 expert MLP, then the weighted sum over the slots. The
pairs are sorted by expert for the grouped GEMMs, but on CUDA every pair's bits depend on its
token's activations and its expert alone: a token gets the same output in any batch (on CPU, up to
torch's matmul, see `moe_reference`).
"""

from __future__ import annotations

import torch

import fp8_align.bitwise.ops  # noqa: F401  (registers torch.ops.fp8_align.bitwise_*)
from fp8_align.bitwise.moe_reference import INDEX_DTYPES, OUTPUT_DTYPES
from fp8_align.quant import DEFAULT_BLOCK_SIZE, FP8_DTYPE, quantize_activation_groupwise
from fp8_align.rounding import DEFAULT_SCALE_RULE

try:
    from fp8_align.quant.triton_groupwise import ScaleLayout  # registers torch.ops.fp8_align.quantize_activation_groupwise
except ImportError:  # CPU builds of torch come without Triton; there activations are quantized in torch
    ScaleLayout = None  # type: ignore[assignment,misc]


def quantize_rows(x: torch.Tensor, pow2_scales: bool, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp16/fp32 -> (codes [M, K] e4m3, scales [M, ceil(K/128)] float32), 1x128 groups
    per row, as the dense bitwise linear quantizes: the Triton quantizer op on CUDA, its pure-torch
    twin (the same bits) elsewhere."""
    if x.device.type != "cuda":
        return quantize_activation_groupwise(x, pow2_scale=pow2_scales, check_inputs=False, scale_rule=scale_rule)
    if ScaleLayout is None:
        raise RuntimeError("fp8_align's bitwise MoE needs Triton on CUDA; install the triton that matches torch")
    return torch.ops.fp8_align.quantize_activation_groupwise(x, pow2_scales, int(ScaleLayout.ROW_MAJOR), scale_rule)


def _check_expert_inputs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Raise ValueError unless the operands have `moe_experts`' shapes and dtypes (the grouped GEMMs check the rest)."""
    if x.dim() != 2 or x.dtype not in OUTPUT_DTYPES:
        raise ValueError(f"x must be [T, H] bf16/fp16/fp32, got shape {tuple(x.shape)} dtype {x.dtype}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"ids must be [{x.shape[0]}, K] int32/int64 (x's T tokens), got shape {tuple(ids.shape)} dtype {ids.dtype}")
    if tuple(weights.shape) != tuple(ids.shape) or weights.dtype != torch.float32:
        raise ValueError(f"weights must be {list(ids.shape)} float32 (ids' shape), got shape {tuple(weights.shape)} dtype {weights.dtype}")
    if w13.dim() != 3 or w2.dim() != 3 or w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"w13 [E, 2I, H] and w2 [E, H, I] must be float8_e4m3fn, got {tuple(w13.shape)} {w13.dtype} and {tuple(w2.shape)} {w2.dtype}")
    experts, hidden, intermediate = w2.shape
    if tuple(w13.shape) != (experts, 2 * intermediate, hidden) or hidden != x.shape[1]:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2I, H] and [E, H, I] with H = {x.shape[1]} (x's)")
    if intermediate % DEFAULT_BLOCK_SIZE[0]:
        raise ValueError(
            f"the bitwise MoE takes experts whose intermediate size is a multiple of {DEFAULT_BLOCK_SIZE[0]} (got {intermediate}): "
            "the grouped GEMM reads w13's gate and up grids as one stacked grid"
        )


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    pow2_scales: bool,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> torch.Tensor:
    """x [T, H] bf16/fp16/fp32, routing weights [T, K] float32 and expert ids [T, K] int32/int64
    in [0, E) (distinct per token; not checked, that would sync), gate|up w13 [E, 2I, H] e4m3 with
    w13_scale [E, 2I/128, ceil(H/128)] float32 (I a multiple of 128: gate's grid rows, then up's,
    as `fp8_align.quant.moe.quantize_experts` writes them), down w2 [E, H, I] e4m3 with w2_scale
    [E, ceil(H/128), ceil(I/128)] float32 -> [T, H] in x's dtype.

    Per (token, slot): the token's activations quantized per 128 channels (`quantize_rows` with
    `pow2_scales` and `scale_rule`), the gate|up GEMM rounded to x's dtype, SiLU-and-mul, quantized
    again, the down GEMM rounded to x's dtype; then `bitwise_moe_combine` over the slots in order.
    The pairs are stable-sorted by expert for the two `bitwise_grouped_block_fp8_mm` calls.
    ValueError on bad shapes or dtypes, or I not a multiple of 128.
    """
    _check_expert_inputs(x, weights, ids, w13, w2)
    tokens, top_k = ids.shape
    x_fp8, x_scale = quantize_rows(x.contiguous(), pow2_scales, scale_rule)
    sorted_ids, pair_order = torch.sort(ids.reshape(-1), stable=True)
    expert_offsets = torch.searchsorted(sorted_ids, torch.arange(w13.shape[0] + 1, dtype=sorted_ids.dtype, device=ids.device))
    pair_tokens = pair_order // top_k
    gate_up = torch.ops.fp8_align.bitwise_grouped_block_fp8_mm(x_fp8[pair_tokens], x_scale[pair_tokens], w13, w13_scale, expert_offsets, x.dtype)
    hidden_fp8, hidden_scale = quantize_rows(torch.ops.fp8_align.bitwise_silu_and_mul(gate_up), pow2_scales, scale_rule)
    down = torch.ops.fp8_align.bitwise_grouped_block_fp8_mm(hidden_fp8, hidden_scale, w2, w2_scale, expert_offsets, x.dtype)
    per_slot = torch.empty_like(down).index_copy_(0, pair_order, down)
    return torch.ops.fp8_align.bitwise_moe_combine(per_slot.view(tokens, top_k, x.shape[1]), weights)
