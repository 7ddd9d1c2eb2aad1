"""Checks run before FP8 training starts: hardware, CUDA, TransformerEngine and scale rounding.

Every fact about the machine comes in through `TrainingEnvironment`, detected from the running
process by `detect_training_environment()` or built by hand (tests, dry runs on a CPU login node).
`validate_training_setup` lists every problem it finds in one `TrainingSetupError`.

Requirements, from the sources:
- TE's `_compute_fp8_block_scaling_support` (transformer_engine/pytorch/quantization.py) needs
  compute capability >= 9.0 and CUDA >= 12.9 for `Float8BlockScaling`;
- megatron-core builds `Float8BlockScaling(fp8_format=...)` only with TE >= 2.3
  (megatron/core/fp8_utils.py, `get_fp8_recipe`), passing no scale options, so TE's
  scale rounding is whatever NVTE_FP8_BLOCK_SCALING_FP32_SCALES said when TE was imported;
- NeMo RL's docs/fp8.md: on Blackwell, blockwise FP8 training with FP32 scales is not supported;
  the recommended recipe there is FP8 generation with BF16 training.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch

from fp8_align.config import FP8Config, FP8ConfigError
from fp8_align.megatron_ext.te_emulation import TE_FP32_SCALES_ENV_VAR

#: Blockwise FP8 training needs at least this CUDA (TE checks torch.version.cuda >= 12.9).
MIN_CUDA_FOR_BLOCKWISE = (12, 9)
#: TE's FP8 GEMMs (per-tensor current scaling) need at least Ada.
MIN_CAPABILITY_FOR_FP8 = (8, 9)
#: Compute capability majors from Blackwell on (10.x data centre, 11.x, 12.x workstation).
FIRST_BLACKWELL_MAJOR = 10
HOPPER_MAJOR = 9

logger = logging.getLogger("fp8_align")


class TrainingSetupError(FP8ConfigError):
    """The training side cannot run the requested FP8 recipe; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class TrainingEnvironment:
    """Facts about the training process that decide whether FP8 training can run.

    Attributes:
        cuda_available: a CUDA device is visible to torch.
        compute_capability: (major, minor) of the current device, None without CUDA.
        cuda_version: (major, minor) of the CUDA torch was built with, None for CPU builds.
        te_version: TransformerEngine's version string, None when it is not installed.
        te_has_block_scaling: TE has `transformer_engine.common.recipe.Float8BlockScaling`.
        te_pow2_scales: whether that recipe rounds scales to powers of two in this process
            (fixed when TE's recipe module was imported); None without TE or without the recipe.
    """

    cuda_available: bool
    compute_capability: tuple[int, int] | None
    cuda_version: tuple[int, int] | None
    te_version: str | None
    te_has_block_scaling: bool
    te_pow2_scales: bool | None = None


def detect_training_environment() -> TrainingEnvironment:
    """Read the facts from this process. Imports TransformerEngine when it is installed, which
    fixes its scale rounding: export NVTE_FP8_BLOCK_SCALING_FP32_SCALES before calling this."""
    cuda_available = torch.cuda.is_available()
    capability = tuple(torch.cuda.get_device_capability()) if cuda_available else None
    te_version, has_block_scaling, pow2 = _detect_transformer_engine()
    return TrainingEnvironment(
        cuda_available=cuda_available,
        compute_capability=capability,
        cuda_version=_parse_cuda_version(torch.version.cuda),
        te_version=te_version,
        te_has_block_scaling=has_block_scaling,
        te_pow2_scales=pow2,
    )


def required_te_pow2_scales(cfg: FP8Config) -> bool:
    """The scale rounding TE's blockwise recipe must use to match `cfg`'s generation side.

    True for power-of-two scales. megatron-core's `Float8BlockScaling(fp8_format=...)` gets one
    rounding for inputs, weights and gradients from NVTE_FP8_BLOCK_SCALING_FP32_SCALES, so a
    config whose weight and activation roundings differ cannot be matched: that raises
    TrainingSetupError, unless `allow_recipe_mismatch`, where the weight rounding is returned.
    """
    if cfg.use_weight_pow2_scale != cfg.use_activation_pow2_scale and not cfg.allow_recipe_mismatch:
        raise TrainingSetupError(_split_rounding_message(cfg))
    return cfg.use_weight_pow2_scale


