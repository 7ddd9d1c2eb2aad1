"""Training side of fp8_align: Megatron Core + TransformerEngine settings aligned with generation.

- `shim`: `FP8Config` -> megatron-core TransformerConfig fields, NeMo RL `megatron_cfg`, TE env vars.
- `validation`: hardware / CUDA / TransformerEngine / scale-rounding checks before training.
- `moe`: the MoE settings under which routed experts quantize as on the generation side.
- `alignment`: bitwise comparison of training-side and generation-side weight quantization
  (dense linears and routed experts).
- `te_emulation`: pure-torch emulation of TransformerEngine's blockwise quantizer.
- `calibration`: per-layer K/V/Q amax hooks producing vLLM KV-cache scales.

Importing this package imports neither megatron-core nor TransformerEngine.
"""

from fp8_align.megatron_ext.alignment import AlignmentReport, LayerAlignment, alignment_report
from fp8_align.megatron_ext.calibration import KVScaleCalibrator
from fp8_align.megatron_ext.moe import check_moe_alignment
from fp8_align.megatron_ext.shim import (
    MEGATRON_FP8_FIELDS,
    apply_to_transformer_config,
    check_no_ignored_layer_kws,
    fp8_fields,
    training_env_vars,
    transformer_config_kwargs,
    update_nemo_rl_megatron_cfg,
)
from fp8_align.megatron_ext.te_emulation import (
    TE_FP32_SCALES_ENV_VAR,
    te_pow2_scales_from_env,
    te_quantize_activation_1d,
    te_quantize_weight_2d,
    te_scale_from_amax,
)
from fp8_align.megatron_ext.validation import (
    TrainingEnvironment,
    TrainingSetupError,
    detect_training_environment,
    required_te_pow2_scales,
    validate_training_setup,
)

__all__ = [
    "MEGATRON_FP8_FIELDS",
    "TE_FP32_SCALES_ENV_VAR",
    "AlignmentReport",
    "KVScaleCalibrator",
    "LayerAlignment",
    "TrainingEnvironment",
    "TrainingSetupError",
    "alignment_report",
    "apply_to_transformer_config",
    "check_moe_alignment",
    "check_no_ignored_layer_kws",
    "detect_training_environment",
    "fp8_fields",
    "required_te_pow2_scales",
    "te_pow2_scales_from_env",
    "te_quantize_activation_1d",
    "te_quantize_weight_2d",
    "te_scale_from_amax",
    "training_env_vars",
    "transformer_config_kwargs",
    "update_nemo_rl_megatron_cfg",
    "validate_training_setup",
]
