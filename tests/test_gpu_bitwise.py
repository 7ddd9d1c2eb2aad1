"""The bitwise operators on CUDA (vLLM 0.22): each kernel against its pure-torch reference, every
kernel's rows independent of the batch, TRITON_ATTN's decode step equal to its full-sequence
prefill, and BitwiseForward's gradients against plain autograd through the references.

The kernels round FP32 results to BF16 once, like the references; they may differ from them by
the order of FP32 sums (and Triton's exp), so a kernel-vs-reference comparison allows one BF16 unit
in the last place (rtol 2^-7 covers one ulp anywhere in a binade). The FP8 GEMM also inherits
Hopper's FP8 tensor-core accumulation inside each 128-wide K slice (about 14 bits kept, as
DeepSeek-V3 reports; on the H100 its results were off the FP32 reference by up to 0.0024 where
values cancel), so it is allowed 2^-12 of the sum of absolute products on top. Batch independence
and engine-vs-trainer agreement are exact. The whole-engine proof is benchmarks/on_policy_bitwise.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import fp8_align.bitwise.ops  # noqa: F401  (registers torch.ops.fp8_align.bitwise_*)
from fp8_align import FP8Config
from fp8_align.bitwise.reference import RopeSpec, fused_add_rms_norm_reference, rms_norm_reference, rope_table, silu_and_mul_reference
from fp8_align.quant import fp8_block_gemm, quantize_activation_groupwise

pytestmark = pytest.mark.gpu

BF16_ULP = 2**-7
#: Sub-batches whose rows must equal the same rows of a 512-row launch.
SUB_BATCHES = [slice(0, 1), slice(5, 12), slice(100, 164), slice(0, 511)]


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").to(dtype)


@pytest.mark.parametrize("hidden", [576, 4096, 128])
def test_norm_and_activation_kernels_match_references_and_the_batch_does_not_matter(hidden: int) -> None:
    x, residual, weight = _randn(512, hidden, seed=1), _randn(512, hidden, seed=2), _randn(hidden, seed=3)
    normed = torch.ops.fp8_align.bitwise_rms_norm(x, weight, 1e-6)
    fused, summed = torch.ops.fp8_align.bitwise_fused_add_rms_norm(x, residual, weight, 1e-6)
    gate_up = _randn(512, 2 * hidden, seed=4)
    act = torch.ops.fp8_align.bitwise_silu_and_mul(gate_up)
    torch.testing.assert_close(normed, rms_norm_reference(x, weight, 1e-6), rtol=BF16_ULP, atol=1e-30)
    ref_fused, ref_summed = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(fused, ref_fused, rtol=BF16_ULP, atol=1e-30)
    torch.testing.assert_close(act, silu_and_mul_reference(gate_up), rtol=BF16_ULP, atol=1e-30)
    for rows in SUB_BATCHES:
        assert torch.equal(torch.ops.fp8_align.bitwise_rms_norm(x[rows], weight, 1e-6), normed[rows])
        assert torch.equal(torch.ops.fp8_align.bitwise_fused_add_rms_norm(x[rows], residual[rows], weight, 1e-6)[0], fused[rows])
        assert torch.equal(torch.ops.fp8_align.bitwise_silu_and_mul(gate_up[rows]), act[rows])


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize(("shards", "k"), [([4096, 1024, 1024], 4096), ([24576], 4096), ([4096], 12288), ([576, 192, 192], 576), ([200], 200)])
def test_fixed_tile_linear_matches_the_reference_for_every_batch(shards: list[int], k: int, with_bias: bool) -> None:
    """The engine's FP8 linear (`FixedTileBlockFp8Kernel`) on a stacked weight, through CUTLASS
    (whole 128-blocks, K <= 3N, no bias) or the Triton GEMM: within one BF16 ulp plus the FP8
    accumulation bound of the FP32 reference per shard, and the same bits for every sub-batch."""
    from types import SimpleNamespace

    from fp8_align.rounding import Rounding
    from fp8_align.quant.shards import quantize_shards
    from fp8_align.vllm_plugin.kernels.fixed_tile import FixedTileBlockFp8Kernel
    from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState

    weight = _randn(sum(shards), k, seed=5) * 0.05
    codes, scales = quantize_shards(weight, shards, False)
    state = Fp8AlignLayerState("linear", "test", Rounding(), shard_sizes=shards)
    layer = SimpleNamespace(weight=codes, weight_scale_inv=scales, fp8_align=state)
    x, bias = _randn(512, k, seed=6), _randn(sum(shards), seed=7) if with_bias else torch.zeros(sum(shards), device="cuda")
    out = FixedTileBlockFp8Kernel().apply(layer, x, bias if with_bias else None)
    x_fp8, x_scale = quantize_activation_groupwise(x)
    start, scale_start = 0, 0
    for size in shards:
        blocks = -(-size // 128)
        shard_codes, shard_scales = codes[start : start + size], scales[scale_start : scale_start + blocks]
        ref = fp8_block_gemm(x_fp8, x_scale, shard_codes, shard_scales, torch.float32) + bias[start : start + size].float()
        magnitude = fp8_block_gemm(x_fp8.float().abs().to(x_fp8.dtype), x_scale, shard_codes.float().abs().to(codes.dtype), shard_scales, torch.float32)
        error = (out[:, start : start + size].float() - ref).abs()
        assert (error <= BF16_ULP * ref.abs() + 2**-12 * magnitude).all(), error.max().item()
        start, scale_start = start + size, scale_start + blocks
    for rows in SUB_BATCHES:
        assert torch.equal(FixedTileBlockFp8Kernel().apply(layer, x[rows], bias if with_bias else None), out[rows])


def test_fixed_tile_calls_pick_cutlass_only_where_its_one_tile_holds() -> None:
    """The plan of a layer depends on its shape alone: one CUTLASS call for Qwen3-8B's stacked
    qkv / gate_up and its down_proj (K = 3N), the Triton GEMM where vLLM's CUTLASS dispatch turns to
    Stream-K (K > 3N), where blocks are partial (SmolLM2), and where the layer has a bias."""
    from fp8_align.vllm_plugin.kernels.fixed_tile import CUTLASS, TRITON, fixed_tile_calls

    sm = torch.cuda.get_device_capability()
    assert sm == (9, 0), "the plan below is SM90's"
    assert [gemm for _, _, gemm in fixed_tile_calls((4096, 1024, 1024), 4096, sm, False)] == [CUTLASS]
    assert [gemm for _, _, gemm in fixed_tile_calls((4096,), 12288, sm, False)] == [CUTLASS]
    assert [gemm for _, _, gemm in fixed_tile_calls((4096,), 14336, sm, False)] == [TRITON]
    assert [gemm for _, _, gemm in fixed_tile_calls((576, 192, 192), 576, sm, False)] == [TRITON] * 3
    assert [gemm for _, _, gemm in fixed_tile_calls((4096, 1024, 1024), 4096, sm, True)] == [TRITON]


@pytest.mark.parametrize(("head_size", "rotary_dim"), [(128, 128), (64, 32)])
def test_rope_kernel_is_the_reference_and_rows_do_not_depend_on_the_batch(head_size: int, rotary_dim: int) -> None:
    """The Triton RoPE computes the elementwise reference's FP32 operations one by one (no FMA
    contraction), so it equals `apply_rope` bit for bit; strided q (a view of a stacked qkv) too."""
    from fp8_align.bitwise.reference import apply_rope

    table = rope_table(RopeSpec(head_size=head_size, rotary_dim=rotary_dim, theta=1e6, max_positions=4096), "cuda")
    positions = torch.randint(0, 4096, (512,), device="cuda")
    qkv = _randn(512, 48 * head_size, seed=8)
    q, k = qkv[:, : 32 * head_size], qkv[:, 32 * head_size : 40 * head_size]
    q_out, k_out = torch.ops.fp8_align.bitwise_rope(positions, q, k, table, head_size, rotary_dim)
    assert torch.equal(q_out, apply_rope(positions, q, table, head_size, rotary_dim))
    assert torch.equal(k_out, apply_rope(positions, k, table, head_size, rotary_dim))
    for rows in SUB_BATCHES:
        q_rows, k_rows = torch.ops.fp8_align.bitwise_rope(positions[rows], q[rows], k[rows], table, head_size, rotary_dim)
        assert torch.equal(q_rows, q_out[rows]) and torch.equal(k_rows, k_out[rows])


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(32, 8, 128), (9, 3, 64)])
def test_triton_attention_decode_step_equals_the_full_sequence(heads: int, kv_heads: int, head_size: int, kv_cache: str) -> None:
    """A token attended in a decode step (one query per sequence, several sequences, other batch
    mates, a fragmented cache) is the trainer's full-sequence row of that token, bit for bit, over a
    BF16 cache and over an E4M3 cache written with per-layer scales; and close to the FP32 reference
    of the same cache contents (2e-2: BF16 probabilities and products in the kernel). The FP8 cache's
    own effect is larger than that, so the scales demonstrably reach the kernel."""
    from fp8_align.hf_training.attention import ATTENTION_BLOCK_SIZE, KVCacheScales, PackedBatch, attention_reference, paged_triton_attention
    from fp8_align.vllm_plugin.compat import batch_invariant_kernels

    kernels = batch_invariant_kernels()
    lengths = [5, 77, 300, 129]
    tokens = sum(lengths)
    q, k, v = _randn(tokens, heads * head_size, seed=10), _randn(tokens, kv_heads * head_size, seed=11), _randn(tokens, kv_heads * head_size, seed=12)
    k = k * 8  # |K| up to ~40: the K scale matters
    scales = None if kv_cache == "bf16" else KVCacheScales(torch.tensor([48.0 / 448], device="cuda"), torch.tensor([6.0 / 448], device="cuda"))
    batch = PackedBatch.from_lengths(lengths, "cuda")
    full = paged_triton_attention(kernels, q, k, v, batch, head_size, scales)
    reference = attention_reference(q, k, v, batch, head_size, kv_scales=scales)
    torch.testing.assert_close(full.float(), reference.float(), rtol=2e-2, atol=2e-2)
    if scales is not None:
        unquantized = attention_reference(q, k, v, batch, head_size)
        assert (reference.float() - unquantized.float()).abs().max() > 4e-2
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for cut in (1, 2, 17):  # decode the last `cut` tokens' positions of each sequence, one query each
        for back in range(cut):
            # sequence i truncated to its first (length - back) tokens; its last token is the query
            picks = [(s, n - back) for s, n in zip(starts, lengths) if n - back > 0]
            q_rows = torch.stack([q[s + n - 1] for s, n in picks])
            decode = _decode_step(kernels, q_rows, k, v, picks, head_size, scales)
            expected = torch.stack([full[s + n - 1] for s, n in picks])
            assert torch.equal(decode, expected), (cut, back, kv_cache)
    assert ATTENTION_BLOCK_SIZE == 16


@pytest.mark.parametrize("split_head", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(32, 8, 128), (9, 3, 64), (16, 16, 64)])
def test_fp8_cache_attention_rows_are_invariant_and_close_to_the_reference(heads: int, kv_heads: int, head_size: int, split_head: bool) -> None:
    """fp8_align's FP8-cache kernel, compiled, with the engine's tiling and with the head dimension
    taken the other way (`split_head`): every token's row has the same bits in a whole prefill, in
    each 37-query chunk of a chunked prefill and in decode steps beside the other sequences
    (tests/fp8_attention_cases.py), and is within 2e-2 of the FP32 reference of the same cache
    contents (FP16 probabilities, BF16 output; the largest error is printed for the log)."""
    from fp8_align.bitwise.fp8_cache_attention import ATTENTION_TILING
    from tests.fp8_attention_cases import check_case, make_case

    case = make_case([1, 5, 77, 300, 129, 1100], heads, kv_heads, head_size, "cuda")
    error = check_case(case, chunk=37, tiling=dataclasses.replace(ATTENTION_TILING, split_head=split_head))
    print(f"fp8_cache_attention {heads}/{kv_heads}x{head_size} split_head={split_head}: max |kernel - FP32 reference| {error:.5f}")
    assert error < 2e-2


@pytest.mark.parametrize("tiling", ["tile64", "tile128_split"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(32, 8, 128), (16, 8, 128), (9, 3, 64), (16, 16, 64)])
def test_trainer_tiling_gives_the_engine_tilings_rows(heads: int, kv_heads: int, head_size: int, tiling: str) -> None:
    """For each `FP8Config.bitwise_attention_tiling`, the engine's tiling (`ATTENTION_TILINGS`) keeps
    every token's row the same in prefill, chunked prefill and decode, and the trainer's prefill
    tiling (`TRAINER_TILINGS`; for "tile64" more query rows per program) gives every row the
    engine's bits in a whole-sequence prefill of fragmented sequences, its own rows invariant too."""
    from fp8_align.bitwise.fp8_cache_attention import ATTENTION_TILINGS, TRAINER_TILINGS
    from tests.fp8_attention_cases import check_case, make_case

    engine, trainer = ATTENTION_TILINGS[tiling], TRAINER_TILINGS[tiling]
    case = make_case([1, 5, 77, 300, 129, 1100, 2048], heads, kv_heads, head_size, "cuda", seed=3)
    prefill = [(s, 0, n) for s, n in enumerate(case.lengths)]
    engine_rows, trainer_rows = case.attend(prefill, engine), case.attend(prefill, trainer)
    differing = (engine_rows.view(torch.int16) != trainer_rows.view(torch.int16)).any(dim=-1).sum().item()
    assert differing == 0, f"{differing} of {engine_rows.shape[0]} rows differ"
    assert check_case(case, chunk=37, tiling=engine) < 2e-2
    assert check_case(case, chunk=37, tiling=trainer) < 2e-2


