"""The bitwise Mixture-of-Experts operators (`fp8_align.bitwise.moe_reference`, `moe_kernels`,
the `bitwise_moe_*` / `bitwise_grouped_block_fp8_mm` ops and `moe.moe_experts`) on CPU: the ops'
CPU path against the references and against independent per-token loops, the routing rule (ties,
NaN and -inf, renormalization), the input checks; and the Triton kernels under the interpreter:
equal to the references (bit for bit where the interpreter's arithmetic allows, see
`_INTERPRETED_SCRIPT`) and independent of the batch a token is computed in.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fp8_align.bitwise.moe import moe_experts  # registers torch.ops.fp8_align.bitwise_*
from fp8_align.bitwise.moe_reference import (
    experts_of_rows, grouped_block_fp8_mm_reference, moe_combine_reference, moe_route_reference,
)  # fmt: skip
from fp8_align.bitwise.reference import silu_and_mul_reference
from fp8_align.quant import FP8_DTYPE, fp8_block_gemm, quantize_activation_groupwise, quantize_weight_blockwise
from fp8_align.quant.moe import block_fp8_moe_reference, quantize_experts

HIDDEN, INTERMEDIATE, EXPERTS = 256, 128, 8


def _experts(seed: int, experts: int = EXPERTS, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE) -> tuple[torch.Tensor, ...]:
    """(c13, s13, c2, s2): block-FP8 experts of random BF16 weights."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * intermediate, hidden, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(experts, hidden, intermediate, generator=g) * 0.05).bfloat16()
    return quantize_experts(w13, w2, pow2_scale=False)


def _routing(tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, H] bf16, weights [T, K] float32, ids [T, K] int32) routed by the CPU op."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    weights, ids = torch.ops.fp8_align.bitwise_moe_route(torch.randn(tokens, EXPERTS, generator=g).bfloat16(), top_k, True)
    return x, weights, ids


