"""Triton kernels of the bitwise Mixture-of-Experts operators (CUDA, or CPU under TRITON_INTERPRET=1).

Routing (one program per token), the grouped block-FP8 GEMM of expert-sorted rows and the weighted
combine of a token's expert outputs (one program per token and column block). Each launch is fixed
by the module's constants and the operands' sizes, never by the routing, and every row is computed
from its own data (and its expert's weight) in an order fixed by those constants: a token gets the
same bits alone, in any subset or in any order of a batch. Pure-torch references:
`fp8_align.bitwise.moe_reference`. Import only where Triton exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8_align.bitwise.moe_reference import check_combine_inputs, check_expert_offsets, check_grouped_mm_inputs, check_route_inputs
from fp8_align.bitwise.triton_kernels import GEMM_TILE
from fp8_align.quant.blockwise import DEFAULT_BLOCK_SIZE

#: Output channels one combine program writes.
COMBINE_BLOCK = 1024
#: Warps of a routing program (one row of at most 512 logits).
ROUTE_WARPS = 4


@triton.jit
def _moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                      RENORMALIZE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Row program_id(0): TOP_K argmaxes over the experts not yet chosen (NaN read as -inf, ties
    to the lowest index), then the weights of `moe_route_reference` (renormalized: the chosen
    exps summed left to right over the slots; else the softmax over all experts)."""
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + row * stride_logits + experts, mask=valid, other=float("-inf")).to(tl.float32)
    scores = tl.where(logits == logits, logits, float("-inf"))
    row_max = tl.max(scores, axis=0)
    slots = tl.arange(0, SLOTS)
    chosen_ids = tl.zeros([SLOTS], dtype=tl.int32)
    exps = tl.zeros([SLOTS], dtype=tl.float32)
    chosen_total = 0.0
    available = valid
    for slot in tl.static_range(TOP_K):
        best = tl.max(tl.where(available, scores, float("-inf")), axis=0)
        expert = tl.min(tl.where(available & (scores == best), experts, BLOCK), axis=0)
        available = available & (experts != expert)
        e = tl.exp(best - row_max)
        chosen_total = chosen_total + e
        chosen_ids = tl.where(slots == slot, expert, chosen_ids)
        exps = tl.where(slots == slot, e, exps)
    if RENORMALIZE:
        total = chosen_total
    else:
        total = tl.sum(tl.where(valid, tl.exp(scores - row_max), 0.0), axis=0)
    out = row * TOP_K + slots
    tl.store(weights_ptr + out, tl.div_rn(exps, total), mask=slots < TOP_K)
    tl.store(ids_ptr + out, chosen_ids, mask=slots < TOP_K)


