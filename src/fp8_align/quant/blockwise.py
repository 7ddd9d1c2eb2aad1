"""Weight quantization with one scale per 128x128 block (the DeepSeek-V3 / NeMo RL recipe)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fp8_align.rounding import DEFAULT_SCALE_RULE
from fp8_align.quant.scales import check_finite, check_float_input, quantization_factors, quantize_with_factor

DEFAULT_BLOCK_SIZE = (128, 128)


def blockwise_scale_shape(weight_shape: tuple[int, int], block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> tuple[int, int]:
    """Shape of the block scales of an [N, K] weight: (ceil(N / bn), ceil(K / bk))."""
    (n, k), (bn, bk) = weight_shape, block_size
    return math.ceil(n / bn), math.ceil(k / bk)


def quantize_weight_blockwise(
    w: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    pow2_scale: bool = False,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to E4M3 with one FP32 scale per block.

    Args:
        w: [N, K] bf16/fp16/fp32 weight (out_features x in_features), any device.
        block_size: (bn, bk) block shape; edge blocks may be partial when N or K is not a multiple.
        pow2_scale: power-of-two scales (rounded as `scale_rule` says).
        scale_rule: "amax_over_max" or "transformer_engine" (`fp8_align.quant.scales`).
    Returns:
        (w_fp8 [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32) with
        `w ~= w_fp8 * scale_inv` per block; `scale_inv = amax(|block|) / 448` (or its pow2 round-up),
        or `1 / fl(448 / amax)` under "transformer_engine".
    Raises:
        TypeError on a non-float or non-2D input, ValueError on NaN/Inf or a bad block size.
    """
    check_float_input(w, "weight")
    if w.dim() != 2:
        raise TypeError(f"weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    bn, bk = _check_block_size(block_size)
    check_finite(w, "weight")
    n, k = w.shape
    nb, kb = blockwise_scale_shape((n, k), (bn, bk))
    padded = F.pad(w.to(torch.float32), (0, kb * bk - k, 0, nb * bn - n))
    blocks = padded.view(nb, bn, kb, bk)
    factor, scale_inv = quantization_factors(blocks.abs().amax(dim=(1, 3)), pow2_scale, scale_rule, w.dtype)
    codes = quantize_with_factor(blocks, factor[:, None, :, None], scale_rule)
    return codes.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale_inv


def dequantize_blockwise(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of `quantize_weight_blockwise`: [N, K] codes times their block's scale, in `dtype`."""
    bn, bk = _check_block_size(block_size)
    n, k = w_fp8.shape
    if tuple(scale_inv.shape) != blockwise_scale_shape((n, k), (bn, bk)):
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(w_fp8.shape)} "
            f"with blocks {block_size}: expected {blockwise_scale_shape((n, k), (bn, bk))}"
        )
    full = scale_inv.to(torch.float32).repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (w_fp8.to(torch.float32) * full).to(dtype)


def _check_block_size(block_size: tuple[int, int]) -> tuple[int, int]:
    if len(block_size) != 2 or any(int(b) != b or b <= 0 for b in block_size):
        raise ValueError(f"block_size must be two positive integers, got {block_size}")
    return int(block_size[0]), int(block_size[1])
