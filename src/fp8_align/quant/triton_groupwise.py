"""Triton kernels for `quantize_activation_groupwise` on CUDA: 1x128 groups of a [M, K] activation,
and for `quantize_activation_transposed`: 128-token groups of each of its channels, written transposed.

Bit-identical to the torch reference `fp8_align.quant.quantize_activation_groupwise` (tested in
tests/test_gpu_kernels.py, and through the Triton interpreter on CPU in
tests/test_triton_interpreted.py), under either scale rule (`fp8_align.quant.scales`), with the
per-group math of the weight kernel (`triton_blockwise.quantization_factors_triton`). It writes
the scales in the memory layout the consuming GEMM reads (`ScaleLayout`), so the block-FP8 GEMM
backends of the vLLM plugin take them without a copy. Registered as the torch custom op
`fp8_align::quantize_activation_groupwise` (opaque to torch.compile). Import only where Triton
exists.
"""

from __future__ import annotations

import enum
import math

import torch
import triton
import triton.language as tl

from fp8_align.rounding import DEFAULT_SCALE_RULE, check_scale_rule
from fp8_align.quant.scales import E4M3_MAX, FP32_TINY
from fp8_align.quant.triton_blockwise import BLOCK, quantization_factors_triton, quantize_with_factor_triton

#: Groups of 128 channels one program of the activation-quantization kernel handles.
_GROUPS_PER_PROGRAM = 8
#: Channels one program of the transposed kernel quantizes (over one group of 128 tokens).
_TRANSPOSED_CHANNELS = 64


class ScaleLayout(enum.IntEnum):
    """Memory layout of the [M, G] activation scales a GEMM backend reads."""

    ROW_MAJOR = 0  # stride (G, 1): Triton
    COLUMN_MAJOR = 1  # stride (1, M): CUTLASS, cuBLASLt
    COLUMN_MAJOR_TMA = 2  # stride (1, M rounded up to 4): DeepGEMM (16-byte TMA alignment)


