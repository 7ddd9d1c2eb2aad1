"""Triton kernel for `quantize_weight_blockwise` on CUDA: one program per 128x128 block.

Bit-identical to the torch reference `fp8_align.quant.quantize_weight_blockwise` (tested in
tests/test_gpu_kernels.py), under either scale rule (`fp8_align.quant.scales`): by default
`scale = amax / 448` correctly rounded (1.0 for an all-zero block, at least FLT_MIN), rounded up
to a power of two when asked, `code = RNE(clamp(w / scale, +-448))` with a correctly rounded
division; with "transformer_engine", TE's multiplier `m = 448 / amax`, `code = RNE(clamp(w * m))`,
`scale = 1 / m`. The reference reads the weight about six times (pad, abs,
amax, divide, clamp, cast); this kernel reads it from memory once (a second pass re-reads each
slice of a block from L2) and writes the codes once, and can write straight into existing storage (the rows of a merged vLLM weight, for an in-place refit).

A block holding NaN or Inf gets a NaN scale; `quantize_weight_blockwise_triton` raises on it
unless the caller has validated the input already (`check_finite=False`).
`quantize_weights_blockwise_triton` quantizes a list of weights (a whole model's refit) in one
launch with the same per-block code (`_quantize_block`). Import only where Triton and CUDA exist.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fp8_align.quant.blockwise import DEFAULT_BLOCK_SIZE
from fp8_align.rounding import DEFAULT_SCALE_RULE, check_scale_rule
from fp8_align.quant.scales import E4M3_MAX, FP8_DTYPE, FP32_TINY, check_float_input

BLOCK = DEFAULT_BLOCK_SIZE[0]
#: Under the Triton interpreter (TRITON_INTERPRET=1, how the CPU tests run these kernels) CPU
#: tensors are accepted too.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: Input dtypes the kernels read, and their Triton types.
TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


#: Launch configurations, chosen with benchmarks/tune_weight_quant.py on the H100 box (see
#: benchmarks/results_log.md). LAUNCH (one weight): 128x128 blocks one program quantizes (along K),
#: warps, loop stages, rows per pass (`_quantize_block`). GROUPED_LAUNCH: the same for the
#: one-launch kernel of many weights (one block per program).
LAUNCH = {"k_blocks": 1, "num_warps": 8, "num_stages": 1, "rows_per_pass": 64}
GROUPED_LAUNCH = {"num_warps": 8, "rows_per_pass": 64}


def int64_table_to_device(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """A [len(rows), len(rows[0])] int64 tensor of `rows` on `device`, without a stream sync.

    A plain `.to("cuda")` of a pageable host tensor waits for all queued device work; this one
    goes through pinned memory (torch's caching host allocator keeps it until the copy ran), so
    the host can queue more work while the device is still busy.
    """
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


@triton.jit
def scale_from_amax_triton(amax, TINY: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """`fp8_align.quant.scale_from_amax` in Triton, for FP32 amax tensors of any shape: amax / 448
    correctly rounded (1.0 where amax is 0, at least TINY), rounded up to a power of two when POW2.
    Used through `quantization_factors_triton` by the weight kernel here and the activation kernel
    (`triton_groupwise`)."""
    scale = tl.maximum(tl.where(amax > 0, tl.div_rn(amax, FP8_MAX), 1.0), TINY)
    if POW2:
        # smallest power of two >= scale (a positive normal float): clear the mantissa and bump
        # the exponent unless the mantissa already is zero.
        bits = scale.to(tl.int32, bitcast=True)
        bits = tl.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits)
        scale = bits.to(tl.float32, bitcast=True)
    return scale


@triton.jit
def te_multiplier_from_amax_triton(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr, VALUE_FOR_INF: tl.constexpr):
    """`fp8_align.quant.scales.te_multiplier_from_amax` in Triton (FP32 amax of any shape):
    FP8_MAX / amax correctly rounded, 1.0 where amax is 0, inf or NaN, VALUE_FOR_INF where the
    quotient overflows, rounded down to a power of two (mantissa cleared) when POW2."""
    usable = (amax > 0) & (amax.to(tl.int32, bitcast=True) < 0x7F800000)  # positive and finite
    multiplier = tl.where(usable, tl.div_rn(tl.zeros_like(amax) + FP8_MAX, amax), 1.0)
    multiplier = tl.where(multiplier.to(tl.int32, bitcast=True) == 0x7F800000, VALUE_FOR_INF, multiplier)
    if POW2:
        # a positive multiplier: keeping the exponent bits rounds it down to a power of two
        multiplier = (multiplier.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return multiplier


@triton.jit
def quantization_factors_triton(
    amax, TINY: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr, TE_RULE: tl.constexpr, VALUE_FOR_INF: tl.constexpr
):
    """`fp8_align.quant.scales.quantization_factors` in Triton: (factor, scale_inv), FP32, shaped
    like amax. TE_RULE selects "transformer_engine" (factor: a multiplier, scale_inv = 1 / factor,
    VALUE_FOR_INF: the largest finite value of the input dtype), else "amax_over_max" (factor: the
    scale itself, a divisor)."""
    if TE_RULE:
        multiplier = te_multiplier_from_amax_triton(amax, FP8_MAX, POW2, VALUE_FOR_INF)
        return multiplier, tl.div_rn(tl.zeros_like(multiplier) + 1.0, multiplier)
    else:
        scale = scale_from_amax_triton(amax, TINY, FP8_MAX, POW2)
        return scale, scale


@triton.jit
def quantize_with_factor_triton(x, factor, FP8_MAX: tl.constexpr, TE_RULE: tl.constexpr):
    """`fp8_align.quant.scales.quantize_with_factor` in Triton: FP32 x times (TE_RULE) or divided
    by (correctly rounded) a broadcastable factor, saturated to +-FP8_MAX; the caller casts to E4M3."""
    if TE_RULE:
        q = x * factor
    else:
        q = tl.div_rn(x, factor)
    return tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)


@triton.jit
def _quantize_block(
    w_ptr, q_ptr, s_ptr, block_n, block_k, N, K, num_k_blocks, stride_wn, stride_qn, stride_sn, stride_sk,
    TINY: tl.constexpr, FP32_MAX: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    POW2: tl.constexpr, ROWS_PER_PASS: tl.constexpr, TE_RULE: tl.constexpr, VALUE_FOR_INF: tl.constexpr,
):  # fmt: skip
    """Quantize block (block_n, block_k) of w [N, K] into q and its scale into s (the math of both kernels).

    TE_RULE / VALUE_FOR_INF: the scale rule (`quantization_factors_triton`).

    Two passes over ROWS_PER_PASS-row slices of the block: amax, then quantize, re-reading each
    slice, which the first pass just brought into L2. A program holds one slice in registers, not
    the whole block, so more programs fit on an SM. Same bits for any slice height (a max is exact
    in any order).
    """
    cols = block_k * BLOCK_K + tl.arange(0, BLOCK_K)
    first_row = block_n * BLOCK_N
    amax = tl.full([], 0.0, tl.float32)
    non_finite = tl.full([], 0, tl.int32)
    for start in tl.range(0, BLOCK_N, ROWS_PER_PASS):
        rows = (first_row + start + tl.arange(0, ROWS_PER_PASS)).to(tl.int64)
        valid = (rows[:, None] < N) & (cols[None, :] < K)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=valid, other=0.0, eviction_policy="evict_last")
        magnitude = tl.abs(w.to(tl.float32))
        # 1 where an element is NaN or +-Inf (both compare false with `<= FLT_MAX`), else 0.
        non_finite = tl.maximum(non_finite, tl.max(tl.max(tl.where(magnitude <= FP32_MAX, 0, 1), axis=1), axis=0))
        amax = tl.maximum(amax, tl.max(tl.max(magnitude, axis=1), axis=0))
    factor, scale = quantization_factors_triton(amax, TINY, FP8_MAX, POW2, TE_RULE, VALUE_FOR_INF)
    for start in tl.range(0, BLOCK_N, ROWS_PER_PASS):
        rows = (first_row + start + tl.arange(0, ROWS_PER_PASS)).to(tl.int64)
        valid = (rows[:, None] < N) & (cols[None, :] < K)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=valid, other=0.0, eviction_policy="evict_first")
        q = quantize_with_factor_triton(w.to(tl.float32), factor, FP8_MAX, TE_RULE)
        tl.store(q_ptr + rows[:, None] * stride_qn + cols[None, :], q.to(tl.float8e4nv), mask=valid)
    nan = tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    scale_ptr = s_ptr + block_n * stride_sn + block_k * stride_sk
    tl.store(scale_ptr, tl.where(non_finite > 0, nan, scale), mask=block_k < num_k_blocks)


@triton.jit
def _quantize_weight_block_kernel(
    w_ptr, q_ptr, s_ptr, N, K, num_k_blocks, stride_wn, stride_qn, stride_sn, stride_sk,
    TINY: tl.constexpr, FP32_MAX: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_BLOCKS: tl.constexpr, NUM_STAGES: tl.constexpr, POW2: tl.constexpr, ROWS_PER_PASS: tl.constexpr,
    TE_RULE: tl.constexpr, VALUE_FOR_INF: tl.constexpr,
):  # fmt: skip
    for i in tl.range(0, K_BLOCKS, num_stages=NUM_STAGES):
        _quantize_block(
            w_ptr, q_ptr, s_ptr, tl.program_id(0), tl.program_id(1) * K_BLOCKS + i, N, K, num_k_blocks,
            stride_wn, stride_qn, stride_sn, stride_sk, TINY, FP32_MAX, FP8_MAX, BLOCK_N, BLOCK_K, POW2, ROWS_PER_PASS,
            TE_RULE, VALUE_FOR_INF,
        )  # fmt: skip


@triton.jit
def _quantize_weights_grouped_kernel(
    table, weight_of_block, first_block, num_weights,
    TINY: tl.constexpr, FP32_MAX: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    POW2: tl.constexpr, W_DTYPE: tl.constexpr, ALIGNED: tl.constexpr, ROWS_PER_PASS: tl.constexpr,
    TE_RULE: tl.constexpr, VALUE_FOR_INF: tl.constexpr,
):  # fmt: skip
    """One program per 128x128 block of any of the weights in `table` (one launch for all).

    table: int64 [10, num_weights], rows: addresses of w, q, s; N; K; scale columns; the row
    strides of w, q, s and the column stride of s. weight_of_block: int32 [total blocks];
    first_block: int64 [num_weights], each weight's first block (row-major over its grid).
    ALIGNED: every address is a multiple of 16 bytes and every N, K and row stride a multiple of
    16 elements. Values loaded from memory carry no such facts (kernel arguments do: Triton
    specializes on them), and without them the loads and stores are not vectorized.
    """
    block = tl.program_id(0)
    i = tl.load(weight_of_block + block)
    field = table + i
    w_ptr = tl.load(field).to(tl.pointer_type(W_DTYPE))
    q_ptr = tl.load(field + num_weights).to(tl.pointer_type(tl.float8e4nv))
    s_ptr = tl.load(field + 2 * num_weights).to(tl.pointer_type(tl.float32))
    n = tl.load(field + 3 * num_weights)
    k = tl.load(field + 4 * num_weights)
    stride_wn = tl.load(field + 6 * num_weights)
    stride_qn = tl.load(field + 7 * num_weights)
    if ALIGNED:
        w_ptr = tl.multiple_of(w_ptr, 16)
        q_ptr = tl.multiple_of(q_ptr, 16)
        n = tl.multiple_of(n, 16)
        k = tl.multiple_of(k, 16)
        stride_wn = tl.multiple_of(stride_wn, 16)
        stride_qn = tl.multiple_of(stride_qn, 16)
    k_blocks = tl.load(field + 5 * num_weights)
    local = block - tl.load(first_block + i)
    _quantize_block(
        w_ptr, q_ptr, s_ptr, local // k_blocks, local % k_blocks, n, k, k_blocks, stride_wn, stride_qn,
        tl.load(field + 8 * num_weights), tl.load(field + 9 * num_weights), TINY, FP32_MAX, FP8_MAX, BLOCK_N, BLOCK_K, POW2,
        ROWS_PER_PASS, TE_RULE, VALUE_FOR_INF,
    )  # fmt: skip


def _checked_outputs(
    w: torch.Tensor, out_codes: torch.Tensor | None, out_scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate one weight and its optional output tensors; allocate the missing outputs."""
    check_float_input(w, "weight")
    if w.dim() != 2 or not (w.is_cuda or INTERPRETED) or (w.numel() and w.stride(1) != 1):
        raise TypeError(f"weight must be a 2-D CUDA tensor with a contiguous last dim, got {tuple(w.shape)} on {w.device}")
    n, k = w.shape
    scale_shape = (math.ceil(n / BLOCK), math.ceil(k / BLOCK))
    codes = torch.empty((n, k), dtype=FP8_DTYPE, device=w.device) if out_codes is None else out_codes
    scales = torch.empty(scale_shape, dtype=torch.float32, device=w.device) if out_scales is None else out_scales
    if codes.shape != w.shape or codes.dtype != FP8_DTYPE or codes.device != w.device or (codes.numel() and codes.stride(1) != 1):
        raise ValueError(f"out_codes must be a [{n}, {k}] float8_e4m3fn tensor on {w.device} with a contiguous last dim")
    if tuple(scales.shape) != scale_shape or scales.dtype != torch.float32 or scales.device != w.device:
        raise ValueError(f"out_scales must be a {list(scale_shape)} float32 tensor on {w.device}")
    return codes, scales


def quantize_weight_blockwise_triton(
    w: torch.Tensor,
    pow2_scale: bool = False,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    check_finite: bool = True,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block E4M3 quantization of a [N, K] bf16/fp16/fp32 CUDA weight (last dim contiguous).

    out_codes: optional [N, K] float8_e4m3fn CUDA tensor (last dim contiguous) to write into;
    out_scales: optional [ceil(N/128), ceil(K/128)] float32 tensor to write into. Returns
    (codes, scales) exactly as `quantize_weight_blockwise(w, pow2_scale=pow2_scale, scale_rule=scale_rule)`.
    check_finite: raise ValueError when `w` holds NaN/Inf (one device sync); with False the
    caller must have checked, and such a block's scale is NaN.
    """
    te_rule = check_scale_rule(scale_rule) == "transformer_engine"
    codes, scales = _checked_outputs(w, out_codes, out_scales)
    if w.numel() == 0:
        return codes, scales
    n, k = w.shape
    k_blocks = LAUNCH["k_blocks"]
    _quantize_weight_block_kernel[(scales.shape[0], triton.cdiv(scales.shape[1], k_blocks))](
        w, codes, scales, n, k, scales.shape[1],
        w.stride(0), codes.stride(0), scales.stride(0), scales.stride(1),
        TINY=FP32_TINY, FP32_MAX=torch.finfo(torch.float32).max, FP8_MAX=E4M3_MAX, BLOCK_N=BLOCK, BLOCK_K=BLOCK,
        K_BLOCKS=k_blocks, NUM_STAGES=LAUNCH["num_stages"], POW2=pow2_scale, ROWS_PER_PASS=LAUNCH["rows_per_pass"],
        TE_RULE=te_rule, VALUE_FOR_INF=torch.finfo(w.dtype).max, num_warps=LAUNCH["num_warps"],
    )  # fmt: skip
    if check_finite and not bool(torch.isfinite(scales).all()):
        raise ValueError(f"weight of shape {tuple(w.shape)} contains NaN or Inf; FP8 scales would be invalid")
    return codes, scales


def quantize_weights_blockwise_triton(
    weights: Sequence[torch.Tensor],
    out_codes: Sequence[torch.Tensor],
    out_scales: Sequence[torch.Tensor],
    pow2_scale: bool = False,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> None:
    """`quantize_weight_blockwise_triton(w, pow2_scale, codes, scales, False, scale_rule)` for every
    (w, codes, scales) of the three lists, in one kernel launch per weight dtype.

    Same bits as one call per weight (the same per-block code); what changes is launch cost and
    the tail: the blocks of all weights form one grid. weights: [N_i, K_i] bf16/fp16/fp32 on one
    CUDA device, last dim contiguous; out_codes / out_scales as in the single-weight function
    (views into larger tensors are fine). Inputs must be finite (validated by the caller):
    a block holding NaN or Inf gets a NaN scale.
    """
    if not (len(weights) == len(out_codes) == len(out_scales)):
        raise ValueError(f"got {len(weights)} weights, {len(out_codes)} code and {len(out_scales)} scale outputs")
    te_rule = check_scale_rule(scale_rule) == "transformer_engine"
    by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for w, codes, scales in zip(weights, out_codes, out_scales):
        _checked_outputs(w, codes, scales)
        if w.device != weights[0].device:
            raise ValueError(f"all weights must be on one device: {weights[0].device} and {w.device}")
        if w.numel():
            by_dtype.setdefault(w.dtype, []).append((w, codes, scales))
    for dtype, group in by_dtype.items():
        device = group[0][0].device
        rows = [
            [w.data_ptr() for w, _, _ in group], [c.data_ptr() for _, c, _ in group], [s.data_ptr() for _, _, s in group],
            [w.shape[0] for w, _, _ in group], [w.shape[1] for w, _, _ in group], [s.shape[1] for _, _, s in group],
            [w.stride(0) for w, _, _ in group], [c.stride(0) for _, c, _ in group],
            [s.stride(0) for _, _, s in group], [s.stride(1) for _, _, s in group],
        ]  # fmt: skip
        blocks = [s.numel() for _, _, s in group]
        first_block = [0, *itertools.accumulate(blocks)][:-1]
        # One small host -> device copy (rows 0-9: the table, 10: blocks, 11: first blocks); the
        # block -> weight map is expanded on the device, without a sync (`output_size` is known).
        packed = int64_table_to_device([*rows, blocks, first_block], device)
        table, first_block_on_device = packed[:10], packed[11]
        total_blocks = sum(blocks)
        weight_of_block = torch.repeat_interleave(
            torch.arange(len(group), dtype=torch.int32, device=device), packed[10], output_size=total_blocks
        )
        aligned = all(ptr % 16 == 0 for ptr in rows[0] + rows[1]) and all(v % 16 == 0 for row in (rows[3], rows[4], rows[6], rows[7]) for v in row)
        _quantize_weights_grouped_kernel[(total_blocks,)](
            table, weight_of_block, first_block_on_device, len(group),
            TINY=FP32_TINY, FP32_MAX=torch.finfo(torch.float32).max, FP8_MAX=E4M3_MAX, BLOCK_N=BLOCK, BLOCK_K=BLOCK,
            POW2=pow2_scale, W_DTYPE=TRITON_DTYPES[dtype], ALIGNED=aligned, ROWS_PER_PASS=GROUPED_LAUNCH["rows_per_pass"],
            TE_RULE=te_rule, VALUE_FOR_INF=torch.finfo(dtype).max, num_warps=GROUPED_LAUNCH["num_warps"],
        )  # fmt: skip
