"""benchmarks/fp8_amplification.py: its two operator variants are the same math as HF's, rounded
once instead of twice, so they differ from HF by BF16 rounding only, and they do differ."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.fp8_amplification import perturbed, table

BF16_EPS = 2.0**-8  # relative spacing of BF16 values (8 significant bits)


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320, initializer_range=0.2)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    for layer in model.model.layers:  # non-trivial norm weights, so two roundings differ from one
        layer.input_layernorm.weight.data.uniform_(0.5, 1.5)
    return model


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of BF16 spacing at max(|a|, |b|)."""
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp(min=1e-30)
    return (a.float() - b.float()).abs() / (scale * BF16_EPS)


def test_rmsnorm_variant_differs_by_bf16_rounding(tiny: LlamaForCausalLM) -> None:
    norm = tiny.model.layers[0].input_layernorm
    x = torch.randn(64, 256, dtype=torch.bfloat16) * 3
    ours = perturbed(tiny, "rmsnorm").model.layers[0].input_layernorm(x)
    theirs = norm(x)
    exact = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)) * norm.weight.float()
    assert _ulps(ours, exact).max() <= 1.0  # one correctly rounded BF16 rounding (half a spacing)
    assert _ulps(ours, theirs).max() <= 3.0  # HF's two roundings stay within a few spacings
    assert not torch.equal(ours, theirs)


def test_silu_mul_variant_differs_by_bf16_rounding(tiny: LlamaForCausalLM) -> None:
    mlp, mlp_once = tiny.model.layers[0].mlp, perturbed(tiny, "silu_mul").model.layers[0].mlp
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    hf_product = mlp.act_fn(gate) * up
    once = (torch.nn.functional.silu(gate.float()) * up.float()).to(torch.bfloat16)
    assert _ulps(once, hf_product).max() <= 3.0 and not torch.equal(once, hf_product)
    assert torch.equal(mlp_once(x), mlp.down_proj(once))


def test_perturbed_leaves_the_model_alone(tiny: LlamaForCausalLM) -> None:
    before = copy.deepcopy(tiny.state_dict())
    ids = torch.tensor([[1, 5, 9, 200]])
    logits = tiny(ids).logits
    other = perturbed(tiny, "both")
    assert torch.equal(tiny(ids).logits, logits)
    assert all(torch.equal(before[k], v) for k, v in tiny.state_dict().items())
    assert not torch.equal(other(ids).logits, logits)


def test_table_lists_every_pair() -> None:
    pairs = [{"sampling": s, "precision": p, "perturbation": w, "mult_prob_error": 1.0, "max_abs_log_ratio": 0.0}
             for s in ("greedy", "sampled") for p in ("bf16", "fp8", "fp8_pow2") for w in ("rmsnorm", "silu_mul", "both")]  # fmt: skip
    assert len(table({"pairs": pairs}).splitlines()) == 2 + 9
