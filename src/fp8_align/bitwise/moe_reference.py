"""Pure-torch definitions of the bitwise Mixture-of-Experts operators (Qwen3-MoE's routed experts).

Routing (router logits -> top-k experts and their weights), the grouped block-FP8 GEMM (each row
times its own expert's weight) and the weighted combine of a token's K expert outputs. Each
function is the reference its Triton kernel (`fp8_align.bitwise.moe_kernels`) is tested against
and what `fp8_align.bitwise.ops` runs on CPU; the `check_*` functions are the input checks both
share, so every device refuses the same inputs. A token's result is defined from that token's
data alone (and its experts' weights); the kernels compute it so in any batch. (On CPU, torch's
FP32 matmul inside `fp8_block_gemm` may sum a 128-long slice in an order that depends on the row
count, MKL for 1, 2, 3 or 5 rows: the last FP32 bit, rarely visible after rounding to BF16.)
"""

from __future__ import annotations

import math

import torch

from fp8_align.quant import DEFAULT_GROUP_SIZE, FP8_DTYPE, fp8_block_gemm
from fp8_align.quant.blockwise import blockwise_scale_shape

#: Most routed experts a layer may have: the routing kernel reads a row's logits as one block.
MAX_ROUTED_EXPERTS = 512
#: Dtypes the GEMM and combine write (and the combine reads).
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Dtypes of the expert offsets and row experts.
INDEX_DTYPES = (torch.int32, torch.int64)


def check_route_inputs(router_logits: torch.Tensor, top_k: int) -> None:
    """Raise ValueError unless router_logits is [T, E] bf16/fp16/fp32 with 1 <= top_k <= E <= 512."""
    if router_logits.dim() != 2 or router_logits.dtype not in OUTPUT_DTYPES:
        raise ValueError(f"router_logits must be [T, E] bf16/fp16/fp32, got shape {tuple(router_logits.shape)} dtype {router_logits.dtype}")
    experts = router_logits.shape[1]
    if not 1 <= experts <= MAX_ROUTED_EXPERTS:
        raise ValueError(f"the router has {experts} experts; the bitwise routing takes 1 to {MAX_ROUTED_EXPERTS}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}] (the number of experts), got {top_k}")


def check_grouped_mm_inputs(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> None:
    """Raise ValueError unless x_fp8 [M, K] and w_fp8 [E, N, K] are e4m3, x_scale [M, ceil(K/128)]
    and w_scale [E, ceil(N/128), ceil(K/128)] float32, and out_dtype bf16/fp16/fp32."""
    if x_fp8.dim() != 2 or x_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"x_fp8 must be [M, K] float8_e4m3fn, got shape {tuple(x_fp8.shape)} dtype {x_fp8.dtype}")
    if w_fp8.dim() != 3 or w_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"w_fp8 must be [E, N, K] float8_e4m3fn, got shape {tuple(w_fp8.shape)} dtype {w_fp8.dtype}")
    (m, k), (experts, n, w_k) = x_fp8.shape, w_fp8.shape
    if w_k != k:
        raise ValueError(f"x_fp8 has K={k} columns but w_fp8 {tuple(w_fp8.shape)} has K={w_k}")
    groups = math.ceil(k / DEFAULT_GROUP_SIZE)
    if tuple(x_scale.shape) != (m, groups) or x_scale.dtype != torch.float32:
        raise ValueError(f"x_scale must be [{m}, {groups}] float32, got shape {tuple(x_scale.shape)} dtype {x_scale.dtype}")
    expected = (experts, *blockwise_scale_shape((n, k)))
    if tuple(w_scale.shape) != expected or w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale must be {list(expected)} float32 (one 128x128 grid per expert), got shape {tuple(w_scale.shape)} dtype {w_scale.dtype}")
    if out_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUTPUT_DTYPES}, got {out_dtype}")


