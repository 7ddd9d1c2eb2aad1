"""`FP8Config` -> megatron-core training settings, for the three ways users configure Megatron.

The fields, as defined in megatron-core 0.19.2 (megatron/core/transformer/transformer_config.py):
`fp8` ('e4m3' | 'hybrid' | None, line 566), `fp8_recipe` (line 573), `fp8_param` (line 581),
`first_last_layers_bf16` (line 628), `num_layers_at_start_in_bf16` (line 631) and
`num_layers_at_end_in_bf16` (line 635). megatron/core/fp8_utils.py (`is_first_last_bf16_layer`)
runs global layer `i` without an FP8 context when `i < num_layers_at_start_in_bf16` or
`i >= num_layers - num_layers_at_end_in_bf16` — the layers the generation side keeps in BF16 for
`num_first_layers_in_bf16` / `num_last_layers_in_bf16`. For `fp8_recipe='blockwise'` it builds
`Float8BlockScaling(fp8_format=...)`, whose scale rounding comes only from the environment variable
returned by `training_env_vars`.

MoE models need no extra field: routed experts run in the same per-layer FP8 context through TE,
and the router never runs in FP8. Their shard sizes must keep generation's per-projection 128x128
grids, which `fp8_align.megatron_ext.moe.check_moe_alignment` checks (see that module for the
megatron-core fields and source lines behind this).

Entry points:
- `apply_to_transformer_config(config, cfg)`: returns a NEW TransformerConfig (dataclasses.replace,
  so megatron-core's own `__post_init__` validates the result); `config` is left untouched. For an
  MoE config it also runs `check_moe_alignment` on the result.
- `update_nemo_rl_megatron_cfg(megatron_cfg, cfg)`: returns an updated copy of NeMo RL's
  `policy.megatron_cfg` dict.
- `transformer_config_kwargs(cfg)`: a dict to splat into `TransformerConfig(...)`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from fp8_align.config import FP8Config
from fp8_align.megatron_ext.moe import check_moe_alignment
from fp8_align.megatron_ext.te_emulation import TE_FP32_SCALES_ENV_VAR
from fp8_align.megatron_ext.validation import TrainingSetupError, check_bf16_layer_counts, required_te_pow2_scales

#: The TransformerConfig fields this shim sets.
MEGATRON_FP8_FIELDS = (
    "fp8",
    "fp8_recipe",
    "fp8_param",
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
)


def fp8_fields(cfg: FP8Config) -> dict[str, Any]:
    """The TransformerConfig FP8 field values for `cfg` (pure mapping, no megatron import).

    `first_last_layers_bf16` is on exactly when some layers are kept in BF16, and the two counts
    are the generation side's; with none kept they are 0 rather than megatron's default of 1.
    """
    keeps_bf16_layers = cfg.num_first_layers_in_bf16 + cfg.num_last_layers_in_bf16 > 0
    return {
        "fp8": cfg.fp8,
        "fp8_recipe": cfg.fp8_recipe,
        "fp8_param": cfg.fp8_param,
        "first_last_layers_bf16": keeps_bf16_layers,
        "num_layers_at_start_in_bf16": cfg.num_first_layers_in_bf16,
        "num_layers_at_end_in_bf16": cfg.num_last_layers_in_bf16,
    }


def transformer_config_kwargs(
    cfg: FP8Config, *, num_layers: int | None = None, config_cls: type | None = None
) -> dict[str, Any]:
    """Keyword arguments for `TransformerConfig(...)` in hand-rolled Megatron scripts.

    Args:
        cfg: the shared config.
        num_layers: the model's decoder layers; when given, the BF16 layer counts are checked.
        config_cls: the TransformerConfig (sub)class to target; megatron-core's by default.
    Returns:
        {field: value} for `MEGATRON_FP8_FIELDS`.
    Raises:
        TrainingSetupError when megatron-core is missing or lacks a field or the recipe, the
        BF16 layer counts exceed `num_layers`, or `check_no_ignored_layer_kws` refuses `cfg`.
    """
    check_megatron_supports(cfg, _transformer_config_class() if config_cls is None else config_cls)
    check_no_ignored_layer_kws(cfg)
    if num_layers is not None:
        check_bf16_layer_counts(cfg, num_layers)
    return fp8_fields(cfg)


def apply_to_transformer_config(config: Any, cfg: FP8Config) -> Any:
    """A copy of `config` (a megatron-core TransformerConfig or subclass) with `cfg`'s FP8 fields.

    The copy goes through `dataclasses.replace`, so megatron-core re-runs its `__post_init__`
    checks on the new values (e.g. BF16 layer counts per pipeline stage). `config` is not changed.
    Raises TrainingSetupError for a missing field/recipe, `quantization_ignored_layer_kws` with FP8
    training (`check_no_ignored_layer_kws`), BF16 counts above `config.num_layers`, or MoE
    settings under which experts would not quantize as generation does (`check_moe_alignment`).
    """
    check_megatron_supports(cfg, type(config))
    check_no_ignored_layer_kws(cfg)
    check_bf16_layer_counts(cfg, config.num_layers)
    updated = dataclasses.replace(config, **fp8_fields(cfg))
    check_moe_alignment(updated, cfg)
    return updated


def update_nemo_rl_megatron_cfg(megatron_cfg: Mapping[str, Any], cfg: FP8Config) -> dict[str, Any]:
    """A deep copy of NeMo RL's `policy.megatron_cfg` with `cfg`'s training settings.

    NeMo RL (nemo_rl/models/megatron/setup.py, `_apply_performance_config`) copies
    `fp8_cfg.fp8`, `fp8_cfg.fp8_recipe` and `fp8_cfg.fp8_param` onto the model config when
    `fp8_cfg.enabled`, and starts the Megatron workers with `megatron_cfg.env_vars`. This fills
    `fp8_cfg` in `FP8Config.to_nemo_rl()`'s layout and adds `training_env_vars(cfg)` to
    `env_vars` (overriding a value already there). Other keys are kept.

    Raises:
        TrainingSetupError when `cfg` keeps first/last layers in BF16 for FP8 training: NeMo RL
        forwards no such setting, so training would quantize layers generation keeps in BF16.
        With `allow_recipe_mismatch` that mismatch is accepted and nothing is raised. Also
        raised by `check_no_ignored_layer_kws`.
    """
    if (
        cfg.fp8 is not None
        and cfg.num_first_layers_in_bf16 + cfg.num_last_layers_in_bf16 > 0
        and not cfg.allow_recipe_mismatch
    ):
        raise TrainingSetupError(
            f"num_first_layers_in_bf16={cfg.num_first_layers_in_bf16} / num_last_layers_in_bf16="
            f"{cfg.num_last_layers_in_bf16} cannot reach NeMo RL's Megatron workers: its setup copies "
            "only fp8_cfg.fp8, fp8_recipe and fp8_param onto the model config. Set them on the "
            "TransformerConfig inside the worker with fp8_align.megatron_ext.apply_to_transformer_config, "
            "set both to 0, or set allow_recipe_mismatch=True."
        )
    check_no_ignored_layer_kws(cfg)
    updated = copy.deepcopy(dict(megatron_cfg))
    fp8_cfg = dict(updated.get("fp8_cfg") or {})
    fp8_cfg.update(cfg.to_nemo_rl()["policy"]["megatron_cfg"]["fp8_cfg"])
    updated["fp8_cfg"] = fp8_cfg
    env_vars = training_env_vars(cfg)
    if env_vars:
        updated["env_vars"] = {**dict(updated.get("env_vars") or {}), **env_vars}
    return updated


def check_no_ignored_layer_kws(cfg: FP8Config) -> None:
    """Raise TrainingSetupError when FP8 training would quantize modules generation keeps in BF16
    by name (`quantization_ignored_layer_kws`): megatron-core has no per-module FP8 switch, so every
    TransformerEngine linear of an FP8 layer trains in FP8. Nothing is raised for BF16 training
    (`fp8=None`), an empty keyword list, or with `allow_recipe_mismatch`."""
    if cfg.fp8 is None or not cfg.quantization_ignored_layer_kws or cfg.allow_recipe_mismatch:
        return
    raise TrainingSetupError(
        f"quantization_ignored_layer_kws={list(cfg.quantization_ignored_layer_kws)!r} keeps those modules BF16 "
        "in generation, but megatron-core has no per-module FP8 switch: FP8 training quantizes them. Remove "
        "the keywords, train in BF16 (fp8=None), or set allow_recipe_mismatch=True."
    )


def training_env_vars(cfg: FP8Config) -> dict[str, str]:
    """Environment variables the training processes need before importing TransformerEngine.

    For blockwise FP8 training: {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0" (power-of-two scales)
    or "1" (FP32 scales)}, matching the generation side. Empty otherwise. Raises
    TrainingSetupError when weight and activation roundings differ (see `required_te_pow2_scales`).
    """
    if cfg.fp8 is None or cfg.fp8_recipe != "blockwise":
        return {}
    return {TE_FP32_SCALES_ENV_VAR: "0" if required_te_pow2_scales(cfg) else "1"}


def check_megatron_supports(cfg: FP8Config, config_cls: type) -> None:
    """Raise TrainingSetupError, naming the installed megatron-core version, when `config_cls`
    lacks one of `MEGATRON_FP8_FIELDS` or megatron-core's `Fp8Recipe` lacks `cfg.fp8_recipe`."""
    from megatron.core.enums import Fp8Recipe
    from megatron.core.package_info import __shortversion__ as megatron_version

    names = {field.name for field in dataclasses.fields(config_cls)}
    missing = [name for name in MEGATRON_FP8_FIELDS if name not in names]
    if missing:
        raise TrainingSetupError(
            f"{config_cls.__name__} from the installed megatron-core {megatron_version} has no "
            f"field(s) {', '.join(missing)}; fp8_align sets them to align training with generation. "
            "Upgrade megatron-core (fp8_align is tested with 0.19.2)."
        )
    if cfg.fp8_recipe not in {recipe.value for recipe in Fp8Recipe}:
        raise TrainingSetupError(
            f"the installed megatron-core {megatron_version} has no fp8_recipe '{cfg.fp8_recipe}'; "
            "upgrade megatron-core (fp8_align is tested with 0.19.2)."
        )


def _transformer_config_class() -> type:
    try:
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:
        raise TrainingSetupError(
            f"megatron-core is not importable ({exc}); install megatron-core to configure Megatron training."
        ) from None
    return TransformerConfig