def check_bf16_layer_counts(cfg: FP8Config, num_layers: int) -> None:
    """Raise TrainingSetupError when `cfg` keeps more first+last layers in BF16 than `num_layers`."""
    try:
        cfg.validate_for_model(num_layers)
    except FP8ConfigError as exc:
        raise TrainingSetupError(str(exc)) from None


def validate_training_setup(
    cfg: FP8Config, env: TrainingEnvironment | None = None, *, num_layers: int | None = None
) -> None:
    """Raise TrainingSetupError listing every reason `cfg` cannot train aligned FP8 in `env`.

    Args:
        cfg: the shared config; nothing is checked when it trains in BF16 (`cfg.fp8 is None`).
        env: the machine's facts; detected from this process when None.
        num_layers: decoder layers of the model; checks the BF16 first/last layer counts.
    """
    if num_layers is not None:
        check_bf16_layer_counts(cfg, num_layers)
    if cfg.fp8 is None:
        return
    env = detect_training_environment() if env is None else env
    if cfg.fp8_recipe == "blockwise" and _is_blackwell_or_newer(env):
        raise TrainingSetupError(_blackwell_message(env))
    problems = _hardware_problems(cfg, env)
    if cfg.fp8_recipe == "blockwise":
        problems += _transformer_engine_problems(env)
        problems += _rounding_problems(cfg, env)
    if cfg.precision == "bf16" and not cfg.allow_recipe_mismatch:
        problems.append(
            "generation runs in BF16 (precision='bf16') while training runs FP8: the two sides "
            "cannot agree. Set precision='fp8', or fp8=None to train in BF16, or "
            "allow_recipe_mismatch=True."
        )
    if problems:
        raise TrainingSetupError("FP8 training cannot start:\n" + "\n".join(f"  - {problem}" for problem in problems))
    if cfg.fp8_recipe == "blockwise" and not cfg.allow_recipe_mismatch and _fp32_scales_differ_by_rounding(cfg):
        logger.warning(
            "fp8_align: FP32 scales with scale_rule='amax_over_max': generation stores amax/448 while "
            "TransformerEngine stores 1/(448/amax), so some block scales differ in the last bit and a few "
            "codes by one E4M3 step. Set scale_rule='transformer_engine' for bit-identical weights and activations."
        )


def _fp32_scales_differ_by_rounding(cfg: FP8Config) -> bool:
    """True when generation under `cfg` is close to TE's blockwise recipe but not bitwise equal:
    FP32 (not power-of-two) weight or activation scales with `scale_rule="amax_over_max"`.
    Power-of-two scales agree under either rule (for every amax above ~1e-35); "transformer_engine"
    agrees with FP32 scales too."""
    pow2 = cfg.use_weight_pow2_scale and cfg.use_activation_pow2_scale
    return cfg.precision == "fp8" and cfg.scale_rule == "amax_over_max" and not pow2


def _hardware_problems(cfg: FP8Config, env: TrainingEnvironment) -> list[str]:
    if not env.cuda_available or env.compute_capability is None:
        return ["FP8 training needs a CUDA GPU and none is visible to torch."]
    capability = env.compute_capability
    name = f"compute capability {capability[0]}.{capability[1]}"
    if cfg.fp8_recipe == "tensorwise":
        if capability < MIN_CAPABILITY_FOR_FP8:
            return [f"FP8 training needs compute capability >= 8.9 (Ada/Hopper); this GPU has {name}."]
        return []
    problems = []
    if capability[0] != HOPPER_MAJOR:
        problems.append(
            f"blockwise FP8 training needs a Hopper GPU (compute capability 9.x); this GPU has {name}. "
            "Train in BF16 (fp8=None) on this machine."
        )
    if env.cuda_version is None or env.cuda_version < MIN_CUDA_FOR_BLOCKWISE:
        found = "none" if env.cuda_version is None else f"{env.cuda_version[0]}.{env.cuda_version[1]}"
        problems.append(
            f"blockwise FP8 training needs CUDA >= 12.9 (TransformerEngine's block-scaled GEMM); "
            f"torch reports CUDA {found}. Use a torch/TE build for CUDA 12.9 or newer."
        )
    return problems