def _decode_step(
    kernels: Any, q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, picks: list[tuple[int, int]], head_size: int, scales: Any,
    split_threshold: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """One decode step as the engine runs it: each sequence's K/V prefix written by vLLM's cache
    write into paged blocks (here in reverse block order, as a fragmented cache would be; E4M3 with
    `scales`, attended by fp8_align's FP8-cache kernel, else BF16 and TRITON_ATTN), one query per
    sequence. `split_threshold`: TRITON_ATTN's `seq_threshold_3D` and split-KV buffers, as its
    metadata builder passes them (batches of at most that many sequences may take the 3D kernel)."""
    from fp8_align.bitwise.fp8_cache_attention import fp8_cache_attention
    from fp8_align.hf_training.attention import ATTENTION_BLOCK_SIZE

    kv_heads, heads = k.shape[-1] // head_size, q_rows.shape[-1] // head_size
    counts = [-(-n // ATTENTION_BLOCK_SIZE) for _, n in picks]
    total = sum(counts)
    dtype = k.dtype if scales is None else torch.float8_e4m3fn
    key_cache = torch.zeros(total, ATTENTION_BLOCK_SIZE, kv_heads, head_size, dtype=dtype, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    block_table = torch.zeros(len(picks), max(counts), dtype=torch.int32, device="cuda")
    rows, slots, next_block = [], [], total
    for i, ((start, n), count) in enumerate(zip(picks, counts)):
        for b in range(count):
            next_block -= 1
            block_table[i, b] = next_block
        rows.append(torch.arange(start, start + n, device="cuda"))
        positions = torch.arange(n, device="cuda")
        slots.append(block_table[i, positions // ATTENTION_BLOCK_SIZE].long() * ATTENTION_BLOCK_SIZE + positions % ATTENTION_BLOCK_SIZE)
    index = torch.cat(rows)
    unit = torch.ones(1, dtype=torch.float32, device="cuda")
    k_scale, v_scale = (unit, unit) if scales is None else (scales.k_scale, scales.v_scale)
    kernels.write_kv_cache(
        k[index].view(-1, kv_heads, head_size), v[index].view(-1, kv_heads, head_size), key_cache, value_cache, torch.cat(slots),
        "auto" if scales is None else "fp8", k_scale, v_scale,
    )  # fmt: skip
    seqs = len(picks)
    query = q_rows.view(seqs, heads, head_size).contiguous()
    out = torch.empty(seqs, heads, head_size, dtype=q_rows.dtype, device="cuda")
    query_start = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([n for _, n in picks], dtype=torch.int32, device="cuda")
    if scales is not None:
        fp8_cache_attention(query, key_cache, value_cache, block_table, query_start, seq_lens, head_size**-0.5, k_scale, v_scale, out)
        return out.view(seqs, heads * head_size)
    split: dict[str, Any] = {}
    if split_threshold is not None:
        from vllm.v1.attention.backends.triton_attn import NUM_PAR_SOFTMAX_SEGMENTS

        segments, padded = NUM_PAR_SOFTMAX_SEGMENTS, 1 << (head_size - 1).bit_length()
        split = {
            "seq_threshold_3D": split_threshold, "num_par_softmax_segments": segments,
            "softmax_segm_output": torch.empty(split_threshold, heads, segments, padded, dtype=torch.float32, device="cuda"),
            "softmax_segm_max": torch.empty(split_threshold, heads, segments, dtype=torch.float32, device="cuda"),
            "softmax_segm_expsum": torch.empty(split_threshold, heads, segments, dtype=torch.float32, device="cuda"),
        }  # fmt: skip
    kernels.unified_attention(
        q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=query_start, max_seqlen_q=1, seqused_k=seq_lens,
        max_seqlen_k=max(n for _, n in picks), softmax_scale=head_size**-0.5, causal=True, window_size=(-1, -1),
        block_table=block_table, softcap=0, q_descale=None, k_descale=k_scale.expand(seqs, kv_heads), v_descale=v_scale.expand(seqs, kv_heads),
        **split,
    )  # fmt: skip
    return out.view(seqs, heads * head_size)


def test_small_decode_batches_are_the_trainers_rows_with_the_flag_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_ATTN decodes a batch of at most `seq_threshold_3D` sequences (16 at 8 KV heads) with its
    split-KV 3D kernel unless its module's import-time copy of VLLM_BATCH_INVARIANT is True. With the
    copy False (the module imported before the variable was set: TRL's colocate engine after
    `make_bitwise`) 10 sequences of 300-633 tokens decode to other rows than the
    trainer's; with `bitwise_unified_attention_2d` applied, to the trainer's bit for bit; undone, the
    copy is what it was."""
    from vllm.v1.attention.ops import triton_unified_attention

    from fp8_align.hf_training.attention import PackedBatch, paged_triton_attention
    from fp8_align.vllm_plugin import patches
    from fp8_align.vllm_plugin.compat import batch_invariant_kernels

    kernels = batch_invariant_kernels()
    heads, kv_heads, head_size = 32, 8, 128
    lengths = [300 + 37 * i for i in range(10)]
    tokens = sum(lengths)
    q, k, v = _randn(tokens, heads * head_size, seed=20), _randn(tokens, kv_heads * head_size, seed=21), _randn(tokens, kv_heads * head_size, seed=22)
    full = paged_triton_attention(kernels, q, k, v, PackedBatch.from_lengths(lengths, "cuda"), head_size)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    picks = list(zip(starts, lengths))
    q_rows = torch.stack([q[s + n - 1] for s, n in picks])
    expected = torch.stack([full[s + n - 1] for s, n in picks])
    monkeypatch.setattr(triton_unified_attention, "is_batch_invariant", False)
    stale = _decode_step(kernels, q_rows, k, v, picks, head_size, None, split_threshold=16)
    assert not torch.equal(stale, expected), "the 3D kernel gave the 2D kernel's rows: the stale flag would not matter"
    try:
        assert "bitwise_unified_attention_2d" in patches.apply_patches(FP8Config(on_policy="bitwise"))
        patched = _decode_step(kernels, q_rows, k, v, picks, head_size, None, split_threshold=16)
    finally:
        patches.undo_patches()
    assert torch.equal(patched, expected)
    assert triton_unified_attention.is_batch_invariant is False


@pytest.mark.parametrize("rounding", ["fp32_scales", "pow2_scales", "te_rule"])
@pytest.mark.parametrize(("shard_sizes", "k", "tokens"), [([4096, 1024, 1024], 4096, 1000), ([12288, 12288], 4096, 1000),
                                                         ([4096], 12288, 1000), ([384], 256, 37)])  # fmt: skip
def test_fp8_backward_products_are_the_dequantized_references(shard_sizes: list[int], k: int, tokens: int, rounding: str) -> None:
    """`bitwise_linear_backward="fp8"` on CUDA (Triton quantizers, cuBLAS's block-scaled GEMMs): dx
    and dw of the Qwen3-8B projections (q|k|v, gate|up, down) over 1,000 tokens, and of 3 row blocks
    (which cuBLAS's weight-scale layout pads to 4) over 37 tokens (padded to 40 for cuBLAS), against
    the FP64 products of the dequantized operands (tests/test_fp8_backward.py: a BF16 rounding plus
    Hopper's FP8 accumulation allowance; measured on the H200: at most 5.6e-5 of it, 2^-12 allowed)."""
    from fp8_align.rounding import Rounding
    from tests.test_fp8_backward import check_gradient_products

    roundings = {"fp32_scales": Rounding(), "pow2_scales": Rounding(weight_pow2=True, activation_pow2=True),
                 "te_rule": Rounding(scale_rule="transformer_engine")}  # fmt: skip
    dx_error, dw_error = check_gradient_products(shard_sizes, k, tokens, roundings[rounding], "cuda")
    print(f"past the BF16 rounding, per sum of absolute products: dx {dx_error:.3g}, dw {dw_error:.3g}")


@pytest.mark.parametrize("rule", ["amax_over_max", "transformer_engine"])
@pytest.mark.parametrize(("m", "k"), [(16384, 4096), (1000, 12288), (5, 256)])
def test_transposed_quantizer_is_the_reference(m: int, k: int, rule: str) -> None:
    """The weight gradient's operand quantizer (`quantize_activation_transposed_triton`) compiled,
    against the torch reference on CUDA: the same codes and scales, FP32 and power-of-two scales."""
    from fp8_align.quant.groupwise import quantize_activation_transposed
    from fp8_align.quant.triton_groupwise import quantize_activation_transposed_triton

    x = _randn(m, k, seed=m) * torch.logspace(-3, 3, m, device="cuda")[:, None].to(torch.bfloat16)
    for pow2 in (False, True):
        codes, scales = quantize_activation_transposed_triton(x, pow2, rule)
        ref_codes, ref_scales = quantize_activation_transposed(x, pow2, rule)
        assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), pow2
        assert torch.equal(scales, ref_scales), pow2


@pytest.mark.parametrize(("n", "k"), [(151936, 4096), (49152, 576), (1000, 4096), (24576, 4096), (4096, 12288), (151936, 2048), (2048, 6144)])
def test_wide_linear_gives_the_engines_linear_bits(n: int, k: int) -> None:
    """The trainer's launch of vLLM's batch-invariant matmul (`wide_linear`: `trainer_bf16_tiles`)
    gives the bits of the engine's `linear_batch_invariant` for every row count (1 to 4,100, and 3-D
    input), output layers and projections of the supported models (Qwen3-1.7B's among them: shapes
    vLLM 0.33 tunes on Hopper), with and without bias."""
    from fp8_align.vllm_plugin.compat import batch_invariant_kernels

    kernels = batch_invariant_kernels()
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    for m in (1, 7, 300, 4100):
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        assert torch.equal(kernels.wide_linear(x, weight), kernels.linear(x, weight)), m
    assert torch.equal(kernels.wide_linear(x, weight, bias), kernels.linear(x, weight, bias))
    x3 = x[:4096].view(2, 2048, k)
    assert torch.equal(kernels.wide_linear(x3, weight), kernels.linear(x3, weight))


@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(32, 8, 128), (9, 3, 64)])
def test_flash_attention_vjp_is_the_attention_gradient(heads: int, kv_heads: int, head_size: int) -> None:
    """`flash_attention_vjp` (flash's variable-length backward over the packed tokens, grouped heads
    as they are) against the FP32 autograd gradient of `attention_reference`, beside autograd of the
    BF16 reference (SDPA over the padded batch with repeated K/V, the backward it replaces): both are
    BF16 computations of the same gradient, so each of dq, dk, dv must be as close to FP32 as the
    padded one, within a factor 2 and 1% of the gradient's scale (a wrong mask, scale or head
    grouping is off by O(1))."""
    from fp8_align.hf_training.attention import PackedBatch, attention_reference, flash_attention_vjp

    torch.manual_seed(0)
    lengths = [1, 37, 300, 1100, 513]
    batch = PackedBatch.from_lengths(lengths, "cuda")
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, h * head_size, device="cuda").to(torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(tokens, heads * head_size, device="cuda").to(torch.bfloat16)

    def autograd(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        attention_reference(*inputs, batch, head_size, compute_dtype=dtype).backward(grad.to(dtype))
        return tuple(x.grad.float() for x in inputs)

    exact, padded = autograd(torch.float32), autograd(torch.bfloat16)
    flash = flash_attention_vjp(batch, head_size)((q, k, v), None, (grad,))
    for name, e, p_, f in zip("qkv", exact, padded, flash):
        assert f.shape == e.shape and f.dtype == torch.bfloat16, name
        flash_error, padded_error = (f.float() - e).abs().max().item(), (p_ - e).abs().max().item()
        print(f"d{name}: flash varlen {flash_error:.4g}, padded SDPA {padded_error:.4g}, scale {e.abs().max().item():.4g}")
        assert flash_error <= 2 * padded_error + 1e-2 * e.abs().max().item(), name


@pytest.mark.parametrize("vocab", [151936, 49152])
def test_v2_log_softmax_of_bf16_logits_is_the_trainers_with_the_fp32_patch(vocab: int) -> None:
    """V2's sampler hands `compute_token_logprobs` the engine's BF16 logits in raw-log-probs mode; with
    `bitwise_v2_fp32_logprobs` applied its log-probs are, bit for bit, the trainer's of the FP32 logits
    (`label_logprobs`: V1's batch-invariant log-softmax). 512 rows of BF16 logits, half of them with a
    spread of 3, half of 8 (an lm_head's range), at Qwen3's and SmolLM2's vocabulary."""
    from vllm.v1.worker.gpu.sample import logprob

    from fp8_align.hf_training.engine_ops import engine_kernels, label_logprobs
    from fp8_align.vllm_plugin import patches

    g = torch.Generator(device="cuda").manual_seed(vocab)
    spread = torch.tensor([3.0, 8.0], device="cuda").repeat(256)[:, None]
    logits = (torch.randn(512, vocab, generator=g, device="cuda") * spread).bfloat16()
    labels = torch.randint(0, vocab, (512,), generator=g, device="cuda")
    trainer = label_logprobs(logits.float(), labels, engine_kernels())
    try:
        assert "bitwise_v2_fp32_logprobs" in patches.apply_patches(FP8Config(on_policy="bitwise"))
        engine = logprob.compute_token_logprobs(logits, labels[:, None])[:, 0]
    finally:
        patches.undo_patches()
    assert torch.equal(engine, trainer), f"{int((engine != trainer).sum())} of 512 rows differ"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_bitwise_forward_gradients_follow_the_references(precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine-kernel forward with its backward against plain autograd through each op's
    `gradient_fn` (BF16 torch ops: fused RMSNorm, SiLU, flash SDPA; FP8 projections straight-through).
    The forwards differ by rounding, so the gradients agree closely but not bitwise. A wrong backward
    (a missing term, a transposed weight) is off by O(1); BF16 rounding noise, re-rounded by the FP8
    quantizers, by up to about 10% (0.104 measured on the H100 for an FP8 q_proj): relative Frobenius
    error under 25%."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8_align.hf_training import BitwiseForward
    from fp8_align.hf_training import bitwise_modules, engine_ops, stacked

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, vocab_size=2000, max_position_embeddings=1024)  # fmt: skip
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).cuda()
    cfg = FP8Config(on_policy="bitwise", precision=precision)
    sequences = [torch.randint(0, 2000, (n,)).tolist() for n in (40, 200, 7)]

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        torch.cat(BitwiseForward(model, cfg).token_logprobs(sequences, [5, 50, 2])).sum().backward()
        return {name: p.grad.float().clone() for name, p in model.named_parameters()}

    engine = gradients()
    for module in (bitwise_modules, engine_ops, stacked):  # every module that calls engine_op
        monkeypatch.setattr(module, "engine_op", lambda engine_fn, gradient_fn, *inputs, **_: gradient_fn(*inputs))
    reference = gradients()
    for name, grad in engine.items():
        error = (grad - reference[name]).norm() / reference[name].norm().clamp_min(1e-12)
        assert error < 0.25, (name, error.item())


def test_bf16_gradients_are_the_models_own_on_cuda() -> None:
    """BitwiseForward (BF16, engine kernels) against transformers' own autograd of the same loss
    (its SDPA attention): every parameter's gradient within 5% (relative Frobenius norm; the CPU
    test measures 1.8%). The largest error is printed for the results log."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8_align.hf_training import BitwiseForward

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, vocab_size=2000, max_position_embeddings=1024)  # fmt: skip
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).cuda()
    sequences, prompt_lens = [torch.randint(0, 2000, (n,)).tolist() for n in (40, 200, 7)], [5, 50, 2]
    forward = BitwiseForward(model, FP8Config(on_policy="bitwise", precision="bf16"))

    def gradients(loss: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad()
        loss.backward()
        return {name: p.grad.float().clone() for name, p in model.named_parameters()}

    engine = gradients(torch.cat(forward.token_logprobs(sequences, prompt_lens)).sum())
    total = torch.zeros((), device="cuda")
    for seq, prompt in zip(sequences, prompt_lens):
        logprobs = model(torch.tensor([seq], device="cuda")).logits[0].float().log_softmax(-1)
        total = total + logprobs[torch.arange(prompt - 1, len(seq) - 1), torch.tensor(seq[prompt:], device="cuda")].sum()
    hf = gradients(total)
    errors = {name: ((engine[name] - hf[name]).norm() / hf[name].norm().clamp_min(1e-12)).item() for name in hf}
    print(f"bf16 gradient vs transformers: max relative error {max(errors.values()):.4f} ({max(errors, key=errors.get)})")
    assert max(errors.values()) < 0.05, errors


def test_frozen_fp8_weights_give_the_same_bits_on_cuda() -> None:
    """`BitwiseForward.frozen_weights()` on CUDA: the second forward of the block reuses the codes of
    the first, and both give the log-probs and every gradient of forwards that quantize each time,
    bit for bit (the CPU test, tests/test_bitwise_model.py, counts the quantizations)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8_align.hf_training import BitwiseForward

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, vocab_size=2000, max_position_embeddings=1024)  # fmt: skip
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).cuda()
    forward = BitwiseForward(model, FP8Config(on_policy="bitwise", kv_cache_dtype="fp8"))
    forward.set_kv_scales({layer: {"k_scale": 0.02, "v_scale": 0.01} for layer in range(2)})
    sequences, prompt_lens = [torch.randint(0, 2000, (n,)).tolist() for n in (40, 200, 7)], [5, 50, 2]

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logprobs = torch.cat(forward.token_logprobs(sequences, prompt_lens))
        logprobs.sum().backward()
        return logprobs.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    plain_logprobs, plain_grads = run()
    with forward.frozen_weights():
        for _ in range(2):  # the first forward quantizes, the second reuses
            logprobs, grads = run()
            assert torch.equal(logprobs, plain_logprobs)
            assert all(torch.equal(grads[name], plain_grads[name]) for name in plain_grads)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("grad", [False, True], ids=["logprobs", "forward_backward"])
@pytest.mark.parametrize("frozen", [False, True], ids=["quantized", "frozen"])
def test_bitwise_trainer_does_not_sync_the_host(kv_cache_dtype: str, grad: bool, frozen: bool) -> None:
    """The bitwise trainer's log-probs (and their backward) queue GPU work without waiting for it: a
    device sync inside a micro-batch leaves the GPU idle while the host prepares the next kernels
    (the RL step's bitwise trainer ran 35 ms of kernels in 99 ms, results_log session 40). Every
    sync under `torch.cuda.set_sync_debug_mode("warn")` is recorded with the Python line that asked
    for it; the first call (kernel selection, Triton compiles) runs before. One sync is transformers':
    its causal-mask builder reads back whether `position_ids` hold packed sequences (masking_utils'
    `find_packed_sequence_indices`, H100 session 41), before the first layer; none may come from
    anywhere else, inside `frozen_weights()` too (its in-place check reads only host counters)."""
    import warnings

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8_align.hf_training import BitwiseForward

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, vocab_size=2000, max_position_embeddings=1024)  # fmt: skip
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).cuda()
    forward = BitwiseForward(model, FP8Config(on_policy="bitwise", kv_cache_dtype=kv_cache_dtype))
    if kv_cache_dtype == "fp8":
        forward.set_kv_scales({layer: {"k_scale": 0.02, "v_scale": 0.01} for layer in range(2)})
    sequences, prompt_lens = [torch.randint(0, 2000, (n,)).tolist() for n in (40, 200, 7)], [5, 50, 2]

    def run() -> None:
        with torch.set_grad_enabled(grad):
            logprobs = torch.cat(forward.token_logprobs(sequences, prompt_lens))
            if grad:
                logprobs.sum().backward()

    with forward.frozen_weights() if frozen else contextlib.nullcontext():
        run()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    syncs = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)]
    others = [site for site in syncs if not site.startswith("masking_utils.py:")]
    assert not others and len(syncs) <= 1, f"{len(syncs)} device syncs: {syncs}"


