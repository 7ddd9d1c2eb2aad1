"""fp8_align.hf_training: the trainable block-FP8 linear agrees with the inference emulation and
the vLLM plugin's quantizer, and its backward is the BF16 straight-through gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fp8_align import FP8Config
from fp8_align.hf_emulation import Fp8EmulatedLinear, apply_fp8_emulation
from fp8_align.hf_training import Fp8TrainingLinear, apply_fp8_training
from fp8_align.quant import blockwise_fp8_linear, quantize_weight_blockwise
from tests.frozen_checks import assert_frozen_block_contract
from tests.model_factory import make_tiny_llama


def _linear(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16, bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(layer.weight, std=0.3)
    return layer.to(dtype)


@pytest.mark.parametrize("pow2", [False, True])
def test_forward_is_bit_identical_to_the_inference_emulation(pow2: bool) -> None:
    # 200 x 300: partial blocks in both dimensions
    layer = _linear(200, 300, bias=True)
    cfg = FP8Config(use_weight_pow2_scale=pow2, use_activation_pow2_scale=pow2)
    x = torch.randn(3, 7, 300).to(torch.bfloat16)
    got = Fp8TrainingLinear(layer, cfg)(x)
    expected = Fp8EmulatedLinear(layer, cfg)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 7, 200)
    assert torch.equal(got, expected)


def test_backward_is_the_straight_through_gradient_of_the_unquantized_linear() -> None:
    layer = _linear(130, 260, dtype=torch.float32, bias=True)
    fp8 = Fp8TrainingLinear(layer, FP8Config())
    x = torch.randn(5, 260, requires_grad=True)
    grad_out = torch.randn(5, 130)
    fp8(x).backward(grad_out)
    grads = (x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    x.grad, layer.weight.grad, layer.bias.grad = None, None, None
    nn.functional.linear(x, layer.weight, layer.bias).backward(grad_out)
    for got, expected in zip(grads, (x.grad, layer.weight.grad, layer.bias.grad)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_forward_requantizes_the_weight_after_an_optimizer_step() -> None:
    layer = _linear(128, 256)
    fp8 = Fp8TrainingLinear(layer, FP8Config())
    assert fp8.weight is layer.weight  # the optimizer and the weight sync see the same Parameter
    x = torch.randn(4, 256).to(torch.bfloat16)
    before = fp8(x)
    with torch.no_grad():
        layer.weight.mul_(1.5)
    codes, scales = quantize_weight_blockwise(layer.weight.detach())
    after = fp8(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, blockwise_fp8_linear(x, codes, scales))


def test_apply_fp8_training_follows_the_layer_rule_and_matches_the_emulated_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = make_tiny_llama(tmp_path / "tiny")
    cfg = FP8Config(num_first_layers_in_bf16=1)
    trained = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    params_before = {name: p for name, p in trained.named_parameters()}
    replaced = apply_fp8_training(trained, cfg)
    emulated = apply_fp8_emulation(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16), cfg)
    assert replaced == emulated
    assert len(replaced) == 2 * 7 and not any(".layers.0." in n for n in replaced) and "lm_head" not in replaced
    assert {name: p for name, p in trained.named_parameters()} == params_before  # same Parameter objects
    ids = torch.randint(0, 512, (2, 9))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    apply_fp8_emulation(reference, cfg)
    logits = trained(input_ids=ids).logits
    assert torch.equal(logits, reference(input_ids=ids).logits)
    logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in trained.named_parameters() if "proj" in n)


def test_frozen_fp8_weights_quantize_the_aligned_linears_once_with_the_same_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`frozen_fp8_weights` on a model given the aligned forward by `apply_fp8_training`: inside the
    block each FP8 linear quantizes its weight at the block's first forward only (counted at the
    quantizer), and the logits and every gradient are the bits of quantizing at every forward; a
    weight changed in place inside the block raises RuntimeError, after the block the changed weight
    is used; a nested block and a model with no FP8 linear raise ValueError."""
    from transformers import AutoModelForCausalLM

    from fp8_align.hf_training import frozen_fp8_weights, linear

    checkpoint = make_tiny_llama(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    names = apply_fp8_training(model, FP8Config())
    quantized: list[int] = []
    quantize = linear.quantize_weight_blockwise

    def counting(weight: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        quantized.append(1)
        return quantize(weight, **kwargs)

    monkeypatch.setattr(linear, "quantize_weight_blockwise", counting)
    ids = torch.randint(0, 512, (2, 9))

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        quantized.clear()
        model.zero_grad()
        logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(quantized)

    assert_frozen_block_contract(model, run, len(names), model.get_submodule(names[0]).weight)
    with pytest.raises(ValueError, match="not converted by make_bitwise or apply_fp8_training"):
        with frozen_fp8_weights(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)):
            pass


def test_fused_moe_experts_are_refused() -> None:
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.zeros(4, 256, 128))
    experts.down_proj = nn.Parameter(torch.zeros(4, 128, 128))
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].mlp = nn.Module()
    model.layers[0].mlp.experts = experts
    with pytest.raises(ValueError, match="layers.0.mlp.experts: fused MoE experts have no FP8 training forward"):
        apply_fp8_training(model, FP8Config(), num_hidden_layers=1)


def test_engine_forward_kernel_plans_the_stacked_shape_and_refuses_cpu() -> None:
    """forward_kernel="engine" picks the GPU backend for vLLM's stacked layer (q|k|v, gate|up); the
    choice itself runs on the GPU box (tests/test_gpu_kernels.py); on CPU it is refused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fp8_align.hf_training import Fp8TrainingLinear, apply_fp8_training, stacked_shard_sizes

    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=64, vocab_size=128)).to(torch.bfloat16)  # fmt: skip
    assert stacked_shard_sizes(model, "model.layers.0.self_attn.k_proj") == (256, 128, 128)
    assert stacked_shard_sizes(model, "model.layers.0.mlp.up_proj") == (384, 384)
    assert stacked_shard_sizes(model, "model.layers.0.mlp.down_proj") == (256,)
    names = apply_fp8_training(model, FP8Config(), forward_kernel="engine")
    layer = model.get_submodule("model.layers.0.self_attn.v_proj")
    assert isinstance(layer, Fp8TrainingLinear) and layer.shard_sizes == (256, 128, 128) and len(names) == 7
    with pytest.raises(RuntimeError, match="runs the plugin's CUDA kernels"):
        layer(torch.randn(2, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="forward_kernel must be one of"):
        Fp8TrainingLinear(torch.nn.Linear(4, 4), FP8Config(), "cutlass")
