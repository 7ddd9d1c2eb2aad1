"""Causal paged attention over an E4M3 KV cache with per-tensor scales, for the bitwise mode
(CUDA, or CPU under TRITON_INTERPRET=1; import only where Triton exists).

The cache holds codes `E4M3(x / scale)`. The kernel never rescales a key or value: it widens the
codes to FP16 (exact: every E4M3 value is an FP16 value) and applies the layer's scales where they
cost one multiply per score or per output, `S = (q . code_k) * (softmax_scale * k_scale)` and
`out = (sum_j p_j code_v_j) / l * v_scale`. The query is rounded to FP16 once (exact for |q| in
[2^-14, 65504], which the queries of BF16 models are), the probabilities to FP16 for the second
product; both products accumulate in FP32.

One program attends `BLOCK_Q` query tokens of one sequence times the `num_heads // num_kv_heads`
query heads of one KV head (`BLOCK_M` rows), walking the sequence's keys in `TILE`-key tiles from
the first, with an online softmax. The tile order and sizes are constants of the kernel, never
of the batch: a token's row sees the same tiles in the same order whether it is decoded alone,
decoded in a batch of 512, or sits anywhere in a prefill chunk (tiles past its own position are
fully masked for it and change none of its bits: the running max stays, the rescale factor is
exactly 1, the added terms are exact zeros). The grid is sized by the query tokens alone; there
is no split of a sequence's keys across programs. Pure-torch reference:
`fp8_align.hf_training.attention.attention_reference` with `kv_scales` (K/V read as
`bitwise.reference.fp8_kv_cache_reference`), tested against in tests/fp8_attention_cases.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class AttentionTiling:
    """The kernel's launch constants: rows per program (query tokens x grouped heads, padded),
    keys per tile, warps, software-pipelining stages. They fix the reduction order, so engine and
    trainer must run the same ones."""

    block_m: int = 16
    tile: int = 64
    num_warps: int = 2
    num_stages: int = 3
    #: both products in two halves of the head dimension (Q.K^T accumulated low half then high
    #: half into one FP32 sum, P.V per half): half the operand registers, each sum in the same order
    split_head: bool = False


#: `FP8Config.bitwise_attention_tiling` -> the tiling the bitwise engine runs, prefill and decode
#: (benchmarks/bitwise_kernels.py sweeps the candidates; benchmarks/results_log.md). "tile64": the
#: fastest rollout on an H200 at Qwen3-8B's heads; "tile128_split": the fastest decode at Qwen3-1.7B's
#: and Qwen3-8B's heads on an H100.
ATTENTION_TILINGS: dict[str, AttentionTiling] = {
    "tile64": AttentionTiling(),
    "tile128_split": AttentionTiling(block_m=16, tile=128, num_warps=4, num_stages=3, split_head=True),
}
#: The default tiling (`FP8Config.bitwise_attention_tiling`'s default).
ATTENTION_TILING = ATTENTION_TILINGS["tile64"]
#: `FP8Config.bitwise_attention_tiling` -> the tiling the trainer's whole-sequence prefill over its
#: paged copy runs (`paged_triton_attention`). For "tile64", the engine's with more query rows per
#: program, so each K/V tile is loaded for more queries: with two warps Triton lays the MMA out with
#: both warps along the keys for up to 64 rows, so each row's products, sums and rescales run in the
#: engine's order (tests/test_gpu_bitwise.py checks every row's bits against the engine's on the
#: GPU). Other tilings are taken as the engine runs them: a row's bits do not depend on where its
#: query block starts (the kernel's invariance, which the engine's decode-equals-prefill proof shows).
TRAINER_TILINGS: dict[str, AttentionTiling] = {**ATTENTION_TILINGS, "tile64": replace(ATTENTION_TILING, block_m=32)}
#: The trainer's tiling for the default.
TRAINER_TILING = TRAINER_TILINGS["tile64"]
_LOG2E = math.log2(math.e)


@triton.jit
def _codes(cache_ptr, physical, slot, kv_head, stride_block, stride_slot, stride_head, dims, mask):
    """A tile's codes [keys, dims] of one KV head, widened to FP16 (exact)."""
    offsets = physical[:, None] * stride_block + slot[:, None] * stride_slot + kv_head * stride_head + dims[None, :]
    return tl.load(cache_ptr + offsets, mask=mask, other=0.0).to(tl.float16)


