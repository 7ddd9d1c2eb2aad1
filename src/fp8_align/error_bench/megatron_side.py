"""`bench-error --training-side megatron-te`: megatron-core GPT with TransformerEngine layers as the scorer.

The HF checkpoint is mapped onto a megatron-core `GPTModel` built from TE layers
(`fp8_align.megatron_ext.hf_bridge`); FP8 variants get the Megatron config fp8_align's
`transformer_config_kwargs` produces from the variant's FP8Config (`fp8="e4m3"`,
`fp8_recipe="blockwise"`, its first/last BF16 layers), so TE's `Float8BlockScaling` recipe
quantizes weights (128x128) and activations (1x128) in the forward, as in Megatron training.

TE fixes its scale rounding when it is imported, from NVTE_FP8_BLOCK_SCALING_FP32_SCALES
("1": FP32 scales, otherwise power of two). A run therefore scores only FP8 variants whose
`use_weight_pow2_scale` matches that setting; run pow2 and FP32 variants in separate processes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fp8_align.config import FP8Config
from fp8_align.megatron_ext.hf_bridge import MegatronBridgeError, MegatronCausalLM, build_megatron_gpt, check_llama_family
from fp8_align.megatron_ext.te_emulation import TE_FP32_SCALES_ENV_VAR, te_pow2_scales_from_env

#: Name of the BF16 megatron-core + TE training side in the result pairs.
MEGATRON_BF16_SIDE = "megatron_te_bf16"


def check_megatron_te_side(hf_config: Any, fp8_configs: list[FP8Config]) -> str | None:
    """None when megatron-core, TE and the model allow this side; else what is wrong and how to fix it."""
    try:
        import megatron.core  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        return (
            f"--training-side megatron-te needs megatron-core and TransformerEngine (torch extension included): {exc}. "
            "On the GPU box: benchmarks/box/te_box_setup.sh"
        )
    try:
        check_llama_family(hf_config)
    except MegatronBridgeError as exc:
        return str(exc)
    te_pow2 = te_pow2_scales_from_env()
    wrong = [cfg for cfg in fp8_configs if cfg.use_weight_pow2_scale != te_pow2]
    if wrong:
        want = "power-of-two" if te_pow2 else "FP32"
        return (
            f"TransformerEngine was imported with {want} block scales ({TE_FP32_SCALES_ENV_VAR}="
            f"{'unset/0' if te_pow2 else '1'}), but an FP8 variant uses the other rounding; run those variants in a "
            f"separate process with {TE_FP32_SCALES_ENV_VAR}={'1' if te_pow2 else '0'}"
        )
    return None


def megatron_te_model(hf_model: nn.Module, fp8_cfg: FP8Config | None) -> nn.Module:
    """An HF-style causal LM (`.logits`) backed by a megatron-core GPT with TE layers and `hf_model`'s weights."""
    return MegatronCausalLM(build_megatron_gpt(hf_model, fp8_cfg, spec="transformer_engine"), hf_model.config)


def describe_megatron_te_side() -> dict[str, str]:
    """Result-document descriptions of the megatron-core + TE training sides, with versions."""
    import importlib.metadata as md

    versions = f"megatron-core {md.version('megatron-core')}, TransformerEngine {md.version('transformer_engine')}"
    rounding = "power-of-two" if te_pow2_scales_from_env() else "FP32"
    return {
        MEGATRON_BF16_SIDE: f"megatron-core GPTModel with TransformerEngine layers ({versions}), BF16; log_softmax in FP32",
        "megatron_te_fp8": (
            f"the same model with the variant's megatron-core FP8 settings (fp8=e4m3, fp8_recipe=blockwise, its BF16 "
            f"layers): TE Float8BlockScaling, 128x128 weight and 1x128 activation blocks, {rounding} scales"
        ),
    }
