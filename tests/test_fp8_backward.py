"""The block-FP8 backward of the bitwise trainer's FP8 linears (`FP8Config(bitwise_linear_backward="fp8")`,
`fp8_align.hf_training.fp8_backward`).

Each gradient product against an independent reference: the operands quantized with
`fp8_align.quant`'s quantizers along the product's reduction dimension (the tokens padded by
hand), dequantized and multiplied in FP64; the product under test rounds to BF16 once, so they
agree within a BF16 rounding. On CPU the module's own path is the dequantized FP32 product; the
cuBLAS GEMMs it runs on CUDA are checked with the same function on the GPU
(tests/test_gpu_bitwise.py). Then the setting on whole trainers: the log-probs do not move, the
linears' gradients do (by FP8 rounding), the megatron-core model gets BitwiseForward's bits, and
shapes the GEMMs cannot take are refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8_align.config import FP8Config
from fp8_align.hf_training import BitwiseForward
from fp8_align.hf_training.fp8_backward import input_gradient, weight_gradient
from fp8_align.quant import quantize_activation_groupwise
from fp8_align.quant.groupwise import dequantize_groupwise
from fp8_align.quant.blockwise import dequantize_blockwise
from fp8_align.quant.shards import quantize_shards
from fp8_align.rounding import Rounding
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES

ROUNDINGS = [Rounding(), Rounding(weight_pow2=True, activation_pow2=True), Rounding(scale_rule="transformer_engine")]


def _rows_fp64(x: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """x [R, C] quantized per row in 1x128 groups along C, read back in FP64."""
    codes, scales = quantize_activation_groupwise(x, pow2_scale=rounding.activation_pow2, scale_rule=rounding.scale_rule)
    return dequantize_groupwise(codes, scales, dtype=torch.float32).double()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


#: How far a product may sit from the FP64 product of its dequantized operands, per unit of the sum
#: of absolute products (on top of the BF16 rounding of the result): FP32 accumulation on CPU;
#: on Hopper, the FP8 tensor core's accumulation inside each 128-deep slice (about 14 bits kept),
#: the allowance tests/test_gpu_bitwise.py gives the engine's FP8 GEMM.
ACCUMULATION = {"cpu": 2**-14, "cuda": 2**-12}


def check_gradient_products(shard_sizes: list[int], k: int, tokens: int, rounding: Rounding, device: str) -> tuple[float, float]:
    """dx and dw of a stacked layer of `shard_sizes` rows and K = `k` over `tokens` tokens on
    `device` against the FP64 products of the dequantized operands: each element within a BF16
    rounding (2^-8 relative) plus `ACCUMULATION[device]` of its sum of absolute products; and both
    within FP8's rounding of the exact gradients (a few percent). Returns, for dx and dw, the
    largest error in units of the sum of absolute products, past the BF16 rounding."""
    torch.manual_seed(0)
    n = sum(shard_sizes)
    x, weight, grad = (t.to(torch.bfloat16).to(device) for t in (torch.randn(tokens, k), torch.randn(n, k) * 0.05, torch.randn(tokens, n) * 1e-3))
    codes, scales = quantize_shards(weight, shard_sizes, rounding.weight_pow2, rounding.scale_rule)

    dx = input_gradient(grad, codes, scales, rounding)
    dx_operands = (_rows_fp64(grad, rounding), dequantize_blockwise(codes, scales, dtype=torch.float32).double())
    dw = weight_gradient(grad, x, rounding)
    padding = -tokens % 128
    grad_t, x_t = F.pad(grad, (0, 0, 0, padding)).t(), F.pad(x, (0, 0, 0, padding)).t()
    dw_operands = (_rows_fp64(grad_t.contiguous(), rounding), _rows_fp64(x_t.contiguous(), rounding).t())
    errors = []
    for got, (a, b) in ((dx, dx_operands), (dw, dw_operands)):
        want, magnitude = a @ b, a.abs() @ b.abs()
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        past_rounding = ((got.double() - want).abs() - 2**-8 * want.abs()).clamp_min(0) / magnitude
        errors.append(past_rounding.max().item())
        assert errors[-1] <= ACCUMULATION[device], errors
    assert _relative(dx, grad.double() @ weight.double()) < 0.05
    assert _relative(dw, grad.double().t() @ x.double()) < 0.05
    return errors[0], errors[1]


@pytest.mark.parametrize("rounding", ROUNDINGS, ids=["fp32_scales", "pow2_scales", "te_rule"])
def test_gradient_products_are_the_dequantized_references(rounding: Rounding) -> None:
    """q|k|v-like shards of whole blocks over 300 tokens (padded to 384 for dw) and K = 256."""
    check_gradient_products([256, 128, 128], 256, 300, rounding, "cpu")


def test_the_setting_needs_the_bitwise_fp8_recipe() -> None:
    assert FP8Config(on_policy="bitwise", bitwise_linear_backward="fp8").bitwise_linear_backward == "fp8"
    for kwargs in ({}, {"on_policy": "bitwise", "precision": "bf16"}, {"on_policy": "bitwise", "fp8": None},
                   {"on_policy": "bitwise", "fp8": "hybrid", "allow_recipe_mismatch": True}):  # fmt: skip
        with pytest.raises(ValueError, match="bitwise_linear_backward='fp8'"):
            FP8Config(bitwise_linear_backward="fp8", **kwargs)


def _logprobs_and_gradients(hf: torch.nn.Module, cfg: FP8Config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    hf.zero_grad(set_to_none=True)
    logprobs = torch.cat(BitwiseForward(hf, cfg).token_logprobs(SEQUENCES, PROMPT_LENS))
    logprobs.sum().backward()
    return logprobs.detach(), {name: p.grad.clone() for name, p in hf.named_parameters()}


def test_the_trainer_keeps_its_log_probs_and_moves_only_by_fp8_rounding() -> None:
    """BitwiseForward with each backward on the same tiny Qwen3: equal log-probs; every gradient
    within FP8's rounding of the BF16 backward's (under 10%, relative: the linears' own products
    and what flows through their input gradients), and the FP8 linears' weight gradients differ."""
    hf = tiny_hf_model("qwen3")
    bf16_logprobs, bf16_grads = _logprobs_and_gradients(hf, FP8Config(on_policy="bitwise"))
    fp8_logprobs, fp8_grads = _logprobs_and_gradients(hf, FP8Config(on_policy="bitwise", bitwise_linear_backward="fp8"))
    assert torch.equal(bf16_logprobs, fp8_logprobs)
    for name, grad in bf16_grads.items():
        assert _relative(fp8_grads[name], grad) < 0.1, name
    linears = [name for name in bf16_grads if name.endswith("proj.weight")]
    assert linears and any(not torch.equal(fp8_grads[name], bf16_grads[name]) for name in linears)


def test_partial_blocks_are_refused_at_the_forward() -> None:
    """A Llama of hidden 192 (q|k|v shards 192/64/64): its FP8 layers are not whole 128-blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                         vocab_size=1000, max_position_embeddings=256)  # fmt: skip
    hf = LlamaForCausalLM(config).to(torch.bfloat16)
    BitwiseForward(hf, FP8Config(on_policy="bitwise")).token_logprobs(SEQUENCES, PROMPT_LENS)
    with pytest.raises(ValueError, match=r"whole 128-blocks only .*bitwise_linear_backward='bf16'"):
        BitwiseForward(hf, FP8Config(on_policy="bitwise", bitwise_linear_backward="fp8")).token_logprobs(SEQUENCES, PROMPT_LENS)