def _is_blackwell_or_newer(env: TrainingEnvironment) -> bool:
    return env.compute_capability is not None and env.compute_capability[0] >= FIRST_BLACKWELL_MAJOR


def _blackwell_message(env: TrainingEnvironment) -> str:
    major, minor = env.compute_capability
    return (
        f"this GPU has compute capability {major}.{minor} (Blackwell or newer): blockwise FP8 "
        "training that matches the generation side's scales is not supported there (NeMo RL, "
        "docs/fp8.md). The recommended recipe on Blackwell is FP8 generation with BF16 training: "
        "keep precision='fp8' and set fp8=None (NeMo RL: policy.megatron_cfg.fp8_cfg.enabled=false)."
    )


def _transformer_engine_problems(env: TrainingEnvironment) -> list[str]:
    if env.te_version is None:
        return [
            (
                "TransformerEngine is not installed: megatron-core runs FP8 through it. Install "
                "transformer-engine[pytorch] >= 2.3 (megatron-core builds Float8BlockScaling only from 2.3 on)."
            )
        ]
    if not env.te_has_block_scaling:
        return [
            (
                f"TransformerEngine {env.te_version} has no Float8BlockScaling recipe; upgrade "
                "transformer-engine to >= 2.3 (megatron-core builds the blockwise recipe only from 2.3 on)."
            )
        ]
    return []


def _rounding_problems(cfg: FP8Config, env: TrainingEnvironment) -> list[str]:
    if cfg.allow_recipe_mismatch or env.te_pow2_scales is None:
        return []
    if cfg.use_weight_pow2_scale != cfg.use_activation_pow2_scale:
        return [_split_rounding_message(cfg)]
    if env.te_pow2_scales == cfg.use_weight_pow2_scale:
        return []
    wanted = "0" if cfg.use_weight_pow2_scale else "1"
    return [
        (
            f"TransformerEngine's blockwise recipe uses {_rounding_name(env.te_pow2_scales)} scales but "
            f"generation uses {_rounding_name(cfg.use_weight_pow2_scale)} scales, the mismatch fp8_align "
            f"removes. Set {TE_FP32_SCALES_ENV_VAR}={wanted} in the training workers' environment before "
            "transformer_engine is imported (fp8_align.megatron_ext.training_env_vars(cfg) gives it; "
            "NeMo RL: policy.megatron_cfg.env_vars), or set allow_recipe_mismatch=True."
        )
    ]


def _split_rounding_message(cfg: FP8Config) -> str:
    return (
        f"generation rounds weight scales to {_rounding_name(cfg.use_weight_pow2_scale)} and "
        f"activation scales to {_rounding_name(cfg.use_activation_pow2_scale)}, but megatron-core "
        "builds TransformerEngine's Float8BlockScaling with one rounding for inputs, weights and "
        f"gradients ({TE_FP32_SCALES_ENV_VAR}), so training cannot match both. Set "
        "use_weight_pow2_scale == use_activation_pow2_scale, or allow_recipe_mismatch=True."
    )


def _rounding_name(pow2: bool) -> str:
    return "power-of-two" if pow2 else "FP32"


def _parse_cuda_version(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def _detect_transformer_engine() -> tuple[str | None, bool, bool | None]:
    if importlib.util.find_spec("transformer_engine") is None:
        return None, False, None
    import transformer_engine
    from transformer_engine.common import recipe

    block_scaling = getattr(recipe, "Float8BlockScaling", None)
    if block_scaling is None:
        return transformer_engine.__version__, False, None
    return transformer_engine.__version__, True, bool(block_scaling.fp8_quant_fwd_weight.power_2_scale)
