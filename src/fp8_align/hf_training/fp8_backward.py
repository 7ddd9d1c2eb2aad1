"""The block-FP8 backward of the bitwise trainer's FP8 linears (`FP8Config.bitwise_linear_backward="fp8"`).

y = x @ w.T runs forward through the engine's block-FP8 GEMM (`Fp8Gemm`: x in 1x128 groups, w in
128x128 blocks). Its two gradient products run through that same GEMM, each operand quantized to
E4M3 along the product's reduction dimension as TransformerEngine's blockwise recipe quantizes
them: dx = dy @ w with dy in 1x128 groups along the outputs and the forward's weight blocks
transposed; dw = dy.T @ x with dy.T in 1x128 groups along the tokens and x.T in 128x128 blocks.
The forward, and so the log-probs, do not change; the gradients are the BF16 straight-through
gradients' products with quantized operands (`tests/test_fp8_backward.py` checks them against a
pure-torch dequantized reference).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from fp8_align.quant.dispatch import quantize_weight_into
from fp8_align.quant.shards import shard_slices
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState

#: A block-FP8 product of a quantized layer (codes, scale grids, shard sizes, rounding) with x [T, K], + bias.
Fp8Gemm = Callable[[Any, torch.Tensor, torch.Tensor | None], torch.Tensor]
BLOCK = 128


def fp8_layer(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rounding: Rounding, shard_sizes: Sequence[int],
              bias: torch.Tensor | None = None) -> SimpleNamespace:  # fmt: skip
    """What an `Fp8Gemm` takes as its layer: codes [N, K] float8_e4m3fn, the shards' stacked 128x128
    scale grids [sum_s ceil(n_s/128), ceil(K/128)] FP32, output `dtype`, `rounding` for the input's
    1x128 groups."""
    state = Fp8AlignLayerState("linear", "bitwise_trainer", rounding, shard_sizes=list(shard_sizes))
    return SimpleNamespace(weight=codes, weight_scale_inv=scales, bias=bias, params_dtype=dtype, fp8_align=state)


def input_gradient(grad: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, shard_sizes: Sequence[int], rounding: Rounding,
                   gemm: Fp8Gemm) -> torch.Tensor:  # fmt: skip
    """dx [T, K] = grad [T, N] @ w [N, K] (grad's dtype), w given as the forward's stacked codes and
    scales (each shard its own 128-row grid), in one product: grad is quantized by the GEMM per token
    in 1x128 groups along N, the weight's 128x128 blocks serve transposed. Shards that are not whole
    blocks are padded with zero columns to whole blocks first, so each 128-group of the product is
    one shard's and meets one scale (as each shard's own product would)."""
    k = codes.shape[1]
    if all(size % BLOCK == 0 for size in shard_sizes):
        codes_t, grad_p = codes.t().contiguous(), grad.contiguous()
    else:
        widths = [-(-size // BLOCK) * BLOCK for size in shard_sizes]
        codes_t = torch.zeros(k, sum(widths), dtype=codes.dtype, device=codes.device)
        grad_p = grad.new_zeros(grad.shape[0], sum(widths))
        start = 0
        for (rows, _), width in zip(shard_slices(list(shard_sizes)), widths):
            size = rows.stop - rows.start
            codes_t[:, start : start + size] = codes[rows].t()
            grad_p[:, start : start + size] = grad[:, rows]
            start += width
    return gemm(fp8_layer(codes_t, scales.t().contiguous(), grad.dtype, rounding, [k]), grad_p, None)


def weight_gradient(grad: torch.Tensor, x: torch.Tensor, rounding: Rounding, gemm: Fp8Gemm) -> torch.Tensor:
    """dw [N, K] = grad.T [N, T] @ x [T, K] (x's dtype): x.T quantized in 128x128 blocks, grad.T
    per output channel in 1x128 groups along the tokens (by the GEMM); the token count is padded
    with zeros to whole blocks (zero products)."""
    tokens = x.shape[0]
    padded = -(-tokens // BLOCK) * BLOCK
    x_t = x.new_zeros(x.shape[1], padded)
    x_t[:, :tokens] = x.t()
    grad_t = grad.new_zeros(grad.shape[1], padded)
    grad_t[:, :tokens] = grad.t()
    codes, scales = quantize_weight_into(x_t, rounding.weight_pow2, check_finite=False, scale_rule=rounding.scale_rule)
    return gemm(fp8_layer(codes, scales, x.dtype, rounding, [x.shape[1]]), grad_t, None)
