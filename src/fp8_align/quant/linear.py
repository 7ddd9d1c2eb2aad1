"""Reference block-FP8 linear: the product the DeepGEMM/CUTLASS block kernels compute, in torch.

Used as the CPU execution path of the vLLM plugin and as the aligned "training side" emulation.
"""

from __future__ import annotations

import torch

from fp8_align.quant.blockwise import DEFAULT_BLOCK_SIZE, blockwise_scale_shape
from fp8_align.quant.groupwise import quantize_activation_groupwise
from fp8_align.rounding import DEFAULT_SCALE_RULE


def fp8_block_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Block-scaled GEMM of already-quantized operands.

    Args:
        x_fp8: [M, K] float8_e4m3fn activation codes; x_scale: [M, ceil(K/128)] float32.
        w_fp8: [N, K] float8_e4m3fn weight codes (or float32 holding exactly those values, which skips
            the widening); scale_inv: [ceil(N/128), ceil(K/128)] float32.
    Returns:
        [M, N] in `out_dtype`. Per 128-wide K slice b the FP8 products are summed in FP32, then
        scaled by `x_scale[:, b] * scale_inv[n // 128, b]` and accumulated in FP32 in K order, the
        promotion scheme of the block-FP8 GEMM kernels.
    """
    n, k = w_fp8.shape
    bn, bk = DEFAULT_BLOCK_SIZE
    if x_fp8.shape[-1] != k:
        raise ValueError(f"activation last dim {x_fp8.shape[-1]} does not match weight in_features {k}")
    if tuple(scale_inv.shape) != blockwise_scale_shape((n, k)):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {(n, k)} with 128x128 blocks")
    x_codes = x_fp8.to(torch.float32)
    w_codes = w_fp8.to(torch.float32)
    w_scale_rows = scale_inv.to(torch.float32).repeat_interleave(bn, dim=0)[:n]  # [N, KB]
    acc = torch.zeros(x_codes.shape[0], n, dtype=torch.float32, device=x_fp8.device)
    for b in range(scale_inv.shape[1]):
        cols = slice(b * bk, min((b + 1) * bk, k))
        partial = x_codes[:, cols] @ w_codes[:, cols].T
        acc += partial * (x_scale[:, b : b + 1] * w_scale_rows[:, b][None, :])
    return acc.to(out_dtype)


def blockwise_fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation_pow2_scale: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    check_inputs: bool = True,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> torch.Tensor:
    """`y = x @ w.T (+ bias)` with x quantized in 1x128 groups and w in 128x128 blocks.

    Args:
        x: [..., K] activations (bf16/fp16/fp32).
        w_fp8: [N, K] float8_e4m3fn weight codes (or float32 holding exactly those values, which skips
            the widening); scale_inv: [ceil(N/128), ceil(K/128)] float32.
        bias: optional [N], added after rounding to `out_dtype` (as vLLM does after the GEMM).
        activation_pow2_scale: power-of-two activation scales.
        scale_rule: how activation scales are computed (`fp8_align.quant.scales`).
    Returns:
        [..., N] in `out_dtype` (see `fp8_block_gemm` for the accumulation order).
    """
    k = w_fp8.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"activation last dim {x.shape[-1]} does not match weight in_features {k}")
    lead = x.shape[:-1]
    x_fp8, x_scale = quantize_activation_groupwise(
        x.reshape(-1, k), DEFAULT_BLOCK_SIZE[1], activation_pow2_scale, check_inputs, scale_rule
    )
    out = fp8_block_gemm(x_fp8, x_scale, w_fp8, scale_inv, out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.reshape(*lead, w_fp8.shape[0])