@triton.jit
def _fp8_cache_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, k_scale_ptr, v_scale_ptr,
    softmax_scale_log2, num_seqs,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head, stride_block_table,
    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr, SPLIT_HEAD: tl.constexpr,
):  # fmt: skip
    """Program (p, h): query block p of the packed batch (`query_start // BLOCK_Q + seq` is the first
    block of sequence `seq`), KV head h."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The sequence owning query block `block`: the last one whose first block is <= block.
    low = 0
    high = num_seqs
    while low < high:
        mid = (low + high) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= block:
            low = mid + 1
        else:
            high = mid
    seq = low - 1
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    local_block = block - (query_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    query_pos = local_block * BLOCK_Q + rows // GROUP  # position among this step's query tokens
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (query_pos < query_len)
    token = (query_start + query_pos).to(tl.int64)
    q_rows = q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head
    out_rows = out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head
    if SPLIT_HEAD:
        dims_lo = tl.arange(0, HEAD_PAD // 2)
        dims_hi = HEAD_PAD // 2 + dims_lo
        lo_ok = dims_lo < HEAD_SIZE
        hi_ok = dims_hi < HEAD_SIZE
        q_lo = tl.load(q_rows + dims_lo[None, :], mask=row_ok[:, None] & lo_ok[None, :], other=0.0).to(tl.float16)
        q_hi = tl.load(q_rows + dims_hi[None, :], mask=row_ok[:, None] & hi_ok[None, :], other=0.0).to(tl.float16)
        acc_lo = tl.zeros([BLOCK_M, HEAD_PAD // 2], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, HEAD_PAD // 2], dtype=tl.float32)
    else:
        dims = tl.arange(0, HEAD_PAD)
        dim_ok = dims < HEAD_SIZE
        q = tl.load(q_rows + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float16)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    score_scale = tl.load(k_scale_ptr) * softmax_scale_log2
    key_limit = context + query_pos  # the last key each row may see
    num_keys = context + tl.minimum((local_block + 1) * BLOCK_Q, query_len)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    offsets = tl.arange(0, TILE)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    for start in range(0, num_keys, TILE):
        key = start + offsets
        key_ok = key < num_keys
        physical = tl.load(table_row + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = key % BLOCK_SIZE
        if SPLIT_HEAD:
            mask_lo = key_ok[:, None] & lo_ok[None, :]
            mask_hi = key_ok[:, None] & hi_ok[None, :]
            k_lo = _codes(k_cache_ptr, physical, slot, kv_head, stride_k_block, stride_k_slot, stride_k_head, dims_lo, mask_lo)
            k_hi = _codes(k_cache_ptr, physical, slot, kv_head, stride_k_block, stride_k_slot, stride_k_head, dims_hi, mask_hi)
            scores = tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo))) * score_scale
        else:
            mask = key_ok[:, None] & dim_ok[None, :]
            k = _codes(k_cache_ptr, physical, slot, kv_head, stride_k_block, stride_k_slot, stride_k_head, dims, mask)
            scores = tl.dot(q, tl.trans(k)) * score_scale
        visible = row_ok[:, None] & (key[None, :] <= key_limit[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that see no key yet
        rescale = tl.exp2(running_max - shift)
        p = tl.exp2(scores - shift[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        if SPLIT_HEAD:
            v_lo = _codes(v_cache_ptr, physical, slot, kv_head, stride_v_block, stride_v_slot, stride_v_head, dims_lo, mask_lo)
            acc_lo = acc_lo * rescale[:, None] + tl.dot(p.to(tl.float16), v_lo)
            v_hi = _codes(v_cache_ptr, physical, slot, kv_head, stride_v_block, stride_v_slot, stride_v_head, dims_hi, mask_hi)
            acc_hi = acc_hi * rescale[:, None] + tl.dot(p.to(tl.float16), v_hi)
        else:
            v = _codes(v_cache_ptr, physical, slot, kv_head, stride_v_block, stride_v_slot, stride_v_head, dims, mask)
            acc = acc * rescale[:, None] + tl.dot(p.to(tl.float16), v)
        running_max = new_max

    v_scale = tl.load(v_scale_ptr)
    if SPLIT_HEAD:
        out_lo = acc_lo / total[:, None] * v_scale
        out_hi = acc_hi / total[:, None] * v_scale
        tl.store(out_rows + dims_lo[None, :], out_lo.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & lo_ok[None, :])
        tl.store(out_rows + dims_hi[None, :], out_hi.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & hi_ok[None, :])
    else:
        out = acc / total[:, None] * v_scale
        tl.store(out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def fp8_cache_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    out: torch.Tensor,
    tiling: AttentionTiling = ATTENTION_TILING,
) -> torch.Tensor:
    """Causal attention of the newest `query_start[i+1] - query_start[i]` tokens of each sequence i
    over its first `seq_lens[i]` cached keys; returns `out`, written in place.

    q [T, Hq, D] BF16 (head stride any, last dim contiguous); key_cache / value_cache
    [blocks, block_size, Hk, D] float8_e4m3fn codes (vLLM's TRITON_ATTN layout, views of its
    [blocks, 2, block_size, Hk, D] cache allowed); block_table [B, max blocks] int32; query_start
    [B + 1] int32 (cumulative query lengths from 0); seq_lens [B] int32 (keys including this step's);
    k_scale / v_scale FP32 tensors whose first element is the layer's dequantization multiplier;
    out [T, Hq, D] BF16. Hq must be a multiple of Hk."""
    tokens, heads, head_size = q.shape
    kv_heads = key_cache.shape[2]
    if key_cache.dtype != torch.float8_e4m3fn or value_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"the KV cache must hold float8_e4m3fn codes (got {key_cache.dtype}, {value_cache.dtype})")
    if heads % kv_heads or q.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads with contiguous head dimensions expected")
    if tiling.split_head and triton.next_power_of_2(head_size) < 32:
        raise ValueError(f"split_head needs a head dimension of 32 or more (got {head_size}): each half is an MMA's K")
    group = heads // kv_heads
    block_m = max(tiling.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    num_seqs = seq_lens.shape[0]
    grid = (tokens // block_q + num_seqs, kv_heads)
    _fp8_cache_attention_kernel[grid](
        out, q, key_cache, value_cache, block_table, seq_lens, query_start, k_scale, v_scale,
        softmax_scale * _LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
        GROUP=group, HEAD_SIZE=head_size, HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE=tiling.tile, SPLIT_HEAD=tiling.split_head,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )  # fmt: skip
    return out
