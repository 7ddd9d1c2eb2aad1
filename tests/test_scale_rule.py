"""scale_rule="transformer_engine": the torch reference quantizers reproduce TransformerEngine's
Float8BlockQuantizer (`te_emulation`) bit for bit, for weights, activations, experts and the
HF-side emulated and trainable linears; the default rule differs with FP32 scales, so these
tests fail when the rule is ignored."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8_align.quant.moe
from fp8_align import FP8Config
from fp8_align.hf_emulation import Fp8EmulatedExperts, Fp8EmulatedLinear
from fp8_align.hf_training import Fp8TrainingLinear
from fp8_align.megatron_ext.te_emulation import te_quantize_activation_1d, te_quantize_weight_2d
from fp8_align.quant import (
    blockwise_fp8_linear,
    fp8_block_gemm,
    quantize_activation_groupwise,
    quantize_weight_blockwise,
)
from fp8_align.quant.moe import block_fp8_moe_reference, expert_shard_rows, quantize_experts
from fp8_align.quant.scales import quantization_factors

TE = "transformer_engine"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """E4M3 codes as bytes, float32 scales as int32: equal bits, not equal values."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _assert_bitwise(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(_bits(g), _bits(w))


def _spread_weight(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[300, 400] weight (partial edge blocks in both dims) whose 128x128 blocks have amax spread
    over many binades, one all-zero block and, where the dtype holds it, one block so small that
    448 / amax overflows FP32 (TE then uses the dtype's largest finite value)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(300, 400, generator=g)
    span = 12 if dtype == torch.float16 else 60
    exponents = torch.randint(-span, span + 1, (3, 4), generator=g).float()
    w = w * torch.exp2(exponents).repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :400]
    w[:128, 128:256] = 0
    if dtype != torch.float16:
        w[256:, 384:] = torch.randn(44, 16, generator=g) * 1e-37
    return w.to(dtype)


def _spread_activation(dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """[2, 9, 300] activations: 1x128 groups (the last one partial) with amax over many binades,
    all-zero groups, and (bf16/fp32) a row whose 448 / amax overflows."""
    g = torch.Generator().manual_seed(seed)
    span = 10 if dtype == torch.float16 else 50
    x = torch.randn(2, 9, 300, generator=g) * torch.exp2(torch.randint(-span, span + 1, (2, 9, 1), generator=g).float())
    x[0, 2] = 0
    if dtype != torch.float16:
        x[1, 4] = torch.randn(300, generator=g) * 1e-37
    return x.to(dtype)


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_quantization_equals_te_emulation(dtype: torch.dtype, pow2: bool) -> None:
    w = _spread_weight(dtype)
    _assert_bitwise(quantize_weight_blockwise(w, pow2_scale=pow2, scale_rule=TE), te_quantize_weight_2d(w, pow2))


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_quantization_equals_te_emulation(dtype: torch.dtype, pow2: bool) -> None:
    x = _spread_activation(dtype)
    got = quantize_activation_groupwise(x, pow2_scale=pow2, scale_rule=TE)
    _assert_bitwise(got, te_quantize_activation_1d(x, pow2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp32_scales_of_the_two_rules_differ(dtype: torch.dtype) -> None:
    """The rule is really used: with FP32 scales some scales differ in the last bit (a 1-ulp
    relative difference at most), so a quantizer ignoring scale_rule fails the tests above."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(1024, 1024, generator=g)).to(dtype)
    (_, te_scales), (_, default_scales) = quantize_weight_blockwise(w, scale_rule=TE), quantize_weight_blockwise(w)
    x = torch.randn(64, 1024, generator=g).to(dtype)
    (_, te_x_scales), (_, default_x_scales) = quantize_activation_groupwise(x, scale_rule=TE), quantize_activation_groupwise(x)
    for te, default in ((te_scales, default_scales), (te_x_scales, default_x_scales)):
        assert (te != default).any()
        assert ((te.double() - default.double()).abs() / default.double()).max() < 2.4e-7


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pow2_scales_of_the_two_rules_agree_in_the_normal_range(dtype: torch.dtype) -> None:
    """Rounding 448/amax down and amax/448 up to a power of two give reciprocal scales: the two
    rules agree bit for bit (away from amax < 1e-35, where the FP32 range ends differently)."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(384, 256, generator=g) * 10.0 ** torch.randint(-3, 4, (384, 1), generator=g)).to(dtype)
    _assert_bitwise(quantize_weight_blockwise(w, pow2_scale=True, scale_rule=TE), quantize_weight_blockwise(w, pow2_scale=True))


def test_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="scale_rule must be one of"):
        quantization_factors(torch.ones(3), False, "te")
    with pytest.raises(ValueError, match="scale_rule must be one of"):
        quantize_weight_blockwise(torch.ones(4, 4), scale_rule="amax/448")


def test_linear_quantizes_activations_by_the_rule() -> None:
    g = torch.Generator().manual_seed(4)
    w_fp8, w_scale = quantize_weight_blockwise(torch.randn(200, 300, generator=g).to(torch.bfloat16), scale_rule=TE)
    x = torch.randn(64, 300, generator=g).to(torch.bfloat16)
    x_fp8, x_scale = te_quantize_activation_1d(x, False)
    expected = fp8_block_gemm(x_fp8, x_scale, w_fp8, w_scale, out_dtype=torch.float32)
    assert torch.equal(blockwise_fp8_linear(x, w_fp8, w_scale, scale_rule=TE, out_dtype=torch.float32), expected)
    assert not torch.equal(blockwise_fp8_linear(x, w_fp8, w_scale, out_dtype=torch.float32), expected)


def _experts(num_experts: int = 3, hidden: int = 256, intermediate: int = 192) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=g) * 0.05).to(torch.bfloat16)
    return w13, w2


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
def test_experts_are_quantized_per_shard_by_the_rule(pow2: bool) -> None:
    w13, w2 = _experts()
    c13, s13, c2, s2 = quantize_experts(w13, w2, pow2, TE)
    intermediate, hidden = w2.shape[2], w2.shape[1]
    for e in range(w13.shape[0]):
        for shard in ("w1", "w3", "w2"):
            where = expert_shard_rows(shard, intermediate, hidden)
            src, codes, scales = (w13, c13, s13) if where.param == "w13" else (w2, c2, s2)
            got = (codes[e, where.rows], scales[e, where.scale_rows])
            _assert_bitwise(got, te_quantize_weight_2d(src[e, where.rows], pow2))
    _, default_s13, _, default_s2 = quantize_experts(w13, w2, pow2)
    rules_agree = torch.equal(default_s13, s13) and torch.equal(default_s2, s2)
    assert rules_agree == pow2  # FP32 scales: the default rule differs somewhere


def _routing(hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [4, hidden] float32 (no bf16 rounding hides a scale's last bit), top-2 ids and weights."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, hidden, generator=g)
    return x, torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]]), torch.rand(4, 2, generator=g)