# --------------------------------------------------------------------------- routing
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_is_top_k_softmax(renormalize: bool) -> None:
    """Without ties the ids are torch.topk's (largest first); the weights are the softmax of the
    chosen logits (renormalize) or the softmax over all experts at the chosen ones."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 60, generator=g)
    weights, ids = torch.ops.fp8_align.bitwise_moe_route(logits, 4, renormalize)
    ref_weights, ref_ids = moe_route_reference(logits, 4, renormalize)
    assert torch.equal(weights, ref_weights) and torch.equal(ids, ref_ids)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and weights.shape == (64, 4)
    top = torch.topk(logits, 4, dim=1)
    assert torch.equal(ids.long(), top.indices)
    expected = torch.softmax(top.values.double(), 1) if renormalize else torch.softmax(logits.double(), 1).gather(1, top.indices)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=0)
    bf16 = logits.bfloat16()
    assert all(torch.equal(a, b) for a, b in zip(moe_route_reference(bf16, 4, renormalize), moe_route_reference(bf16.float(), 4, renormalize)))


def test_route_breaks_ties_to_the_lowest_index_and_renormalizes_left_to_right() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [2.0, 1.0, 0.0, -1.0, 0.5]])
    weights, ids = moe_route_reference(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [0, 1, 4]]
    third = torch.ones(1) / 3
    assert torch.equal(weights[:2], third.expand(2, 3))
    e = torch.exp(torch.tensor([0.0, -1.0, -1.5]))
    total = (e[0] + e[1]) + e[2]
    assert torch.equal(weights[2], e / total)


def test_route_reads_nan_as_minus_inf() -> None:
    """NaN logits are chosen last, as -inf; a row whose largest logit is -inf gets NaN weights."""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[nan, 1.0, 2.0, -inf], [-inf, 0.0, -inf, nan], [-inf, -inf, -inf, -inf]])
    weights, ids = moe_route_reference(logits, 3, True)
    assert ids.tolist() == [[2, 1, 0], [1, 0, 2], [0, 1, 2]]
    assert weights[1].tolist() == [1.0, 0.0, 0.0] and weights[0, 2] == 0.0 and bool(weights[2].isnan().all())
    assert torch.equal(moe_route_reference(logits[:2], 3, False)[1], ids[:2])


# --------------------------------------------------------------------------- grouped GEMM and combine
def test_grouped_mm_op_is_each_rows_gemm_with_its_expert() -> None:
    """Expert counts (5, 0, 70, 1, 13) (one expert without rows, M not a multiple of 64), N and K
    a multiple of 128 and not: the op is the reference, and every row is the dense `fp8_block_gemm`
    of that row alone with its expert's weight, bit for bit. That comparison takes integer codes
    up to 16 (with random scales): their 128-long dot products are exact in FP32, while torch's CPU
    matmul sums other codes in an order that depends on the row count (M = 1, 2, 3, 5 against 70)."""
    g = torch.Generator().manual_seed(1)
    counts = [5, 0, 70, 1, 13]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    row_expert = experts_of_rows(offsets, sum(counts))
    assert row_expert.tolist() == [e for e, c in enumerate(counts) for _ in range(c)]
    for n, k in ((256, 256), (320, 200)):
        x_fp8, x_scale = quantize_activation_groupwise(torch.randn(sum(counts), k, generator=g))
        codes, scales = zip(*(quantize_weight_blockwise(torch.randn(n, k, generator=g)) for _ in counts))
        w_fp8, w_scale = torch.stack(codes), torch.stack(scales)
        for out_dtype in (torch.float32, torch.bfloat16):
            out = torch.ops.fp8_align.bitwise_grouped_block_fp8_mm(x_fp8, x_scale, w_fp8, w_scale, offsets, out_dtype)
            assert out.dtype == out_dtype and torch.equal(out, grouped_block_fp8_mm_reference(x_fp8, x_scale, w_fp8, w_scale, row_expert, out_dtype))
        x_fp8 = torch.randint(-16, 17, x_fp8.shape, generator=g).to(FP8_DTYPE)
        w_fp8 = torch.randint(-16, 17, w_fp8.shape, generator=g).to(FP8_DTYPE)
        out = torch.ops.fp8_align.bitwise_grouped_block_fp8_mm(x_fp8, x_scale, w_fp8, w_scale, offsets.long(), torch.float32)
        for row, expert in enumerate(row_expert.tolist()):
            alone = fp8_block_gemm(x_fp8[row : row + 1], x_scale[row : row + 1], w_fp8[expert], w_scale[expert], torch.float32)
            assert torch.equal(out[row : row + 1], alone)


def test_combine_op_sums_the_slots_in_order() -> None:
    g = torch.Generator().manual_seed(2)
    y, weights = torch.randn(7, 3, 300, generator=g).bfloat16(), torch.rand(7, 3, generator=g)
    out = torch.ops.fp8_align.bitwise_moe_combine(y, weights)
    assert out.dtype == torch.bfloat16 and torch.equal(out, moe_combine_reference(y, weights))
    expected = ((weights[:, 0, None] * y[:, 0].float() + weights[:, 1, None] * y[:, 1].float()) + weights[:, 2, None] * y[:, 2].float()).bfloat16()
    assert torch.equal(out, expected)
    torch.testing.assert_close(moe_combine_reference(y.float(), weights).double(), (weights[..., None].double() * y.double()).sum(1), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- the experts
def _per_token_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, c13: torch.Tensor, s13: torch.Tensor,
                       c2: torch.Tensor, s2: torch.Tensor, pow2: bool) -> torch.Tensor:  # fmt: skip
    """Each token alone, each slot alone: dense GEMMs with the slot's expert, then the FP32 sum."""
    rows = []
    for token in range(x.shape[0]):
        acc = None
        for slot, expert in enumerate(ids[token].tolist()):
            x_fp8, x_scale = quantize_activation_groupwise(x[token : token + 1], pow2_scale=pow2)
            gate_up = fp8_block_gemm(x_fp8, x_scale, c13[expert], s13[expert], x.dtype)
            h_fp8, h_scale = quantize_activation_groupwise(silu_and_mul_reference(gate_up), pow2_scale=pow2)
            term = weights[token, slot] * fp8_block_gemm(h_fp8, h_scale, c2[expert], s2[expert], x.dtype).float()
            acc = term if acc is None else acc + term
        rows.append(acc.to(x.dtype))
    return torch.cat(rows)


@pytest.mark.parametrize("pow2", [False, True])
def test_moe_experts_is_the_per_token_loop(pow2: bool) -> None:
    """Bit for bit (torch's CPU matmul gives these rows the same bits alone as in their expert's
    group here; see `moe_reference` on its row-count dependence), and close to the recipe's MoE."""
    c13, s13, c2, s2 = _experts(3)
    x, weights, ids = _routing(24, 4, seed=4)
    out = moe_experts(x, weights, ids, c13, s13, c2, s2, pow2)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, _per_token_experts(x, weights, ids, c13, s13, c2, s2, pow2))
    torch.testing.assert_close(out, block_fp8_moe_reference(x, weights, ids, c13, s13, c2, s2, pow2))  # the recipe's MoE forward


