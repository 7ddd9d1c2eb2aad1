"""Weight quantization on whatever device the weight lives: the fast exact kernel where one exists."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fp8_align.quant.blockwise import quantize_weight_blockwise
from fp8_align.rounding import DEFAULT_SCALE_RULE


def quantize_weight_into(
    w: torch.Tensor,
    pow2_scale: bool,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    check_finite: bool = True,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_weight_blockwise(w, pow2_scale=pow2_scale, scale_rule=scale_rule)` (128x128 blocks),
    optionally written into existing storage.

    w: [N, K] bf16/fp16/fp32. out_codes: [N, K] float8_e4m3fn, out_scales: [ceil(N/128),
    ceil(K/128)] float32, on w's device (views into larger tensors are fine). On CUDA the Triton
    kernel (`triton_blockwise`) runs and writes the outputs directly; elsewhere the torch
    reference runs and its result is copied in. Both give the same bits. check_finite=False skips
    the NaN/Inf check for a caller that validated `w` already.
    Returns (codes, scales): the out tensors when given.
    """
    if w.is_cuda:
        # imported here: Triton is needed on CUDA only (CPU-only installs have none)
        from fp8_align.quant.triton_blockwise import quantize_weight_blockwise_triton

        return quantize_weight_blockwise_triton(w, pow2_scale, out_codes, out_scales, check_finite, scale_rule)
    codes, scales = quantize_weight_blockwise(w, pow2_scale=pow2_scale, scale_rule=scale_rule)
    if out_codes is not None:
        codes = out_codes.copy_(codes)
    if out_scales is not None:
        scales = out_scales.copy_(scales)
    return codes, scales


def quantize_weights_into(
    weights: Sequence[torch.Tensor],
    out_codes: Sequence[torch.Tensor],
    out_scales: Sequence[torch.Tensor],
    pow2_scale: bool,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> None:
    """`quantize_weight_into(w, pow2_scale, codes, scales, False, scale_rule)` for each triple of the
    lists: on CUDA one grouped Triton launch (`triton_blockwise.quantize_weights_blockwise_triton`,
    all weights on one device), elsewhere one reference call per weight. Same bits either way.
    The caller has validated the inputs (finite).
    """
    if not (len(weights) == len(out_codes) == len(out_scales)):
        raise ValueError(f"got {len(weights)} weights, {len(out_codes)} code and {len(out_scales)} scale outputs")
    if weights and weights[0].is_cuda:
        # imported here: Triton is needed on CUDA only
        from fp8_align.quant.triton_blockwise import quantize_weights_blockwise_triton

        quantize_weights_blockwise_triton(weights, out_codes, out_scales, pow2_scale, scale_rule)
        return
    for w, codes, scales in zip(weights, out_codes, out_scales):
        quantize_weight_into(w, pow2_scale, codes, scales, check_finite=False, scale_rule=scale_rule)