def check_expert_offsets(expert_offsets: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError unless expert_offsets is [num_experts + 1] int32/int64. Its values are
    not read (that would sync a device): offsets[0] = 0, non-decreasing, offsets[E] = M."""
    if tuple(expert_offsets.shape) != (num_experts + 1,) or expert_offsets.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"expert_offsets must be [{num_experts + 1}] int32/int64 (E + 1 row offsets), got shape {tuple(expert_offsets.shape)} dtype {expert_offsets.dtype}"
        )


def check_combine_inputs(y: torch.Tensor, weights: torch.Tensor) -> None:
    """Raise ValueError unless y is [T, K, H] bf16/fp16/fp32 and weights [T, K] float32."""
    if y.dim() != 3 or y.dtype not in OUTPUT_DTYPES:
        raise ValueError(f"y must be [T, K, H] bf16/fp16/fp32, got shape {tuple(y.shape)} dtype {y.dtype}")
    if tuple(weights.shape) != tuple(y.shape[:2]) or weights.dtype != torch.float32:
        raise ValueError(f"weights must be [{y.shape[0]}, {y.shape[1]}] float32 (y's [T, K]), got shape {tuple(weights.shape)} dtype {weights.dtype}")


def moe_route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] bf16/fp16/fp32 -> (weights [T, top_k] float32, expert ids [T, top_k] int32).

    The logits are cast to FP32; a NaN logit is read as -inf. The experts are chosen by `top_k`
    repeated argmaxes over the experts not yet chosen, a tie going to the lowest expert index, so
    slot 0 holds the largest logit l_0 and the ids of a row are distinct (a row's -inf logits are
    chosen last, lowest index first). Weights, with e_k = exp(l_k - m) in FP32:

    - renormalize (Qwen3's norm_topk_prob): m = l_0 and w_k = e_k / s with
      s = ((e_0 + e_1) + e_2) + ... + e_{K-1}, summed left to right over the slots;
    - otherwise the softmax over all E experts at the chosen ones: m = the row's largest logit,
      w_k = e_k / (the sum of exp(l - m) over all E, in torch's order).

    A row whose largest logit is not finite (all -inf, or +inf) gets NaN weights.
    """
    check_route_inputs(router_logits, top_k)
    logits = router_logits.float()
    scores = logits.masked_fill(logits.isnan(), float("-inf"))
    experts = torch.arange(scores.shape[1], device=scores.device)
    available = torch.ones_like(scores, dtype=torch.bool)
    ids = []
    for _ in range(top_k):
        best = scores.masked_fill(~available, float("-inf")).amax(dim=1, keepdim=True)
        expert = torch.where(available & (scores == best), experts, scores.shape[1]).amin(dim=1)
        available[torch.arange(scores.shape[0], device=scores.device), expert] = False
        ids.append(expert)
    expert_ids = torch.stack(ids, dim=1)
    chosen = scores.gather(1, expert_ids)
    if renormalize:
        exps = torch.exp(chosen - chosen[:, :1])
        total = exps[:, 0]
        for slot in range(1, top_k):
            total = total + exps[:, slot]
        return exps / total[:, None], expert_ids.to(torch.int32)
    row_max = scores.amax(dim=1, keepdim=True)
    return torch.exp(chosen - row_max) / torch.exp(scores - row_max).sum(dim=1, keepdim=True), expert_ids.to(torch.int32)


def grouped_block_fp8_mm_reference(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    row_expert: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Row i of x_fp8 [M, K] e4m3 (scales x_scale [M, ceil(K/128)] float32) times the weight of
    expert row_expert[i] (w_fp8 [E, N, K] e4m3, w_scale [E, ceil(N/128), ceil(K/128)] float32;
    row_expert [M] integer in [0, E), rows in any order) -> [M, N] out_dtype: that row's
    `fp8_align.quant.fp8_block_gemm` with its expert's weight, accumulated in FP32, rounded once."""
    check_grouped_mm_inputs(x_fp8, x_scale, w_fp8, w_scale, out_dtype)
    if tuple(row_expert.shape) != (x_fp8.shape[0],) or row_expert.dtype not in INDEX_DTYPES:
        raise ValueError(f"row_expert must be [{x_fp8.shape[0]}] int32/int64, got shape {tuple(row_expert.shape)} dtype {row_expert.dtype}")
    out = torch.empty((x_fp8.shape[0], w_fp8.shape[1]), dtype=out_dtype, device=x_fp8.device)
    for expert in torch.unique(row_expert).tolist():
        rows = (row_expert == expert).nonzero()[:, 0]
        out[rows] = fp8_block_gemm(x_fp8[rows], x_scale[rows], w_fp8[expert], w_scale[expert], out_dtype)
    return out


def experts_of_rows(expert_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows] int64 expert of each row of an expert-sorted batch with offsets [E + 1]
    (rows offsets[e] .. offsets[e + 1] - 1 belong to expert e). No device sync."""
    rows = torch.arange(num_rows, dtype=expert_offsets.dtype, device=expert_offsets.device)
    return torch.searchsorted(expert_offsets[1:].contiguous(), rows, right=True)


def moe_combine_reference(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, K, H] bf16/fp16/fp32 (token t's K expert outputs, in its routing slots' order),
    weights [T, K] float32 -> [T, H] in y's dtype: acc = w_0 * y_0, then acc = acc + w_k * y_k for
    k = 1 .. K-1 in order, every product and sum rounded to FP32 on its own (no FMA), rounded once."""
    check_combine_inputs(y, weights)
    acc = weights[:, 0, None] * y[:, 0].float()
    for slot in range(1, y.shape[1]):
        acc = acc + weights[:, slot, None] * y[:, slot].float()
    return acc.to(y.dtype)