def moe_route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] bf16/fp16/fp32 (E <= 512) -> (weights [T, top_k] float32, ids
    [T, top_k] int32): the contract of `moe_reference.moe_route_reference`. Expert ids equal the
    reference's; weights too, up to the exp (the GPU's differs from torch's) and, without
    `renormalize`, the order of the sum over the E experts. ValueError on bad input."""
    check_route_inputs(router_logits, top_k)
    logits = router_logits.contiguous()
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens:
        _moe_route_kernel[(tokens,)](
            logits, weights, ids, experts, logits.stride(0), TOP_K=top_k, SLOTS=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize, BLOCK=triton.next_power_of_2(experts), num_warps=ROUTE_WARPS,
        )  # fmt: skip
    return weights, ids


def expert_row_tiles(expert_offsets: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """The row tiles of an expert-sorted batch of `num_rows` rows with offsets [E + 1]: int32
    [cdiv(num_rows, block_m) + E, 3], per tile (expert, first row, the expert's end row), the
    tiles of expert 0 first, each expert's rows cut into cdiv(count, block_m) tiles of block_m
    rows; the rows past the last tile get expert -1. Torch ops only: no device sync."""
    num_experts = expert_offsets.shape[0] - 1
    offsets = expert_offsets.to(torch.int64)
    tiles_per_expert = (offsets[1:] - offsets[:-1] + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per_expert, dim=0)
    tiles = torch.arange(triton.cdiv(num_rows, block_m) + num_experts, device=offsets.device)
    expert = torch.searchsorted(tile_ends, tiles, right=True)
    used = expert < num_experts
    expert = expert.clamp_max(num_experts - 1)
    first_row = offsets[expert] + (tiles - tile_ends[expert] + tiles_per_expert[expert]) * block_m
    return torch.stack((torch.where(used, expert, -1), first_row, offsets[expert + 1]), dim=1).to(torch.int32)


@triton.jit
def _grouped_block_fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, tiles_ptr, N, K,
    stride_am, stride_asm, stride_asg, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr,
):  # fmt: skip
    """Row tile program_id(0) // cdiv(N, BLOCK_N) of `expert_row_tiles` (none past the last: return),
    column tile program_id(0) % cdiv(N, BLOCK_N): the tile's rows times their expert's weight with
    `triton_kernels._block_fp8_gemm_kernel`'s arithmetic (per K slice in order, FP32
    `acc += dot(a, b) * (a_scale * b_scale)`), rounded once."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = pid // tiles_n
    pid_n = pid % tiles_n
    expert = tl.load(tiles_ptr + tile * 3)
    if expert < 0:
        return
    first_row = tl.load(tiles_ptr + tile * 3 + 1)
    end_row = tl.load(tiles_ptr + tile * 3 + 2)
    rows = first_row.to(tl.int64) + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < end_row, cols < N
    b_expert = b_ptr + expert.to(tl.int64) * stride_be
    b_scale_expert = b_scale_ptr + expert.to(tl.int64) * stride_bse
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_expert + cols[None, :] * stride_bn + ks[:, None], mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        a_scale = tl.load(a_scale_ptr + rows * stride_asm + kb * stride_asg, mask=row_mask, other=0.0)
        b_scale = tl.load(b_scale_expert + (cols // SCALE_N) * stride_bsn + kb * stride_bsk, mask=col_mask, other=0.0)
        acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def grouped_block_fp8_gemm_triton(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Expert-sorted rows x_fp8 [M, K] e4m3 (x_scale [M, ceil(K/128)] float32, any strides) times
    their experts' weights w_fp8 [E, N, K] e4m3 (w_scale [E, ceil(N/128), ceil(K/128)] float32):
    rows expert_offsets[e] .. expert_offsets[e + 1] - 1 (offsets [E + 1] int32/int64 on x's device,
    from 0 to M) go to expert e. -> [M, N] out_dtype, each row `fp8_block_gemm` with its expert's
    weight (`moe_reference.grouped_block_fp8_mm_reference`) with `GEMM_TILE`'s tiles. The grid,
    (cdiv(M, BLOCK_M) + E) * cdiv(N, BLOCK_N) programs, does not depend on the routing, and the
    offsets are read on the device only. ValueError on bad shapes or dtypes."""
    check_grouped_mm_inputs(x_fp8, x_scale, w_fp8, w_scale, out_dtype)
    check_expert_offsets(expert_offsets, w_fp8.shape[0])
    rows, k = x_fp8.shape
    n = w_fp8.shape[1]
    out = torch.empty((rows, n), dtype=out_dtype, device=x_fp8.device)
    if rows:
        tiles = expert_row_tiles(expert_offsets, rows, GEMM_TILE["BLOCK_M"])
        x_codes, w_codes = x_fp8.contiguous(), w_fp8.contiguous()
        _grouped_block_fp8_gemm_kernel[(tiles.shape[0] * triton.cdiv(n, GEMM_TILE["BLOCK_N"]),)](
            x_codes, x_scale, w_codes, w_scale, out, tiles, n, k,
            x_codes.stride(0), x_scale.stride(0), x_scale.stride(1), w_codes.stride(0), w_codes.stride(1),
            w_scale.stride(0), w_scale.stride(1), w_scale.stride(2), out.stride(0),
            BLOCK_M=GEMM_TILE["BLOCK_M"], BLOCK_N=GEMM_TILE["BLOCK_N"], BLOCK_K=GEMM_TILE["BLOCK_K"], SCALE_N=DEFAULT_BLOCK_SIZE[0],
            num_warps=GEMM_TILE["num_warps"], num_stages=GEMM_TILE["num_stages"],
        )  # fmt: skip
    return out


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, out_ptr, hidden, top_k, stride_yt, stride_yk, stride_wt, stride_out, BLOCK: tl.constexpr):
    """Token program_id(0), channels BLOCK * program_id(1) + [0, BLOCK): acc = w_0 * y_0, then
    acc = acc + w_k * y_k over the slots in order (launched without FMA contraction), rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    y_row = y_ptr + token * stride_yt
    acc = tl.load(w_ptr + token * stride_wt) * tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
    for slot in range(1, top_k):
        weight = tl.load(w_ptr + token * stride_wt + slot)
        acc = acc + weight * tl.load(y_row + slot * stride_yk + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine_triton(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, K, H] bf16/fp16/fp32, weights [T, K] float32 -> [T, H] in y's dtype: the contract and
    arithmetic of `moe_reference.moe_combine_reference`. ValueError on bad shapes or dtypes."""
    check_combine_inputs(y, weights)
    outputs, w = y.contiguous(), weights.contiguous()
    tokens, top_k, hidden = outputs.shape
    out = torch.empty((tokens, hidden), dtype=y.dtype, device=y.device)
    if tokens and hidden:
        _moe_combine_kernel[(tokens, triton.cdiv(hidden, COMBINE_BLOCK))](
            outputs, w, out, hidden, top_k, outputs.stride(0), outputs.stride(1), w.stride(0), out.stride(0),
            BLOCK=COMBINE_BLOCK, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out
