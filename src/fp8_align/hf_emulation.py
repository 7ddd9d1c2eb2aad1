"""The aligned "training side" on an HF transformers model: its linears run the same block FP8.

`apply_fp8_emulation(model, cfg)` swaps every projection the recipe quantizes (see
`fp8_align.layer_selection`) for an `Fp8EmulatedLinear` holding the same E4M3 codes and scales
the vLLM plugin computes, and running `fp8_align.quant.blockwise_fp8_linear`. Everything else
(embeddings, norms, attention math, lm_head) is untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8_align.config import FP8Config
from fp8_align.layer_selection import decide_linear
from fp8_align.quant import blockwise_fp8_linear, quantize_weight_blockwise


class Fp8EmulatedLinear(nn.Module):
    """nn.Linear replacement: weight as E4M3 codes [N, K] + FP32 block scales, FP8 activations."""

    def __init__(self, linear: nn.Linear, cfg: FP8Config) -> None:
        super().__init__()
        codes, scales = quantize_weight_blockwise(linear.weight.detach(), pow2_scale=cfg.use_weight_pow2_scale)
        self.register_buffer("weight_fp8", codes)
        self.register_buffer("weight_scale_inv", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.activation_pow2_scale = cfg.use_activation_pow2_scale
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in_features] -> [..., out_features] in x's dtype."""
        return blockwise_fp8_linear(
            x, self.weight_fp8, self.weight_scale_inv, self.bias, self.activation_pow2_scale, out_dtype=x.dtype, check_inputs=False
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block_fp8"


def apply_fp8_emulation(model: nn.Module, cfg: FP8Config, num_hidden_layers: int | None = None) -> list[str]:
    """Replace the recipe's linears in `model` in place; returns the names that became FP8.

    `num_hidden_layers` defaults to `model.config.num_hidden_layers` (HF models).
    """
    depth = int(num_hidden_layers if num_hidden_layers is not None else model.config.num_hidden_layers)
    cfg.validate_for_model(depth)
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not decide_linear(name, depth, cfg).fp8:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Fp8EmulatedLinear(module, cfg))
        replaced.append(name)
    return replaced
