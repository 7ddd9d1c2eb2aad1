"""Dynamic activation quantization: one scale per token per 128 input channels (1x128 groups),
or, transposed, one scale per channel per 128 tokens (the operands of a weight-gradient product)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fp8_align.rounding import DEFAULT_SCALE_RULE
from fp8_align.quant.scales import check_finite, check_float_input, quantization_factors, quantize_with_factor

DEFAULT_GROUP_SIZE = 128


def quantize_activation_groupwise(
    x: torch.Tensor,
    group_size: int = DEFAULT_GROUP_SIZE,
    pow2_scale: bool = False,
    check_inputs: bool = True,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to E4M3 in 1 x `group_size` groups along the last dim.

    Args:
        x: [..., K] bf16/fp16/fp32, any leading shape, any device.
        group_size: channels per group; the last group is partial when K is not a multiple.
        pow2_scale: power-of-two scales (rounded as `scale_rule` says).
        check_inputs: validate dtype and finiteness (costs a device sync on GPU).
        scale_rule: "amax_over_max" or "transformer_engine" (`fp8_align.quant.scales`).
    Returns:
        (x_fp8 [..., K] float8_e4m3fn, scale [..., ceil(K / group_size)] float32) with
        `x ~= x_fp8 * scale` per group; `scale = amax(|group|) / 448` (or its pow2 round-up), or
        `1 / fl(448 / amax)` under "transformer_engine".
    """
    if check_inputs:
        check_float_input(x, "activation")
        check_finite(x, "activation")
        if group_size <= 0:
            raise ValueError(f"group_size must be positive, got {group_size}")
    k = x.shape[-1]
    groups = math.ceil(k / group_size)
    padded = F.pad(x.to(torch.float32), (0, groups * group_size - k))
    grouped = padded.view(*x.shape[:-1], groups, group_size)
    factor, scale = quantization_factors(grouped.abs().amax(dim=-1), pow2_scale, scale_rule, x.dtype)
    codes = quantize_with_factor(grouped, factor.unsqueeze(-1), scale_rule)
    return codes.view(*x.shape[:-1], groups * group_size)[..., :k].contiguous(), scale


def dequantize_groupwise(
    x_fp8: torch.Tensor,
    scale: torch.Tensor,
    group_size: int = DEFAULT_GROUP_SIZE,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of `quantize_activation_groupwise`: [..., K] codes times their group's scale."""
    k = x_fp8.shape[-1]
    expected = (*x_fp8.shape[:-1], math.ceil(k / group_size))
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match codes {tuple(x_fp8.shape)}: expected {expected}")
    full = scale.to(torch.float32).repeat_interleave(group_size, dim=-1)[..., :k]
    return (x_fp8.to(torch.float32) * full).to(dtype)


def quantize_activation_transposed(
    x: torch.Tensor, pow2_scale: bool = False, scale_rule: str = DEFAULT_SCALE_RULE
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized along its tokens: `quantize_activation_groupwise` of x.T [K, M_pad], the
    tokens padded with zero rows to M_pad = 128 * ceil(M / 128), so every group is 128 whole tokens.

    Returns (codes [K, M_pad] float8_e4m3fn, scales [K, M_pad / 128] float32). No input checks
    (the caller's tensors are finite gradients and activations).
    """
    padded = F.pad(x, (0, 0, 0, -x.shape[0] % DEFAULT_GROUP_SIZE))
    return quantize_activation_groupwise(padded.t().contiguous(), pow2_scale=pow2_scale, check_inputs=False, scale_rule=scale_rule)
