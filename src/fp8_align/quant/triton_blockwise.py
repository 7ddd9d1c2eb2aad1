"""Triton kernel for `quantize_weight_blockwise` on CUDA: one program per 128x128 block.

Bit-identical to the torch reference `fp8_align.quant.quantize_weight_blockwise` (tested in
tests/test_gpu_kernels.py): `scale = amax / 448` correctly rounded (1.0 for an all-zero block,
at least FLT_MIN), rounded up to a power of two when asked; `code = RNE(clamp(w / scale, +-448))`
with a correctly rounded division. The reference reads the weight about six times (pad, abs,
amax, divide, clamp, cast); this kernel reads it once and writes the codes once, and can write
straight into existing storage (the rows of a merged vLLM weight, for an in-place refit).

A block holding NaN or Inf gets a NaN scale; `quantize_weight_blockwise_triton` raises on it
unless the caller has validated the input already (`check_finite=False`).
Import only where Triton and CUDA exist.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fp8_align.quant.blockwise import DEFAULT_BLOCK_SIZE
from fp8_align.quant.scales import E4M3_MAX, FP8_DTYPE, FP32_TINY, check_float_input

BLOCK = DEFAULT_BLOCK_SIZE[0]


#: Launch configuration: 128x128 blocks one program quantizes (along K), warps, loop stages.
#: Chosen with benchmarks/tune_weight_quant.py on the H100 box (see benchmarks/RESULTS.md).
LAUNCH = {"k_blocks": 1, "num_warps": 8, "num_stages": 1}


@triton.jit
def scale_from_amax_triton(amax, TINY: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """`fp8_align.quant.scale_from_amax` in Triton, for FP32 amax tensors of any shape: amax / 448
    correctly rounded (1.0 where amax is 0, at least TINY), rounded up to a power of two when POW2.
    Shared by the weight kernel here and the activation kernel of the vLLM plugin."""
    scale = tl.maximum(tl.where(amax > 0, tl.div_rn(amax, FP8_MAX), 1.0), TINY)
    if POW2:
        # smallest power of two >= scale (a positive normal float): clear the mantissa and bump
        # the exponent unless the mantissa already is zero.
        bits = scale.to(tl.int32, bitcast=True)
        bits = tl.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits)
        scale = bits.to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _quantize_weight_block_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    N,
    K,
    num_k_blocks,
    stride_wn,
    stride_qn,
    stride_sn,
    stride_sk,
    TINY: tl.constexpr,
    FP32_MAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_BLOCKS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    POW2: tl.constexpr,
):
    block_n = tl.program_id(0)
    rows = (block_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nan = tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    for i in tl.range(0, K_BLOCKS, num_stages=NUM_STAGES):
        block_k = tl.program_id(1) * K_BLOCKS + i
        cols = block_k * BLOCK_K + tl.arange(0, BLOCK_K)
        valid = (rows[:, None] < N) & (cols[None, :] < K)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=valid, other=0.0).to(tl.float32)
        magnitude = tl.abs(w)
        # 1 where an element is NaN or +-Inf (both compare false with `<= FLT_MAX`), else 0.
        non_finite = tl.max(tl.max(tl.where(magnitude <= FP32_MAX, 0, 1), axis=1), axis=0)
        amax = tl.max(tl.max(magnitude, axis=1), axis=0)
        scale = scale_from_amax_triton(amax, TINY, FP8_MAX, POW2)
        q = tl.div_rn(w, scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + rows[:, None] * stride_qn + cols[None, :], q.to(tl.float8e4nv), mask=valid)
        scale_ptr = s_ptr + block_n * stride_sn + block_k * stride_sk
        tl.store(scale_ptr, tl.where(non_finite > 0, nan, scale), mask=block_k < num_k_blocks)


def quantize_weight_blockwise_triton(
    w: torch.Tensor,
    pow2_scale: bool = False,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block E4M3 quantization of a [N, K] bf16/fp16/fp32 CUDA weight (last dim contiguous).

    out_codes: optional [N, K] float8_e4m3fn CUDA tensor (last dim contiguous) to write into;
    out_scales: optional [ceil(N/128), ceil(K/128)] float32 tensor to write into. Returns
    (codes, scales) exactly as `quantize_weight_blockwise(w, pow2_scale=pow2_scale)`.
    check_finite: raise ValueError when `w` holds NaN/Inf (one device sync); with False the
    caller must have checked, and such a block's scale is NaN.
    """
    check_float_input(w, "weight")
    if w.dim() != 2 or not w.is_cuda or (w.numel() and w.stride(1) != 1):
        raise TypeError(f"weight must be a 2-D CUDA tensor with a contiguous last dim, got {tuple(w.shape)} on {w.device}")
    n, k = w.shape
    scale_shape = (math.ceil(n / BLOCK), math.ceil(k / BLOCK))
    codes = torch.empty((n, k), dtype=FP8_DTYPE, device=w.device) if out_codes is None else out_codes
    scales = torch.empty(scale_shape, dtype=torch.float32, device=w.device) if out_scales is None else out_scales
    if codes.shape != w.shape or codes.dtype != FP8_DTYPE or codes.device != w.device or (codes.numel() and codes.stride(1) != 1):
        raise ValueError(f"out_codes must be a [{n}, {k}] float8_e4m3fn tensor on {w.device} with a contiguous last dim")
    if tuple(scales.shape) != scale_shape or scales.dtype != torch.float32 or scales.device != w.device:
        raise ValueError(f"out_scales must be a {list(scale_shape)} float32 tensor on {w.device}")
    if w.numel() == 0:
        return codes, scales
    k_blocks = LAUNCH["k_blocks"]
    _quantize_weight_block_kernel[(scale_shape[0], triton.cdiv(scale_shape[1], k_blocks))](
        w, codes, scales, n, k, scale_shape[1],
        w.stride(0), codes.stride(0), scales.stride(0), scales.stride(1),
        TINY=FP32_TINY, FP32_MAX=torch.finfo(torch.float32).max, FP8_MAX=E4M3_MAX, BLOCK_N=BLOCK, BLOCK_K=BLOCK,
        K_BLOCKS=k_blocks, NUM_STAGES=LAUNCH["num_stages"], POW2=pow2_scale, num_warps=LAUNCH["num_warps"],
    )  # fmt: skip
    if check_finite and not bool(torch.isfinite(scales).all()):
        raise ValueError(f"weight of shape {tuple(w.shape)} contains NaN or Inf; FP8 scales would be invalid")
    return codes, scales
