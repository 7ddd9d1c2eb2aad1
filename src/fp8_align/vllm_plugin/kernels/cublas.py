"""cuBLASLt's block-scaled FP8 GEMM (`torch._scaled_mm` with 1x128 / 128x128 scales, SM90) as a
torch custom op, and the start-up probe that decides whether this torch/cuBLAS computes it right.

Needs only torch (no vLLM, no Triton); the `cublas` backend of `kernels.gpu` runs it.
"""

from __future__ import annotations

from functools import cache

import torch

from fp8_align.quant import fp8_block_gemm, quantize_activation_groupwise, quantize_weight_blockwise

#: M padding for cuBLASLt's block-scaled FP8 GEMM (it needs a multiple of 4). Where the product is
#: wrong anyway (small M on some torch/cuBLAS builds, benchmarks/RESULTS.md), `cublas_probe_error`
#: keeps this backend out of the selection.
_CUBLAS_M_MULTIPLE = 4


@torch.library.custom_op("fp8_align::cublas_block_scaled_mm", mutates_args=())
def cublas_block_scaled_mm(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """`torch._scaled_mm` with 1x128 activation / 128x128 weight scales (cuBLASLt, SM90).

    x_fp8 [M, K] e4m3, x_scale [M, K/128] float32 column-major, w_fp8 [N, K] e4m3,
    w_scale [N/128, K/128] float32. Returns [M, N] in `out_dtype`. M is padded to a multiple
    of `_CUBLAS_M_MULTIPLE` (zero codes, unit scales) and the padding rows are cut off again.
    """
    m = x_fp8.shape[0]
    pad = (-m) % _CUBLAS_M_MULTIPLE
    if pad:
        x_fp8 = torch.cat([x_fp8, x_fp8.new_zeros((pad, x_fp8.shape[1]))])
        padded_scale = torch.ones((x_scale.shape[1], m + pad), dtype=x_scale.dtype, device=x_scale.device).t()
        padded_scale[:m] = x_scale
        x_scale = padded_scale
    out = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=out_dtype)
    return out[:m] if pad else out


@cublas_block_scaled_mm.register_fake
def _(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((x_fp8.shape[0], w_fp8.shape[0]), dtype=out_dtype, device=x_fp8.device)


@cache
def cublas_probe_error(device_index: int) -> str | None:
    """None when `cublas_block_scaled_mm` reproduces the torch reference on CUDA device
    `device_index`, else why not (cached per device).

    Probes the cases that went wrong before (small M, padded M) with random operands: the
    result must be within 1% (relative Frobenius) of `fp8_align.quant.fp8_block_gemm`, where a
    correct kernel lands near 2e-3 (bf16 output rounding).
    """
    device = torch.device("cuda", device_index)
    g = torch.Generator(device=device).manual_seed(0)
    w_fp8, w_scale = quantize_weight_blockwise(torch.randn(384, 640, generator=g, device=device))
    for m in (1, 7, 20):
        x = torch.randn(m, 640, generator=g, device=device)
        x_fp8, x_scale = quantize_activation_groupwise(x)
        col_major_scale = x_scale.t().contiguous().t()
        try:
            out = cublas_block_scaled_mm(x_fp8, col_major_scale, w_fp8, w_scale, torch.bfloat16)
        except RuntimeError as exc:  # the answer to "does this torch/cuBLAS have it"; logged by the caller
            return f"torch._scaled_mm rejects block scales: {str(exc).splitlines()[0]}"
        ref = fp8_block_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.float32)
        error = ((out.float() - ref).norm() / ref.norm()).item()
        if not error < 1e-2:
            return f"torch._scaled_mm block-scaled product is wrong at M={m} (relative error {error:.2g})"
    return None
