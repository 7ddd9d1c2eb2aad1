"""The checks of `fp8_align.bitwise.fp8_cache_attention` that run both on CPU (the Triton
interpreter, tests/test_fp8_cache_attention.py) and on the GPU (tests/test_gpu_bitwise.py).

One paged E4M3 cache (blocks shuffled, as a fragmented cache is) holds several sequences; every
token's row must come out with the same bits whether the token is attended in a whole-sequence
prefill, in a chunk of a chunked prefill (other tokens before it already cached) or as a decode
query beside other sequences' decode queries; and every row must be close to the FP32 reference
of the same cache contents (`attention_reference` with the scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8_align.bitwise.fp8_cache_attention import ATTENTION_TILING, AttentionTiling, fp8_cache_attention
from fp8_align.hf_training.attention import KVCacheScales, PackedBatch, attention_reference
from fp8_align.quant.scales import quantize_with_scale

BLOCK_SIZE = 16


@dataclass(frozen=True)
class PagedCase:
    """Packed q [T, Hq*D], k/v [T, Hk*D] (BF16) of sequences of `lengths`, their E4M3 cache and layout."""

    lengths: list[int]
    head_size: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scales: KVCacheScales
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor

    @property
    def starts(self) -> list[int]:
        return [sum(self.lengths[:i]) for i in range(len(self.lengths))]

    def attend(self, picks: list[tuple[int, int, int]], tiling: AttentionTiling = ATTENTION_TILING) -> torch.Tensor:
        """One kernel launch with `tiling`: for each (sequence, first query position, query count)
        the queries at those positions over the sequence's keys up to the last of them -> [queries, Hq*D]."""
        heads, dim = self.q.shape[1] // self.head_size, self.head_size
        device = self.q.device
        rows = torch.cat([torch.arange(self.starts[s] + first, self.starts[s] + first + count) for s, first, count in picks])
        query = self.q[rows.to(device)].view(-1, heads, dim).contiguous()
        counts = torch.tensor([count for _, _, count in picks], dtype=torch.int32)
        query_start = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0, dtype=torch.int32)]).to(device)
        seq_lens = torch.tensor([first + count for _, first, count in picks], dtype=torch.int32, device=device)
        table = self.block_table[[s for s, _, _ in picks]].contiguous()
        out = torch.empty_like(query)
        fp8_cache_attention(query, self.key_cache, self.value_cache, table, query_start, seq_lens, dim**-0.5,
                            self.scales.k_scale, self.scales.v_scale, out, tiling)  # fmt: skip
        return out.view(query.shape[0], heads * dim)


def make_case(lengths: list[int], heads: int, kv_heads: int, head_size: int, device: str, seed: int = 0) -> PagedCase:
    """Random BF16 q/k/v (|K| up to ~40, so the K scale matters), per-tensor scales fitting them,
    the cache written as `E4M3(x / scale)` into shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q = torch.randn(tokens, heads * head_size, generator=g).to(torch.bfloat16)
    k = (torch.randn(tokens, kv_heads * head_size, generator=g) * 8).to(torch.bfloat16)
    v = torch.randn(tokens, kv_heads * head_size, generator=g).to(torch.bfloat16)
    scales = KVCacheScales(torch.tensor([48.0 / 448]), torch.tensor([5.0 / 448]))
    counts = [-(-n // BLOCK_SIZE) for n in lengths]
    order = torch.randperm(sum(counts), generator=g)
    key_cache = torch.zeros(sum(counts), BLOCK_SIZE, kv_heads, head_size, dtype=torch.float8_e4m3fn)
    value_cache = torch.zeros_like(key_cache)
    block_table = torch.zeros(len(lengths), max(counts), dtype=torch.int32)
    k_codes = quantize_with_scale(k.float(), scales.k_scale).view(tokens, kv_heads, head_size)
    v_codes = quantize_with_scale(v.float(), scales.v_scale).view(tokens, kv_heads, head_size)
    used, start = 0, 0
    for i, (n, count) in enumerate(zip(lengths, counts)):
        block_table[i, :count] = order[used : used + count].to(torch.int32)
        for t in range(n):
            block, slot = block_table[i, t // BLOCK_SIZE], t % BLOCK_SIZE
            key_cache[block, slot], value_cache[block, slot] = k_codes[start + t], v_codes[start + t]
        used, start = used + count, start + n
    to = lambda x: x.to(device)  # noqa: E731
    return PagedCase(list(lengths), head_size, to(q), to(k), to(v), KVCacheScales(to(scales.k_scale), to(scales.v_scale)),
                     to(key_cache), to(value_cache), to(block_table))  # fmt: skip


def check_case(case: PagedCase, chunk: int, tiling: AttentionTiling = ATTENTION_TILING) -> float:
    """Assert the rows' bit equality (kernel launched with `tiling`) across prefill, chunked
    prefill (chunks of `chunk` queries) and decode; return the largest |kernel - FP32 reference|
    over all tokens."""
    full = case.attend([(s, 0, n) for s, n in enumerate(case.lengths)], tiling)
    starts = case.starts
    for s, n in enumerate(case.lengths):
        for first in range(0, n, chunk):
            count = min(chunk, n - first)
            chunked = case.attend([(s, first, count)], tiling)
            assert torch.equal(chunked, full[starts[s] + first : starts[s] + first + count]), ("chunked prefill", s, first)
    for back in (0, 1, 2, 9):  # decode steps at several depths, every sequence long enough in one batch
        picks = [(s, n - 1 - back, 1) for s, n in enumerate(case.lengths) if n - 1 - back >= 0]
        decode = case.attend(picks, tiling)
        expected = torch.stack([full[starts[s] + first] for s, first, _ in picks])
        assert torch.equal(decode, expected), ("decode", back)
    batch = PackedBatch.from_lengths(case.lengths, case.q.device)
    reference = attention_reference(case.q, case.k, case.v, batch, case.head_size, kv_scales=case.scales)
    return (full.float() - reference.float()).abs().max().item()