def test_moe_experts_rows_do_not_depend_on_the_batch() -> None:
    c13, s13, c2, s2 = _experts(5)
    x, weights, ids = _routing(16, 2, seed=6)
    full = moe_experts(x, weights, ids, c13, s13, c2, s2, False)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(7))
    for rows in (torch.tensor([3]), torch.tensor([0, 5, 9, 15]), perm):
        assert torch.equal(moe_experts(x[rows], weights[rows], ids[rows], c13, s13, c2, s2, False), full[rows])


# --------------------------------------------------------------------------- input checks
def test_bad_inputs_raise_value_error() -> None:
    route, mm, combine = torch.ops.fp8_align.bitwise_moe_route, torch.ops.fp8_align.bitwise_grouped_block_fp8_mm, torch.ops.fp8_align.bitwise_moe_combine
    logits = torch.randn(4, 8)
    for bad, k, match in ((logits[0], 2, r"\[T, E\]"), (logits.int(), 2, "bf16/fp16/fp32"), (logits, 0, "top_k"), (logits, 9, "top_k"),
                          (torch.randn(2, 513), 2, "1 to 512")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            route(bad, k, True)
    x_fp8, x_scale = quantize_activation_groupwise(torch.randn(6, 256))
    w_fp8 = torch.zeros(3, 128, 256, dtype=FP8_DTYPE)
    w_scale, offsets = torch.ones(3, 1, 2), torch.tensor([0, 2, 2, 6])
    cases = (
        ((x_fp8.float(), x_scale, w_fp8, w_scale, offsets, torch.bfloat16), "x_fp8 must be"),
        ((x_fp8, x_scale, w_fp8[0], w_scale, offsets, torch.bfloat16), "w_fp8 must be"),
        ((x_fp8[:, :128], x_scale, w_fp8, w_scale, offsets, torch.bfloat16), "K=128"),
        ((x_fp8, x_scale[:, :1], w_fp8, w_scale, offsets, torch.bfloat16), "x_scale must be"),
        ((x_fp8, x_scale, w_fp8, torch.ones(3, 2, 2), offsets, torch.bfloat16), "w_scale must be"),
        ((x_fp8, x_scale, w_fp8, w_scale, offsets[:3], torch.bfloat16), "expert_offsets"),
        ((x_fp8, x_scale, w_fp8, w_scale, offsets.float(), torch.bfloat16), "expert_offsets"),
        ((x_fp8, x_scale, w_fp8, w_scale, offsets, torch.int32), "out_dtype"),
    )
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            mm(*args)
    y = torch.randn(4, 2, 16).bfloat16()
    for bad_y, bad_w, match in ((y[0], torch.ones(4, 2), "y must be"), (y, torch.ones(4, 2).bfloat16(), "weights must be"), (y, torch.ones(4, 3), "weights must be")):
        with pytest.raises(ValueError, match=match):
            combine(bad_y, bad_w)
    c13, s13, c2, s2 = _experts(8)
    x, weights, ids = _routing(4, 2, seed=9)
    with pytest.raises(ValueError, match="ids must be"):
        moe_experts(x, weights, ids[:3], c13, s13, c2, s2, False)
    with pytest.raises(ValueError, match="weights must be"):
        moe_experts(x, weights.bfloat16(), ids, c13, s13, c2, s2, False)
    with pytest.raises(ValueError, match="w13 .* and w2"):
        moe_experts(x, weights, ids, c13[:, :128], s13, c2, s2, False)
    for intermediate in (64, 200):  # separate gate and up grids: not the stacked grid the GEMM reads
        with pytest.raises(ValueError, match="intermediate size is a multiple of 128"):
            moe_experts(x, weights, ids, *_experts(10, intermediate=intermediate), False)


# --------------------------------------------------------------------------- Triton kernels, interpreted
_INTERPRETED_SCRIPT = """
import numpy as np
import torch
from fp8_align.bitwise import moe_kernels as mk, moe_reference as mr, ops
from fp8_align.bitwise.moe import moe_experts
from fp8_align.quant import FP8_DTYPE, quantize_activation_groupwise, quantize_weight_blockwise
from fp8_align.quant.moe import quantize_experts

g = torch.Generator().manual_seed(0)

def ulps(a, b):
    # distance in FP32 units in the last place of two tensors of non-negative floats
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())

def truncated(x):
    # the interpreter rounds FP32 -> BF16 by truncation (the GPU and torch round to nearest even)
    return (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)

def with_numpy_exp(fn, *args):
    # the reference with the interpreter's exp (numpy's) in place of torch's, which differ by an ulp
    torch_exp = torch.exp
    torch.exp = lambda t: torch.from_numpy(np.exp(t.numpy()))
    try:
        return fn(*args)
    finally:
        torch.exp = torch_exp

# routing: ids exactly; weights bit for bit with numpy's exp and renormalize, else within 8 ulps
worst = 0
for experts, top_k in ((8, 2), (8, 4), (60, 4), (512, 8)):
    logits = torch.randn(40, experts, generator=g)
    logits[0, :] = 1.0  # all tied
    logits[1, 1::2] = logits[1, 0]  # half tied
    logits[2, 3] = float("nan")
    logits[3, : experts - 1] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        for renormalize in (True, False):
            weights, ids = mk.moe_route_triton(logits.to(dtype), top_k, renormalize)
            ref_weights, ref_ids = mr.moe_route_reference(logits.to(dtype), top_k, renormalize)
            assert torch.equal(ids, ref_ids), (experts, top_k, renormalize)
            worst = max(worst, ulps(weights, ref_weights))
            if renormalize:
                assert torch.equal(weights, with_numpy_exp(mr.moe_route_reference, logits.to(dtype), top_k, True)[0])
            assert torch.equal(mk.moe_route_triton(logits[5:9].to(dtype), top_k, renormalize)[0], weights[5:9])
assert worst <= 8, worst
print("route worst ulps", worst)

# the tile map of the grouped GEMM
offsets = torch.tensor([0, 5, 5, 75, 76, 140, 153, 153, 162])
tiles = mk.expert_row_tiles(offsets, 162, 64)
expected = [(e, first, int(offsets[e + 1])) for e in range(8) for first in range(int(offsets[e]), int(offsets[e + 1]), 64)]
assert tiles.shape == (3 + 8, 3) and [tuple(t) for t in tiles.tolist()[: len(expected)]] == expected
assert (tiles[len(expected):, 0] == -1).all()

# grouped GEMM, 8 experts of uneven counts (one without rows), M = 162 (not a multiple of 64)
counts = [5, 0, 70, 1, 64, 13, 0, 9]
row_expert = torch.tensor([e for e, c in enumerate(counts) for _ in range(c)])
m = len(row_expert)
offsets = torch.tensor([0, *np.cumsum(counts).tolist()], dtype=torch.int32)
for n, k in ((256, 256), (320, 200)):
    # integer codes up to 16: every 128-long dot product is exact in FP32 in any order, so the
    # interpreter's numpy matmul and torch's agree and the scale arithmetic is compared bit for bit
    x_codes = torch.randint(-16, 17, (m, k), generator=g).to(FP8_DTYPE)
    x_scale = torch.rand(m, -(-k // 128), generator=g) + 0.01
    w_codes = torch.randint(-16, 17, (8, n, k), generator=g).to(FP8_DTYPE)
    w_scale = torch.rand(8, -(-n // 128), -(-k // 128), generator=g) + 0.01
    ref = mr.grouped_block_fp8_mm_reference(x_codes, x_scale, w_codes, w_scale, row_expert, torch.float32)
    assert torch.equal(mk.grouped_block_fp8_gemm_triton(x_codes, x_scale, w_codes, w_scale, offsets, torch.float32), ref)
    assert torch.equal(mk.grouped_block_fp8_gemm_triton(x_codes, x_scale, w_codes, w_scale, offsets.long(), torch.bfloat16), truncated(ref))
    # quantized random data: within FP32 summation-order differences of the reference
    x_fp8, x_scale = quantize_activation_groupwise(torch.randn(m, k, generator=g))
    w_fp8, w_scale = (torch.stack(t) for t in zip(*(quantize_weight_blockwise(torch.randn(n, k, generator=g)) for _ in counts)))
    full = mk.grouped_block_fp8_gemm_triton(x_fp8, x_scale, w_fp8, w_scale, offsets, torch.float32)
    torch.testing.assert_close(full, mr.grouped_block_fp8_mm_reference(x_fp8, x_scale, w_fp8, w_scale, row_expert, torch.float32), rtol=1e-5, atol=1e-4)
    # batch invariance: each row alone, in a subset, in a permuted batch (re-sorted by expert)
    full = mk.grouped_block_fp8_gemm_triton(x_fp8, x_scale, w_fp8, w_scale, offsets, torch.bfloat16)
    for rows in (torch.tensor([0]), torch.tensor([75]), torch.tensor([3, 40, 80, 161]), torch.randperm(m, generator=g)):
        experts, order = torch.sort(row_expert[rows], stable=True)
        picked = rows[order]
        sub_offsets = torch.searchsorted(experts, torch.arange(9))
        out = mk.grouped_block_fp8_gemm_triton(x_fp8[picked], x_scale[picked], w_fp8, w_scale, sub_offsets, torch.bfloat16)
        assert torch.equal(out, full[picked])

# combine: FP32 bit for bit, BF16 the truncation of the FP32 sum; rows independent of the batch
for top_k in (1, 2, 4):
    y, weights = torch.randn(9, top_k, 1100, generator=g), torch.rand(9, top_k, generator=g)
    assert torch.equal(mk.moe_combine_triton(y, weights), mr.moe_combine_reference(y, weights))
    y16 = y.bfloat16()
    out = mk.moe_combine_triton(y16, weights)
    assert torch.equal(out, truncated(mr.moe_combine_reference(y16.float(), weights)))
    assert torch.equal(mk.moe_combine_triton(y16[2:5], weights[2:5]), out[2:5])

# the kernels' wrappers check their inputs as the references do
for call in (lambda: mk.moe_route_triton(torch.randn(3, 8), 9, True), lambda: mk.moe_combine_triton(torch.randn(3, 8), torch.ones(3, 1)),
             lambda: mk.grouped_block_fp8_gemm_triton(x_fp8, x_scale, w_fp8, w_scale, offsets[:4], torch.float32)):
    try:
        call()
    except ValueError:
        pass
    else:
        raise AssertionError("no ValueError")

# moe_experts through the Triton kernels (the ops take their CUDA path on these CPU tensors; the
# activations are quantized in torch, as on CPU): every token's output is the same alone, in a
# subset and in a permuted batch
cpu_path = ops._on_triton
ops._on_triton = lambda tensor: True
hidden, intermediate, experts = 256, 256, 8
w13 = (torch.randn(experts, 2 * intermediate, hidden, generator=g) * 0.05).bfloat16()
w2 = (torch.randn(experts, hidden, intermediate, generator=g) * 0.05).bfloat16()
c13, s13, c2, s2 = quantize_experts(w13, w2, pow2_scale=True)
x = torch.randn(12, hidden, generator=g).bfloat16()
for top_k in (2, 4):
    weights, ids = torch.ops.fp8_align.bitwise_moe_route(torch.randn(12, experts, generator=g).bfloat16(), top_k, True)
    full = moe_experts(x, weights, ids, c13, s13, c2, s2, True)
    for rows in (torch.tensor([7]), torch.tensor([1, 4, 10]), torch.randperm(12, generator=g)):
        assert torch.equal(moe_experts(x[rows], weights[rows], ids[rows], c13, s13, c2, s2, True), full[rows])
# FP32 activations (no BF16 truncation in between): the Triton path is the CPU path up to the
# order of numpy's matmul sums (measured: 6e-8, outputs up to 0.74)
triton_out = moe_experts(x.float(), weights, ids, c13, s13, c2, s2, True)
ops._on_triton = cpu_path
torch.testing.assert_close(triton_out, moe_experts(x.float(), weights, ids, c13, s13, c2, s2, True), rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_triton_kernels_match_references_and_do_not_depend_on_the_batch() -> None:
    """Under the interpreter, bit for bit except where its arithmetic differs from torch's: FP32 ->
    BF16 truncates (BF16 outputs are compared with the truncated FP32 reference), numpy's exp is
    not torch's (routing weights: bit for bit with numpy's exp in the reference when renormalized,
    else within 8 ulps: one ulp per exp, a few more from the order of the sum over the experts;
    5 measured), and numpy's matmul sums a 128-long slice in another order than torch's (the GEMM
    is compared bit for bit on integer codes, whose products sum exactly in any order)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED_SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "ok"