@triton.jit
def _quantize_activation_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    num_groups,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    TINY: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    POW2: tl.constexpr,
    TE_RULE: tl.constexpr,
    VALUE_FOR_INF: tl.constexpr,
):
    """Row `program_id(0)`, groups GROUPS_PER_PROGRAM * program_id(1) + [0, GROUPS_PER_PROGRAM) of
    x: codes into q, scales into s. TE_RULE / VALUE_FOR_INF: the scale rule (`quantization_factors_triton`)."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    valid = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=valid, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    factor, scale = quantization_factors_triton(amax, TINY, FP8_MAX, POW2, TE_RULE, VALUE_FOR_INF)
    q = quantize_with_factor_triton(x, factor[:, None], FP8_MAX, TE_RULE)
    tl.store(q_ptr + row * stride_qm + cols, q.to(tl.float8e4nv), mask=valid)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < num_groups)


@triton.jit
def _quantize_transposed_kernel(
    x_ptr, q_ptr, s_ptr, M, K, padded_m, stride_xm,
    TINY: tl.constexpr, FP8_MAX: tl.constexpr, GROUP: tl.constexpr, CHANNELS: tl.constexpr,
    POW2: tl.constexpr, TE_RULE: tl.constexpr, VALUE_FOR_INF: tl.constexpr,
):  # fmt: skip
    """Tokens GROUP * program_id(0) + [0, GROUP) (zeros past M) of channels CHANNELS * program_id(1)
    + [0, CHANNELS) of x [M, K]: one group per channel, codes into q [K, padded_m] (transposed),
    scales into s [padded_m / GROUP, K]."""
    group = tl.program_id(0)
    rows = group * GROUP + tl.arange(0, GROUP)
    cols = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    valid = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    factor, scale = quantization_factors_triton(amax, TINY, FP8_MAX, POW2, TE_RULE, VALUE_FOR_INF)
    q = quantize_with_factor_triton(x, factor[None, :], FP8_MAX, TE_RULE)
    q_t = tl.trans(q).to(tl.float8e4nv)
    tl.store(q_ptr + cols.to(tl.int64)[:, None] * padded_m + rows[None, :], q_t, mask=cols[:, None] < K)
    tl.store(s_ptr + group * K + cols, scale, mask=cols < K)


def quantize_activation_transposed_triton(x: torch.Tensor, pow2: bool, scale_rule: str = DEFAULT_SCALE_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    """128-token groups of each channel of a [M, K] bf16/fp16/fp32 CUDA tensor (last dim contiguous).

    Returns (codes [K, M_pad] float8_e4m3fn, scales [K, M_pad / 128] float32 with strides (1, K):
    the outer-dimension-major layout of cuBLAS's 1x128 block scaling), M_pad = 128 * ceil(M / 128);
    bit-identical to `fp8_align.quant.quantize_activation_transposed(x, pow2, scale_rule)`.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_activation_transposed_triton takes a [M, K] tensor with contiguous rows; got shape {tuple(x.shape)}, strides {x.stride()}")
    te_rule = check_scale_rule(scale_rule) == "transformer_engine"
    m, k = x.shape
    padded_m = -(-m // BLOCK) * BLOCK
    codes = torch.empty((k, padded_m), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((padded_m // BLOCK, k), dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_transposed_kernel[(padded_m // BLOCK, triton.cdiv(k, _TRANSPOSED_CHANNELS))](
            x, codes, scales, m, k, padded_m, x.stride(0),
            TINY=FP32_TINY, FP8_MAX=E4M3_MAX, GROUP=BLOCK, CHANNELS=_TRANSPOSED_CHANNELS, POW2=pow2,
            TE_RULE=te_rule, VALUE_FOR_INF=torch.finfo(x.dtype).max, num_warps=4,
        )  # fmt: skip
    return codes, scales.t()


def empty_scales(m: int, groups: int, layout: ScaleLayout, device: torch.device) -> torch.Tensor:
    """Uninitialized float32 [m, groups] scales in `layout`."""
    if layout == ScaleLayout.ROW_MAJOR:
        return torch.empty((m, groups), dtype=torch.float32, device=device)
    lead = m if layout == ScaleLayout.COLUMN_MAJOR else -(-m // 4) * 4
    return torch.empty_strided((m, groups), (1, max(lead, 1)), dtype=torch.float32, device=device)


@torch.library.custom_op("fp8_align::quantize_activation_groupwise", mutates_args=())
def quantize_activation_triton(
    x: torch.Tensor, pow2: bool, layout: int, scale_rule: str = DEFAULT_SCALE_RULE
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 group quantization of a [M, K] bf16/fp16/fp32 CUDA tensor (last dim contiguous).

    Returns (codes [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32 in `ScaleLayout(layout)`),
    bit-identical to `fp8_align.quant.quantize_activation_groupwise(x, pow2_scale=pow2,
    scale_rule=scale_rule)`. "amax_over_max": `scale = amax / 448` (1.0 for an all-zero group, at
    least FLT_MIN), rounded up to a power of two when `pow2`; `code = RNE(clamp(x / scale, +-448))`;
    both divisions correctly rounded. "transformer_engine": TE's multiplier `m = 448 / amax`
    (rounded down to a power of two when `pow2`), `code = RNE(clamp(x * m, +-448))`, `scale = 1 / m`.
    """
    te_rule = check_scale_rule(scale_rule) == "transformer_engine"
    m, k = x.shape
    groups = math.ceil(k / BLOCK)
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = empty_scales(m, groups, ScaleLayout(layout), x.device)
    if m == 0:
        return codes, scales
    grid = (m, triton.cdiv(groups, _GROUPS_PER_PROGRAM))
    _quantize_activation_kernel[grid](
        x, codes, scales, k, groups,
        x.stride(0), codes.stride(0), scales.stride(0), scales.stride(1),
        TINY=FP32_TINY, FP8_MAX=E4M3_MAX,
        GROUP=BLOCK, GROUPS_PER_PROGRAM=_GROUPS_PER_PROGRAM, POW2=pow2,
        TE_RULE=te_rule, VALUE_FOR_INF=torch.finfo(x.dtype).max, num_warps=4,
    )  # fmt: skip
    return codes, scales


@quantize_activation_triton.register_fake
def _(x: torch.Tensor, pow2: bool, layout: int, scale_rule: str = DEFAULT_SCALE_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    return codes, empty_scales(m, math.ceil(k / BLOCK), ScaleLayout(layout), x.device)
