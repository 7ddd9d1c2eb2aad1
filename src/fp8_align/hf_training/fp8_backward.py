"""The block-FP8 backward of the bitwise trainer's FP8 linears (`FP8Config.bitwise_linear_backward="fp8"`).

y = x @ w.T runs forward through the engine's block-FP8 GEMM either way, so the log-probs do not
depend on this setting. Its two gradient products run in block FP8 as TransformerEngine's blockwise
recipe runs them (E4M3 operands, 1x128 groups along each product's reduction dimension):
- dx [T, K] = dy [T, N] @ w [N, K]: dy in 1x128 groups along N; w the forward's codes and 128x128
  scales, read transposed;
- dw [N, K] = dy.T [N, T] @ x [T, K]: dy.T and x.T in 1x128 groups along the tokens, which are
  padded with zeros to whole groups (zero products).
dy and x are quantized with the run's activation rounding (`Rounding.activation_pow2`,
`scale_rule`). On CUDA the products are cuBLAS's block-scaled FP8 GEMMs
(`torch.nn.functional.scaled_mm`, Hopper) and the quantizers fp8_align's Triton kernels; elsewhere
the pure-torch references: the same codes and scales, dequantized and multiplied in FP32
(tests/test_gpu_bitwise.py compares the two on the GPU). Every block the GEMMs read is whole:
each FP8 layer's shard sizes and input size must be multiples of 128 (`check_fp8_backward_shape`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fp8_align.quant.blockwise import dequantize_blockwise
from fp8_align.quant.groupwise import dequantize_groupwise, quantize_activation_groupwise, quantize_activation_transposed
from fp8_align.rounding import Rounding

BLOCK = 128


def check_fp8_backward_shape(shard_sizes: Sequence[int], in_features: int) -> None:
    """Raise ValueError unless every shard size (the rows of each member of a stacked layer) and
    `in_features` are whole 128-blocks, as the block-FP8 backward's GEMMs need."""
    if any(size % BLOCK for size in shard_sizes) or in_features % BLOCK:
        raise ValueError(
            f"bitwise_linear_backward='fp8': a block-FP8 layer with shards of {list(shard_sizes)} rows and {in_features} input "
            f"columns; the FP8 backward's GEMMs take whole {BLOCK}-blocks only (use bitwise_linear_backward='bf16' for this model)"
        )


def input_gradient(grad: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """dx [T, K] in grad's dtype = grad [T, N] @ w [N, K] in block FP8: grad quantized in 1x128
    groups along N, w given as the forward's codes [N, K] float8_e4m3fn and 128x128 scales
    [N / 128, K / 128] FP32 (whole blocks: `check_fp8_backward_shape`)."""
    pow2, rule = rounding.activation_pow2, rounding.scale_rule
    if not grad.is_cuda:
        grad_codes, grad_scales = quantize_activation_groupwise(grad, pow2_scale=pow2, check_inputs=False, scale_rule=rule)
        product = dequantize_groupwise(grad_codes, grad_scales, dtype=torch.float32) @ dequantize_blockwise(codes, scales, dtype=torch.float32)
        return product.to(grad.dtype)
    # imported here: Triton is needed on CUDA only (CPU-only installs have none), scaled_mm there only (torch >= 2.10)
    from torch.nn.functional import ScalingType, scaled_mm

    from fp8_align.quant.triton_groupwise import ScaleLayout, quantize_activation_triton

    # cuBLAS reads grad's scales with a leading dimension of its row count, which must be whole 16 bytes
    # (4 FP32): the rows are padded with zeros to a multiple of 4 (zero rows of dx, cut off)
    tokens = grad.shape[0]
    padded = F.pad(grad, (0, 0, 0, -tokens % 4)) if tokens % 4 else grad.contiguous()
    grad_codes, grad_scales = quantize_activation_triton(padded, pow2, int(ScaleLayout.COLUMN_MAJOR), rule)
    # and the weight's block scales as [4 * ceil(N/128 / 4), K/128] with strides (1, that row count)
    n_blocks, k_blocks = scales.shape
    block_scales = scales.new_zeros(k_blocks, -(-n_blocks // 4) * 4)
    block_scales[:, :n_blocks] = scales.t()
    product = scaled_mm(
        grad_codes, codes.t().contiguous().t(), grad_scales, ScalingType.BlockWise1x128, block_scales.t(), ScalingType.BlockWise128x128,
        output_dtype=grad.dtype,
    )  # fmt: skip
    return product[:tokens]


def weight_gradient(grad: torch.Tensor, x: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """dw [N, K] in grad's dtype = grad.T [N, T] @ x [T, K] in block FP8: grad.T and x.T each
    quantized in 1x128 groups along the T tokens (zero-padded to whole groups)."""
    pow2, rule = rounding.activation_pow2, rounding.scale_rule
    if not grad.is_cuda:
        (grad_codes, grad_scales), (x_codes, x_scales) = (quantize_activation_transposed(t, pow2, rule) for t in (grad, x))
        grad_t, x_t = (dequantize_groupwise(c, s, dtype=torch.float32) for c, s in ((grad_codes, grad_scales), (x_codes, x_scales)))
        return (grad_t @ x_t.t()).to(grad.dtype)
    # imported here: Triton and scaled_mm are needed on CUDA only
    from torch.nn.functional import ScalingType, scaled_mm

    from fp8_align.quant.triton_groupwise import quantize_activation_transposed_triton

    (grad_codes, grad_scales), (x_codes, x_scales) = (quantize_activation_transposed_triton(t.contiguous(), pow2, rule) for t in (grad, x))
    return scaled_mm(grad_codes, x_codes.t(), grad_scales, ScalingType.BlockWise1x128, x_scales, ScalingType.BlockWise1x128, output_dtype=grad.dtype)