def test_moe_reference_quantizes_activations_by_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both activation quantizations of the MoE forward are TE's: replacing them with
    te_emulation's changes nothing; the default rule gives another result."""
    w13, w2 = _experts()
    experts = quantize_experts(w13, w2, False, TE)
    x, ids, weights = _routing(w2.shape[1])
    got = block_fp8_moe_reference(x, weights, ids, *experts, False, TE)
    assert not torch.equal(block_fp8_moe_reference(x, weights, ids, *experts, False), got)

    def te_activations(x: torch.Tensor, pow2_scale: bool, check_inputs: bool, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
        assert scale_rule == TE
        return te_quantize_activation_1d(x, pow2_scale)

    monkeypatch.setattr(fp8_align.quant.moe, "quantize_activation_groupwise", te_activations)
    assert torch.equal(block_fp8_moe_reference(x, weights, ids, *experts, False, TE), got)


def _linear(out_features: int = 200, in_features: int = 300) -> nn.Linear:
    """A float32 linear (a float32 output shows 1-ulp scale differences that bf16 would round away)."""
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features, bias=True)
    nn.init.normal_(layer.weight, std=0.3)
    return layer


def test_hf_emulated_and_training_linears_use_the_rule() -> None:
    """Both HF-side linears hold / compute TE's weight codes and scales and quantize activations
    by TE's rule: their output is the GEMM of te_emulation's operands, and differs from the
    default rule's."""
    layer = _linear()
    cfg = FP8Config(scale_rule=TE)
    emulated = Fp8EmulatedLinear(layer, cfg)
    _assert_bitwise((emulated.weight_fp8, emulated.weight_scale_inv), te_quantize_weight_2d(layer.weight.detach(), False))
    x = torch.randn(3, 20, 300)
    w_fp8, w_scale = te_quantize_weight_2d(layer.weight.detach(), False)
    x_fp8, x_scale = te_quantize_activation_1d(x.reshape(-1, 300), False)
    expected = (fp8_block_gemm(x_fp8, x_scale, w_fp8, w_scale, out_dtype=torch.float32) + layer.bias.detach()).reshape(3, 20, 200)
    assert torch.equal(emulated(x), expected)
    assert torch.equal(Fp8TrainingLinear(layer, cfg)(x), expected)
    assert not torch.equal(Fp8TrainingLinear(layer, FP8Config())(x), expected)


def test_hf_emulated_experts_use_the_rule() -> None:
    w13, w2 = _experts()
    module = nn.Module()
    module.gate_up_proj, module.down_proj = nn.Parameter(w13), nn.Parameter(w2)
    emulated = Fp8EmulatedExperts(module, FP8Config(scale_rule=TE))
    experts = quantize_experts(w13, w2, False, TE)
    for got, want in zip((emulated.w13_fp8, emulated.w13_scale_inv, emulated.w2_fp8, emulated.w2_scale_inv), experts):
        assert torch.equal(_bits(got), _bits(want))
    x, ids, weights = _routing(w2.shape[1])
    assert torch.equal(emulated(x, ids, weights), block_fp8_moe_reference(x, weights, ids, *experts, False, TE))
    default = Fp8EmulatedExperts(module, FP8Config())
    assert not torch.equal(default(x, ids, weights), emulated(x, ids, weights))
