"""The `fp8_align` vLLM quantization method: config object and per-layer method choice.

Imports vLLM; only `register()` (the plugin entry point) and vLLM itself import this module.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from fp8_align.config import FP8Config
from fp8_align.layer_selection import decide_linear
from fp8_align.vllm_plugin.engine_args import QUANTIZATION_NAME, config_from_engine
from fp8_align.vllm_plugin.linear.method import Fp8AlignBf16LinearMethod, Fp8AlignLinearMethod
from fp8_align.vllm_plugin.patches import apply_patches

logger = logging.getLogger("vllm.fp8_align")


class Fp8AlignQuantConfig(QuantizationConfig):
    """Online block FP8 from a BF16 checkpoint, configured by an `FP8Config`."""

    def __init__(self, fp8_config: FP8Config | None = None) -> None:
        super().__init__()
        self.fp8_config = config_from_engine(None) if fp8_config is None else fp8_config

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

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        if not isinstance(layer, LinearBase):
            return None
        apply_patches(self.fp8_config)
        decision = decide_linear(prefix, _num_hidden_layers(), self.fp8_config)
        if not decision.fp8:
            logger.info("fp8_align: %s stays BF16 (%s)", prefix, decision.reason)
            return Fp8AlignBf16LinearMethod()
        return Fp8AlignLinearMethod(self.fp8_config, prefix)


def register_quantization_method() -> None:
    """Register `Fp8AlignQuantConfig` under `quantization="fp8_align"` (idempotent)."""
    if QUANTIZATION_NAME not in QUANTIZATION_METHODS:
        register_quantization_config(QUANTIZATION_NAME)(Fp8AlignQuantConfig)


def _num_hidden_layers() -> int:
    from vllm.config import get_current_vllm_config

    hf_config = get_current_vllm_config().model_config.hf_text_config
    return int(hf_config.num_hidden_layers)
