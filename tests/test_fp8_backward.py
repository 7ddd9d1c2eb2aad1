"""The block-FP8 backward of the bitwise trainer's FP8 linears (`FP8Config.bitwise_linear_backward="fp8"`,
`fp8_align.hf_training.fp8_backward`) on CPU, where the GEMM is the emulated block-FP8 product.

Each gradient product against an independent reference: the operands quantized with
`fp8_align.quant`'s own quantizers along the product's reduction dimension, dequantized, multiplied
in FP64 (the emulated GEMM multiplies the same codes in FP32 and rounds to BF16 once, so they agree
within a BF16 rounding of the result). Both also sit within FP8's rounding of the exact BF16
gradient. Then the whole trainer: the log-probs do not move, the gradients do, and the megatron-core
model gets BitwiseForward's bits. The GPU's GEMM: tests/test_gpu_bitwise.py.
"""

from __future__ import annotations

import pytest
import torch

from fp8_align.config import FP8Config
from fp8_align.hf_training import BitwiseForward
from fp8_align.hf_training.engine_ops import fp8_gemm_for
from fp8_align.hf_training.fp8_backward import input_gradient, weight_gradient
from fp8_align.quant import quantize_activation_groupwise
from fp8_align.quant.blockwise import dequantize_blockwise
from fp8_align.quant.groupwise import dequantize_groupwise
from fp8_align.quant.shards import quantize_shards, shard_slices
from fp8_align.rounding import Rounding
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES

ROUNDINGS = [Rounding(weight_pow2=False, activation_pow2=False), Rounding(weight_pow2=True, activation_pow2=True)]


def _fake_quantized_rows(x: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """x [R, C] quantized per row in 1x128 groups along C, read back in FP64."""
    codes, scale = quantize_activation_groupwise(x, pow2_scale=rounding.activation_pow2, scale_rule=rounding.scale_rule)
    return dequantize_groupwise(codes, scale, dtype=torch.float32).double()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_gradient_products(shard_sizes: list[int], rounding: Rounding, tokens: int, k: int, device: str) -> None:
    """dx and dw of stacked shards of `shard_sizes` rows over `tokens` tokens and K = `k` through
    the trainer's GEMM on `device` against the FP64 products of the dequantized operands (within a
    BF16 rounding of the result), and within FP8's rounding of the exact gradients."""
    torch.manual_seed(0)
    n = sum(shard_sizes)
    x = torch.randn(tokens, k).to(torch.bfloat16)
    weight = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    grad = (torch.randn(tokens, n) * 1e-3).to(torch.bfloat16)
    codes, scales = quantize_shards(weight, shard_sizes, rounding.weight_pow2, rounding.scale_rule)
    gemm = fp8_gemm_for(FP8Config(on_policy="bitwise"), torch.device(device), [codes.to(device)])
    on = lambda t: t.to(device)  # noqa: E731

    dx = input_gradient(on(grad), on(codes), on(scales), shard_sizes, rounding, gemm).cpu()
    dequantized = torch.cat([dequantize_blockwise(codes[rows], scales[grid], dtype=torch.float32) for rows, grid in shard_slices(shard_sizes)])
    grad_q = torch.cat([_fake_quantized_rows(grad[:, rows], rounding) for rows, _ in shard_slices(shard_sizes)], dim=1)
    dx_reference = grad_q @ dequantized.double()
    assert dx.shape == (tokens, k) and dx.dtype == torch.bfloat16
    assert torch.allclose(dx.double(), dx_reference, rtol=2**-7, atol=1e-5 * dx_reference.abs().max().item())

    dw = weight_gradient(on(grad), on(x), rounding, gemm).cpu()
    padded = -(-tokens // 128) * 128
    x_t = torch.zeros(k, padded, dtype=torch.bfloat16)
    x_t[:, :tokens] = x.t()
    grad_t = torch.zeros(n, padded, dtype=torch.bfloat16)
    grad_t[:, :tokens] = grad.t()
    x_codes, x_scales = quantize_shards(x_t, [k], rounding.weight_pow2, rounding.scale_rule)
    dw_reference = _fake_quantized_rows(grad_t, rounding) @ dequantize_blockwise(x_codes, x_scales, dtype=torch.float32).double().t()
    assert dw.shape == (n, k) and dw.dtype == torch.bfloat16
    assert torch.allclose(dw.double(), dw_reference, rtol=2**-7, atol=1e-5 * dw_reference.abs().max().item())

    # Both within FP8's rounding of the exact gradient (E4M3: 3 mantissa bits, a relative step of
    # 2^-4 per element; summed over hundreds of terms the product's relative error is a few percent).
    assert _relative(dx, grad.double() @ weight.double()) < 0.05
    assert _relative(dw, grad.double().t() @ x.double()) < 0.05


@pytest.mark.parametrize("rounding", ROUNDINGS, ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("shard_sizes", [[256, 128, 128], [192, 64, 64]], ids=["whole_blocks", "partial_blocks"])
def test_gradient_products_are_the_dequantized_references(shard_sizes: list[int], rounding: Rounding) -> None:
    """q|k|v-like stacked shards (whole 128-row blocks, and SmolLM2's 192/64: padded to whole blocks)
    over 300 tokens (padded to whole blocks) and K = 320 (a partial block)."""
    check_gradient_products(shard_sizes, rounding, tokens=300, k=320, device="cpu")


def test_the_setting_needs_the_bitwise_fp8_recipe() -> None:
    assert FP8Config(on_policy="bitwise", bitwise_linear_backward="fp8").bitwise_linear_backward == "fp8"
    for kwargs in ({}, {"on_policy": "bitwise", "precision": "bf16"}):
        with pytest.raises(ValueError, match="bitwise_linear_backward='fp8'"):
            FP8Config(bitwise_linear_backward="fp8", **kwargs)


def _logprobs_and_gradients(cfg: FP8Config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    hf = tiny_hf_model("qwen3")
    logprobs = torch.cat(BitwiseForward(hf, cfg).token_logprobs(SEQUENCES, PROMPT_LENS))
    logprobs.sum().backward()
    return logprobs.detach(), {name: p.grad for name, p in hf.named_parameters()}


def test_the_trainer_keeps_its_log_probs_and_moves_only_the_fp8_linears_gradients() -> None:
    """BitwiseForward with each backward on the same tiny Qwen3: equal log-probs; the FP8 linears'
    weight gradients differ by FP8 rounding (under 10%, relative); the embedding's and norms' too
    (their gradients flow through the linears' input gradients) but as little."""
    bf16_logprobs, bf16_grads = _logprobs_and_gradients(FP8Config(on_policy="bitwise"))
    fp8_logprobs, fp8_grads = _logprobs_and_gradients(FP8Config(on_policy="bitwise", bitwise_linear_backward="fp8"))
    assert torch.equal(bf16_logprobs, fp8_logprobs)
    linears = [name for name in bf16_grads if name.endswith("proj.weight")]
    assert linears
    for name, grad in bf16_grads.items():
        assert fp8_grads[name] is not None, name
        assert _relative(fp8_grads[name], grad) < 0.1, name
    assert any(not torch.equal(fp8_grads[name], bf16_grads[name]) for name in linears)
