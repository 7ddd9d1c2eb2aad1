"""The aligned "training side" on an HF transformers model: its linears run the same block FP8.

`apply_fp8_emulation(model, cfg)` swaps every linear the recipe quantizes (see
`fp8_align.layer_selection`) for an `Fp8EmulatedLinear` holding the same E4M3 codes and scales
the vLLM plugin computes, and running `fp8_align.quant.blockwise_fp8_linear`; and every
transformers-5 fused experts module (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I] Parameters,
as Qwen3-MoE's) for an `Fp8EmulatedExperts` running `fp8_align.quant.moe.block_fp8_moe_reference`.
Everything else (embeddings, norms, routers, attention math, lm_head) is untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8_align.config import FP8Config
from fp8_align.layer_selection import decide_layer, num_routed_experts
from fp8_align.quant import blockwise_fp8_linear, quantize_weight_blockwise
from fp8_align.quant.moe import block_fp8_moe_reference, quantize_experts


class Fp8EmulatedLinear(nn.Module):
    """nn.Linear replacement: weight as E4M3 codes [N, K] + FP32 block scales, FP8 activations."""

    def __init__(self, linear: nn.Linear, cfg: FP8Config) -> None:
        super().__init__()
        self.rounding = cfg.rounding
        codes, scales = quantize_weight_blockwise(
            linear.weight.detach(), pow2_scale=self.rounding.weight_pow2, scale_rule=self.rounding.scale_rule
        )
        self.register_buffer("weight_fp8", codes)
        self.register_buffer("weight_scale_inv", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in_features] -> [..., out_features] in x's dtype."""
        return blockwise_fp8_linear(
            x, self.weight_fp8, self.weight_scale_inv, self.bias, self.rounding.activation_pow2,
            out_dtype=x.dtype, check_inputs=False, scale_rule=self.rounding.scale_rule,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block_fp8"


class Fp8EmulatedExperts(nn.Module):
    """Replacement for a transformers-5 fused experts module (SiLU-gated, no biases): the experts
    as block-FP8 codes and scales (`fp8_align.quant.moe` layout), forward by
    `block_fp8_moe_reference`. Called as the original: (hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H] in hidden_states' dtype."""

    def __init__(self, experts: nn.Module, cfg: FP8Config) -> None:
        super().__init__()
        self.rounding = cfg.rounding
        c13, s13, c2, s2 = quantize_experts(
            experts.gate_up_proj.detach(), experts.down_proj.detach(), self.rounding.weight_pow2, self.rounding.scale_rule
        )
        for name, tensor in (("w13_fp8", c13), ("w13_scale_inv", s13), ("w2_fp8", c2), ("w2_scale_inv", s2)):
            self.register_buffer(name, tensor)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return block_fp8_moe_reference(
            hidden_states, top_k_weights, top_k_index, self.w13_fp8, self.w13_scale_inv, self.w2_fp8,
            self.w2_scale_inv, self.rounding.activation_pow2, self.rounding.scale_rule,
        )  # fmt: skip


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers-5 fused experts module: `gate_up_proj` [E, 2I, H] and `down_proj` Parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3


def recipe_fp8_modules(model: nn.Module, cfg: FP8Config, num_hidden_layers: int | None = None) -> list[tuple[str, nn.Module]]:
    """(name, module) of every `nn.Linear` and transformers-5 fused experts module of `model` that
    the recipe runs in FP8 (`fp8_align.layer_selection`), in `named_modules` order.

    `num_hidden_layers` defaults to `model.config.num_hidden_layers` (HF models); `cfg` is
    validated against it.
    """
    depth = int(num_hidden_layers if num_hidden_layers is not None else model.config.num_hidden_layers)
    cfg.validate_for_model(depth)
    experts = num_routed_experts(model.config.get_text_config()) if hasattr(model, "config") else None
    chosen = []
    for name, module in model.named_modules():
        if is_fused_experts(module):
            decision = decide_layer(name, depth, cfg, kind="experts")
        elif isinstance(module, nn.Linear):
            decision = decide_layer(
                name, depth, cfg, output_size=module.out_features, input_size=module.in_features, num_experts=experts
            )
        else:
            continue
        if decision.fp8:
            chosen.append((name, module))
    return chosen


def replace_submodule(model: nn.Module, name: str, replacement: nn.Module) -> None:
    """Put `replacement` where `model`'s submodule `name` is."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, replacement)


def apply_fp8_emulation(model: nn.Module, cfg: FP8Config, num_hidden_layers: int | None = None) -> list[str]:
    """Replace the recipe's linears and fused experts in `model` in place; returns the names that became FP8.

    `num_hidden_layers` defaults to `model.config.num_hidden_layers` (HF models).
    """
    replaced = []
    for name, module in recipe_fp8_modules(model, cfg, num_hidden_layers):
        kind = Fp8EmulatedExperts if is_fused_experts(module) else Fp8EmulatedLinear
        replace_submodule(model, name, kind(module, cfg))
        replaced.append(name)
    return replaced