def test_bench_error_bitwise_trainer_side_is_the_engine_bit_for_bit(tmp_path: Path) -> None:
    """`fp8-align bench-error --variants fp8_bitwise` on SmolLM2-135M-Instruct with an eager engine
    (no torch.compile, no CUDA graphs: another code path than the proof's compiled engines): the
    `bitwise_trainer` side equals the engine's log-probs, greedy and sampled, while the HF emulation
    side of the same tokens does not (so the comparison can fail)."""
    import json

    from fp8_align.cli import main
    from fp8_align.error_bench.report import JSON_NAME

    args = ["bench-error", "--variants", "fp8_bitwise", "--num-prompts", "8", "--max-new-tokens", "48", "--device", "cuda",
            "--vllm-compile", "off", "--out", str(tmp_path), "--json-only", "--no-plots"]  # fmt: skip
    assert main(args) == 0
    pairs = json.loads((tmp_path / JSON_NAME).read_text())["pairs"]
    bitwise = {p["sampling"]: p["metrics"] for p in pairs if p["training"] == "bitwise_trainer"}
    assert set(bitwise) == {"greedy", "sampled"}
    for metrics in bitwise.values():
        assert metrics["num_tokens"] > 100 and metrics["max_abs_log_ratio"] == 0.0 and metrics["mult_prob_error"] == 1.0
    emulation = [p["metrics"] for p in pairs if p["training"] == "fp8_bitwise"]
    assert emulation and all(m["max_abs_log_ratio"] > 0 for m in emulation)
