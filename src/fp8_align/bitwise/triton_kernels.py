"""Triton kernels of the bitwise operators (CUDA, or CPU under TRITON_INTERPRET=1).

Each kernel's launch is fixed by its constants below and the tensor's inner size, never by the
number of rows, and each row (token) is computed by one program from that row alone: a token gets
the same bits in a batch of 1 or 512, in prefill or in decode. Pure-torch references:
`fp8_align.bitwise.reference` (RMSNorm, residual-add + RMSNorm, SiLU-and-mul) and
`fp8_align.quant.fp8_block_gemm` (the GEMM). Import only where Triton exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8_align.quant.blockwise import DEFAULT_BLOCK_SIZE

#: Most channels one RMSNorm program reads per step of its loop over the row (fewer for narrower
#: rows: the next power of two of the row width, a function of the width alone).
NORM_BLOCK = 1024
#: Output channels one SiLU-and-mul program writes.
ACT_BLOCK = 1024
#: The block-FP8 GEMM's one tile configuration: rows, columns, K slice (= the 128-wide scale group),
#: row tiles per L2 group, warps, stages.
GEMM_TILE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": DEFAULT_BLOCK_SIZE[1], "GROUP_M": 1, "num_warps": 4, "num_stages": 3}


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_res, stride_out, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0): optional residual add (rounded to the output dtype, stored), then RMSNorm."""
    row = tl.program_id(0).to(tl.int64)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_out + cols, x, mask=mask)
        xf = x.to(tl.float32)
        total += xf * xf
    inv_rms = 1.0 / tl.sqrt(tl.sum(total, axis=0) / n_cols + eps)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = x.to(tl.float32) * inv_rms * w.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., H] (and residual, same shape) -> (normed, new residual or None), x's dtype.
    Same contract as `reference.rms_norm_reference` / `fused_add_rms_norm_reference`."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    res2 = None if residual is None else residual.reshape(x2.shape).contiguous()
    out = torch.empty_like(x2)
    res_out = None if res2 is None else torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2 if res2 is None else res2, weight.contiguous(), out, out if res_out is None else res_out,
            x2.shape[1], x2.stride(0), x2.stride(0), out.stride(0), eps,
            HAS_RESIDUAL=res2 is not None, BLOCK=min(NORM_BLOCK, triton.next_power_of_2(x2.shape[1])), num_warps=4,
        )  # fmt: skip
    return out.reshape(x.shape), None if res_out is None else res_out.reshape(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_out, BLOCK: tl.constexpr):
    """Row program_id(0), output channels BLOCK * program_id(1) + [0, BLOCK)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d] in x's dtype (contract of `reference.silu_and_mul_reference`)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    d = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, ACT_BLOCK))](x2, out, d, x2.stride(0), out.stride(0), BLOCK=ACT_BLOCK, num_warps=4)
    return out.reshape(*x.shape[:-1], d)


@triton.jit
def _rope_kernel(pos_ptr, x_ptr, out_ptr, table_ptr, stride_x, stride_out, stride_table, HEAD_SIZE: tl.constexpr, HALF: tl.constexpr,
                 HALF_BLOCK: tl.constexpr, REST_BLOCK: tl.constexpr):  # fmt: skip
    """Token program_id(0), head program_id(1): each pair (x1, x2) of the first 2 * HALF channels
    becomes (x1 cos - x2 sin, x2 cos + x1 sin), every product and sum rounded to FP32 on its own
    (launched without FMA contraction, as the elementwise reference computes it), then rounded
    once to the output dtype; the other channels are copied."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_BLOCK)
    mask = i < HALF
    cos = tl.load(table_ptr + pos * stride_table + i, mask=mask, other=0.0)
    sin = tl.load(table_ptr + pos * stride_table + HALF + i, mask=mask, other=0.0)
    src = x_ptr + token * stride_x + head * HEAD_SIZE
    dst = out_ptr + token * stride_out + head * HEAD_SIZE
    x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + i, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + i, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    if REST_BLOCK > 0:
        j = 2 * HALF + tl.arange(0, REST_BLOCK)
        rest = j < HEAD_SIZE
        tl.store(dst + j, tl.load(src + j, mask=rest, other=0.0), mask=rest)


def rope_triton(positions: torch.Tensor, x: torch.Tensor, table: torch.Tensor, head_size: int, rotary_dim: int) -> torch.Tensor:
    """Contract of `reference.apply_rope`: x [T, heads * head_size] (unit column stride) at
    `positions` [T] with the FP32 table [max_pos, rotary_dim] -> new contiguous tensor, x's dtype."""
    tokens, heads = x.shape[0], x.shape[-1] // head_size
    out = torch.empty((tokens, heads * head_size), dtype=x.dtype, device=x.device)
    half, rest = rotary_dim // 2, head_size - rotary_dim
    if tokens:
        _rope_kernel[(tokens, heads)](
            positions, x, out, table, x.stride(0), out.stride(0), table.stride(0), HEAD_SIZE=head_size, HALF=half,
            HALF_BLOCK=triton.next_power_of_2(half), REST_BLOCK=triton.next_power_of_2(rest) if rest else 0, num_warps=1,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out


@triton.jit
def _block_fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K,
    stride_am, stride_asm, stride_asg, stride_bn, stride_bsn, stride_bsk, stride_cm,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SCALE_N: tl.constexpr,
):  # fmt: skip
    """C tile program_id(0) (tiles taken GROUP_M row tiles at a time, for L2 reuse of B) = sum over
    K slices of (A codes . B codes^T) * (a_scale[row, slice] * b_scale[column // SCALE_N, slice]) in
    FP32, K slices in order, + bias, rounded once."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_m
    pid_n = (pid % group) // group_m
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + cols[None, :] * stride_bn + ks[:, None], mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        a_scale = tl.load(a_scale_ptr + rows * stride_asm + kb * stride_asg, mask=row_mask, other=0.0)
        b_scale = tl.load(b_scale_ptr + (cols // SCALE_N) * stride_bsn + kb * stride_bsk, mask=col_mask, other=0.0)
        acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def block_fp8_gemm_fixed_tile(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: dict[str, int] | None = None,
) -> torch.Tensor:
    """Write `fp8_block_gemm(x_fp8, x_scale, w_fp8, w_scale) (+ bias)` into `out` [M, N] (any row
    stride, unit column stride; bf16/fp16/fp32) with the one tile configuration `GEMM_TILE`
    (`tile` overrides it: the benchmark that chose it compares others).

    x_fp8 [M, K] e4m3 (unit column stride), x_scale [M, ceil(K/128)] float32 (any strides),
    w_fp8 [N, K] e4m3 contiguous rows, w_scale [ceil(N/128), ceil(K/128)] float32 (one shard's grid).
    """
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    tile = GEMM_TILE if tile is None else tile
    if m:
        grid = (triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]),)
        _block_fp8_gemm_kernel[grid](
            x_fp8, x_scale, w_fp8, w_scale, out if bias is None else bias, out, m, n, k,
            x_fp8.stride(0), x_scale.stride(0), x_scale.stride(1), w_fp8.stride(0), w_scale.stride(0), w_scale.stride(1),
            out.stride(0), HAS_BIAS=bias is not None, SCALE_N=DEFAULT_BLOCK_SIZE[0], **tile,
        )  # fmt: skip
    return out
