"""Block FP8 for routed experts (`fp8_align.quant.moe`): per-expert, per-shard quantization equals
the linear recipe on each checkpoint tensor bit for bit; the MoE forward (reference and the CPU
custom op) agrees with an independent float64 computation on the dequantized operands."""

from __future__ import annotations

import pytest
import torch

from fp8_align.quant import quantize_activation_groupwise, quantize_weight_blockwise
from fp8_align.quant.moe import block_fp8_moe_reference, expert_scale_shapes, expert_shard_rows, quantize_experts


def _experts(num_experts: int, inter: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.2).to(torch.bfloat16)
    return w13, w2


@pytest.mark.parametrize(("inter", "hidden"), [(128, 256), (192, 320), (64, 128)])
@pytest.mark.parametrize("pow2", [False, True])
def test_each_expert_shard_is_the_linear_recipe_of_its_checkpoint_tensor(inter, hidden, pow2):
    """gate rows, up rows and down of every expert: codes and scales equal
    `quantize_weight_blockwise` of the per-expert HF tensors, including partial 128-blocks."""
    w13, w2 = _experts(3, inter, hidden)
    c13, s13, c2, s2 = quantize_experts(w13, w2, pow2)
    assert (tuple(s13.shape), tuple(s2.shape)) == expert_scale_shapes(3, inter, hidden)
    for e in range(3):
        for shard, source in (("w1", w13[e, :inter]), ("w3", w13[e, inter:]), ("w2", w2[e])):
            where = expert_shard_rows(shard, inter, hidden)
            codes, scales = quantize_weight_blockwise(source, pow2_scale=pow2)
            stored_codes = (c13 if where.param == "w13" else c2)[e, where.rows]
            stored_scales = (s13 if where.param == "w13" else s2)[e, where.scale_rows]
            assert torch.equal(stored_codes.view(torch.uint8), codes.view(torch.uint8)), (e, shard)
            assert torch.equal(stored_scales, scales), (e, shard)


def _dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows = scales.repeat_interleave(128, 0)[: codes.shape[0]].repeat_interleave(128, 1)[:, : codes.shape[1]]
    return codes.to(torch.float64) * rows.to(torch.float64)


def _float64_moe(x, topk_weights, topk_ids, c13, s13, c2, s2, act_pow2):
    """Token by token in float64 from dequantized weights and activations (rounded as the recipe
    rounds: activations to 1x128 FP8 groups, GEMM outputs and the SiLU product to bf16)."""
    inter, hidden = c2.shape[2], c2.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xq, xs = quantize_activation_groupwise(x[t : t + 1], pow2_scale=act_pow2)
        xd = (xq.to(torch.float64).view(1, -1, 128) * xs.to(torch.float64)[..., None]).view(1, -1)
        for slot in range(topk_ids.shape[1]):
            e = int(topk_ids[t, slot])
            gate = expert_shard_rows("w1", inter, hidden)
            up = expert_shard_rows("w3", inter, hidden)
            g = (xd @ _dequant(c13[e, gate.rows], s13[e, gate.scale_rows]).T).to(torch.bfloat16).double()
            u = (xd @ _dequant(c13[e, up.rows], s13[e, up.scale_rows]).T).to(torch.bfloat16).double()
            h = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)
            hq, hs = quantize_activation_groupwise(h, pow2_scale=act_pow2)
            hd = (hq.to(torch.float64).view(1, -1, 128) * hs.to(torch.float64)[..., None]).view(1, -1)
            y = (hd @ _dequant(c2[e], s2[e]).T).to(torch.bfloat16).double()
            out[t] += y[0] * float(topk_weights[t, slot])
    return out


@pytest.mark.parametrize("act_pow2", [False, True])
def test_moe_forward_matches_a_float64_token_by_token_computation(act_pow2):
    """Reference and custom op: |diff| to the float64 computation within 2 bf16 ulps of the output
    (each expert's output is rounded to bf16 once, the FP32 sum of k=2 weighted terms and its final
    rounding add at most one more ulp each; FP32 vs float64 GEMM accumulation is far below that)."""
    from fp8_align.vllm_plugin.moe.emulated_op import emulated_block_fp8_moe

    w13, w2 = _experts(4, 128, 256, seed=1)
    c13, s13, c2, s2 = quantize_experts(w13, w2, False)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 256, generator=g).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)]).to(torch.int32)
    topk_weights = torch.softmax(torch.randn(7, 2, generator=g), dim=-1)
    expected = _float64_moe(x, topk_weights, topk_ids, c13, s13, c2, s2, act_pow2)
    got = block_fp8_moe_reference(x, topk_weights, topk_ids, c13, s13, c2, s2, act_pow2)
    ulp = expected.abs().clamp_min(2.0**-126).log2().floor().exp2() * 2.0**-7
    assert (got.double() - expected).abs().le(2 * ulp).all()
    op = emulated_block_fp8_moe(x, topk_weights, topk_ids, c13.float(), s13, c2.float(), s2, act_pow2)
    assert torch.equal(op, got)  # float32 copies of the codes are exact


def test_negative_ids_are_other_ranks_experts():
    w13, w2 = _experts(2, 128, 128)
    c13, s13, c2, s2 = quantize_experts(w13, w2, False)
    x = torch.randn(3, 128).to(torch.bfloat16)
    ids = torch.tensor([[0, -1], [-1, -1], [1, 0]])
    weights = torch.full((3, 2), 0.5)
    out = block_fp8_moe_reference(x, weights, ids, c13, s13, c2, s2, False)
    assert torch.equal(out[1], torch.zeros(128, dtype=torch.bfloat16))
    alone = block_fp8_moe_reference(x[:1], weights[:1, :1], ids[:1, :1], c13, s13, c2, s2, False)
    assert torch.equal(out[0], alone[0])
