"""The aligned training forward on an HF transformers model: block-FP8 linears that still train.

`apply_fp8_training(model, cfg)` swaps every linear the recipe quantizes (the rule of
`fp8_align.layer_selection`, as `fp8_align.hf_emulation` and the vLLM plugin use) for an
`Fp8TrainingLinear`. It keeps the original BF16 `weight` Parameter (so optimizers, state dicts and
weight sync see the same tensors), and every forward quantizes the current weight in 128x128
blocks and the input in 1x128 groups exactly as the vLLM plugin does with the weights it is sent,
then runs `fp8_align.quant.blockwise_fp8_linear`. The backward is BF16: gradients are those of
`x @ w.T` with the BF16 weight (a straight-through estimator for both quantizers), which is what
a BF16-backward FP8 recipe computes.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8_align.config import FP8Config
from fp8_align.hf_emulation import is_fused_experts, recipe_fp8_modules, replace_submodule
from fp8_align.quant import blockwise_fp8_linear, quantize_weight_blockwise


class _BlockFp8LinearFunction(torch.autograd.Function):
    """y = block-FP8(x) @ block-FP8(w).T (+ b) forward; BF16 straight-through backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        weight_pow2_scale: bool,
        activation_pow2_scale: bool,
        scale_rule: str,
    ) -> torch.Tensor:
        codes, scale_inv = quantize_weight_blockwise(weight.detach(), pow2_scale=weight_pow2_scale, scale_rule=scale_rule)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return blockwise_fp8_linear(
            x.detach(), codes, scale_inv, None if bias is None else bias.detach(), activation_pow2_scale,
            out_dtype=x.dtype, scale_rule=scale_rule,
        )  # fmt: skip

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1]).to(weight.dtype)
        grad_x = (grad_2d @ weight).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad_2d.T @ x.reshape(-1, x.shape[-1]).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = grad_2d.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


class Fp8TrainingLinear(nn.Module):
    """nn.Linear replacement holding the same `weight` / `bias` Parameters, block-FP8 forward.

    Input [..., in_features] in the weight's dtype (BF16 for a BF16 model) -> [..., out_features]
    in the input's dtype. The FP8 codes are recomputed from the current weight at every forward,
    so after an optimizer step the layer computes what a vLLM engine sent that weight computes.
    """

    def __init__(self, linear: nn.Linear, cfg: FP8Config) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_pow2_scale = cfg.use_weight_pow2_scale
        self.activation_pow2_scale = cfg.use_activation_pow2_scale
        self.scale_rule = cfg.scale_rule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BlockFp8LinearFunction.apply(
            x, self.weight, self.bias, self.weight_pow2_scale, self.activation_pow2_scale, self.scale_rule
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block_fp8_forward, bf16_backward"


def apply_fp8_training(model: nn.Module, cfg: FP8Config, num_hidden_layers: int | None = None) -> list[str]:
    """Replace the recipe's linears in `model` in place; returns the names that became FP8.

    `num_hidden_layers` defaults to `model.config.num_hidden_layers` (HF models). Fused MoE expert
    modules the recipe runs in FP8 are refused (ValueError): their training forward is not
    implemented here.
    """
    chosen = recipe_fp8_modules(model, cfg, num_hidden_layers)
    for name, module in chosen:
        if is_fused_experts(module):
            raise ValueError(f"{name}: fused MoE experts have no FP8 training forward in fp8_align.hf_training")
    for name, module in chosen:
        replace_submodule(model, name, Fp8TrainingLinear(module, cfg))
    return [name for name, _ in chosen]
