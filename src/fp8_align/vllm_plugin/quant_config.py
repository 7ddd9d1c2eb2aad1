"""The `fp8_align` vLLM quantization method: config object and per-layer method choice.

Imports vLLM; only `register()` (the plugin entry point) and vLLM itself import this module.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from fp8_align.config import FP8Config
from fp8_align.layer_selection import REASON_UNSUPPORTED, LayerDecision, decide_layer, num_routed_experts
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.compat import routed_experts_class
from fp8_align.vllm_plugin.engine_args import QUANTIZATION_NAME, config_from_engine
from fp8_align.vllm_plugin.engine_plan import default_attention_backend
from fp8_align.vllm_plugin.layer_plan import record_decision
from fp8_align.vllm_plugin.linear.method import Fp8AlignBf16LinearMethod, Fp8AlignLinearMethod
from fp8_align.vllm_plugin.moe.experts import unsupported_experts_reason
from fp8_align.vllm_plugin.on_policy import check_bitwise_engine
from fp8_align.vllm_plugin.patches import apply_patches, set_moe_activation_rounding


class Fp8AlignQuantConfig(QuantizationConfig):
    """Online block FP8 from a BF16 checkpoint, configured by an `FP8Config`."""

    def __init__(self, fp8_config: FP8Config | None = None) -> None:
        super().__init__()
        self.fp8_config = config_from_engine(None) if fp8_config is None else fp8_config
        #: The scale rounding of every FP8 layer of this engine, built once (each layer's state holds it).
        self.rounding = self.fp8_config.rounding
        #: Engine settings checked and defaulted, patches applied (once per engine, at its first layer).
        self._engine_checked = False
        #: The model's decoder-layer count and routed experts per MoE layer (read once per engine).
        self._depth = 0
        self._routed_experts = 0
        #: The attention backend fp8_align chose for this engine (`engine_plan.default_attention_backend`), or None.
        self.attention_backend_chosen: str | None = None

    def __repr__(self) -> str:
        return f"Fp8AlignQuantConfig({self.fp8_config.to_json()})"

    @classmethod
    def get_name(cls) -> str:
        return QUANTIZATION_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 89

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8AlignQuantConfig:
        return cls(config_from_engine(config))

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        """vLLM's hook after the engine config is built (in the API server of `vllm serve`, before any
        engine process starts): the BF16 layer counts are checked against the model's depth here, so
        a config that cannot fit the model stops the command at once. vLLM releases that pass no
        `hf_config` leave the check to the engine's first layer (`get_quant_method`)."""
        if hf_config is not None:
            self.fp8_config.validate_for_model(int(hf_config.get_text_config().num_hidden_layers))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        """The method for one module vLLM builds: block FP8 or BF16 for linears and routed experts
        (`fp8_align.layer_selection.decide_layer`; each decision is recorded and BF16 ones logged),
        None for everything else (embeddings, lm_head; attention gets vLLM's KV-cache method).
        At the engine's first linear (built before its first attention layer), once: the engine's
        settings are checked, its attention backend defaulted (`engine_plan.default_attention_backend`),
        the patches for its config applied and the model's depth read."""
        is_experts = isinstance(layer, routed_experts_class())
        if not (is_experts or isinstance(layer, LinearBase)):
            return None
        if not self._engine_checked:
            vllm_config = get_current_vllm_config()
            if self.fp8_config.on_policy == "bitwise":
                check_bitwise_engine(vllm_config, self.fp8_config)
            self.attention_backend_chosen = default_attention_backend(self.fp8_config, vllm_config)
            apply_patches(self.fp8_config)
            text_config = vllm_config.model_config.hf_text_config
            self._depth, self._routed_experts = int(text_config.num_hidden_layers), num_routed_experts(text_config)
            self._engine_checked = True
        merged_from = () if is_experts else _merged_from(prefix, self.packed_modules_mapping)
        decision = _decide(layer, prefix, self.fp8_config, is_experts, merged_from, self._depth, self._routed_experts)
        record_decision(layer, decision, self.fp8_config)
        if is_experts:
            return _experts_method(self.fp8_config, self.rounding, layer, prefix) if decision.fp8 else None
        return Fp8AlignLinearMethod(self.fp8_config, self.rounding, prefix) if decision.fp8 else Fp8AlignBf16LinearMethod()


def _merged_from(prefix: str, packed_modules_mapping: dict[str, list[str]]) -> tuple[str, ...]:
    """Full names of the checkpoint modules vLLM merges into the linear `prefix` (its model's
    `packed_modules_mapping`, e.g. q/k/v_proj for qkv_proj); () for a linear that is not merged."""
    parent, _, name = prefix.rpartition(".")
    return tuple(f"{parent}.{shard}" if parent else shard for shard in packed_modules_mapping.get(name, ()))


def _decide(
    layer: torch.nn.Module, prefix: str, cfg: FP8Config, is_experts: bool, merged_from: tuple[str, ...], depth: int, experts: int
) -> LayerDecision:
    """The recipe's decision for one linear or routed-experts module of a model of `depth` decoder
    layers and `experts` routed experts per MoE layer."""
    if not is_experts:
        return decide_layer(
            prefix,
            depth,
            cfg,
            output_size=layer.output_size,
            input_size=layer.input_size,
            num_experts=experts,
            merged_from=merged_from,
        )
    decision = decide_layer(prefix, depth, cfg, kind="experts")
    unsupported = unsupported_experts_reason(layer) if decision.fp8 else None
    if unsupported:
        return LayerDecision(prefix, "experts", False, REASON_UNSUPPORTED, decision.layer_index, unsupported)
    return decision


def _experts_method(cfg: FP8Config, rounding: Rounding, layer: torch.nn.Module, prefix: str) -> Any:
    """fp8_align's routed-experts method for this platform: emulated on CPU, vLLM's Triton
    block-FP8 MoE kernel on CUDA (after matching its activation-scale rounding to the recipe;
    a scale rule that kernel cannot compute raises `Fp8AlignMoEError`)."""
    from vllm.platforms import current_platform

    # each platform imports only its own method: moe.gpu loads vLLM's CUDA MoE kernels
    if current_platform.is_cpu():
        from fp8_align.vllm_plugin.moe.emulated import Fp8AlignEmulatedMoEMethod

        return Fp8AlignEmulatedMoEMethod(cfg, rounding, layer, prefix)
    from fp8_align.vllm_plugin.moe.gpu import Fp8AlignMoEMethod

    set_moe_activation_rounding(cfg.use_activation_pow2_scale)
    return Fp8AlignMoEMethod(cfg, rounding, layer, prefix)


def register_quantization_method() -> None:
    """Register `Fp8AlignQuantConfig` under `quantization="fp8_align"` (idempotent)."""
    if QUANTIZATION_NAME not in QUANTIZATION_METHODS:
        register_quantization_config(QUANTIZATION_NAME)(Fp8AlignQuantConfig)
