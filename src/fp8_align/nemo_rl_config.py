"""NeMo RL's side of `FP8Config`: its master config's FP8 keys (and the keys that would change FP8
numerics behind fp8_align's back), its YAML composition (`defaults:` inheritance), and the layout
`FP8Config.to_nemo_rl` writes. Plain functions over dicts; `FP8Config.from_nemo_rl`,
`FP8Config.to_nemo_rl` and `FP8Config.from_yaml` are the calls users make.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from fp8_align.errors import FP8ConfigError

#: TransformerEngine reads this once, when `transformer_engine.common.recipe` is imported: exactly
#: "1" selects FP32 block scales, anything else (or unset) power-of-two scales. NeMo RL sets it
#: through `policy.megatron_cfg.env_vars`.
TE_FP32_SCALES_ENV_VAR = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"

#: FP8Config fields read from (and written to) `policy.generation.vllm_cfg` under their own names.
GENERATION_FIELDS = (
    "precision",
    "use_deep_gemm",
    "num_first_layers_in_bf16",
    "num_last_layers_in_bf16",
    "use_weight_pow2_scale",
    "use_activation_pow2_scale",
    "scale_rule",
    "kv_cache_dtype",
    "kv_decode_kernel",
    "fp8_attention",
    "recalibrate_scales_every_step",
    "on_policy",
    "strict",
    "quantization_ignored_layer_kws",
)
#: NeMo RL's own names for generation fields (its vllm_cfg keys) -> FP8Config field names.
_NEMO_RL_GENERATION_ALIASES = {
    "pow2_weight_scaling_factors": "use_weight_pow2_scale",
    "pow2_activation_scaling_factors": "use_activation_pow2_scale",
}
#: FP8Config fields of `policy.megatron_cfg.fp8_cfg`.
TRAINING_FIELDS = ("fp8", "fp8_recipe", "fp8_param", "allow_recipe_mismatch")
#: `fp8_cfg` keys NeMo RL's Megatron worker reads that change no numerics (memory housekeeping).
_NEMO_RL_FP8_CFG_RUNTIME_KEYS = frozenset({"force_clear_fp8_caches"})
#: megatron-core TransformerConfig fields that set FP8 outside `fp8_cfg` (via `model_overrides`).
_MEGATRON_BF16_LAYER_FIELDS = frozenset(
    {"first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"}
)
#: OmegaConf's marker of a mandatory value nobody set.
_MISSING = "???"
#: NeMo RL's marker (top-level sections of a file merged over its defaults): replace, don't merge.
_OVERRIDE_MARKER = "_override_"
_INTERPOLATION = re.compile(r"\$\{([^${}:]*)\}")


class _NemoRlView:
    """Read access to a NeMo RL master config that resolves OmegaConf's `${a.b}` (absolute) and
    `${.b}` / `${..b}` (relative) interpolations in the values read; any other `${...}` (resolvers
    such as `${mul:...}`, text around an interpolation) in a value fp8_align reads is refused."""

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root

    def section(self, path: str) -> Mapping[str, Any]:
        """The mapping at dotted `path`; {} when a part is absent or null."""
        node: Any = self.root
        walked: list[str] = []
        for part in path.split("."):
            node = self._resolve(node.get(part), walked, f"{'.'.join([*walked, part])}")
            walked.append(part)
            if node is None:
                return {}
            if not isinstance(node, Mapping):
                raise FP8ConfigError(
                    f"config section '{'.'.join(walked)}' must be a mapping, got {type(node).__name__}"
                )
        return node

    def value(self, section: Mapping[str, Any], path: str, key: str, default: Any = None) -> Any:
        """`section[key]` with interpolations resolved (`path` is the section's dotted path), or `default`."""
        if key not in section:
            return default
        return self._resolve(section[key], path.split("."), f"{path}.{key}")

    def _resolve(self, value: Any, parent: list[str], where: str, seen: frozenset[str] = frozenset()) -> Any:
        if value == _MISSING:
            raise FP8ConfigError(f"{where} is '???' (mandatory and unset): give it a value")
        if not isinstance(value, str) or "${" not in value:
            return value
        match = _INTERPOLATION.fullmatch(value.strip())
        if match is None:
            raise FP8ConfigError(
                f"{where}={value!r}: fp8_align resolves only interpolations of one other key (${{a.b}}, ${{.b}}); "
                "write the value itself"
            )
        reference = match.group(1)
        dots = len(reference) - len(reference.lstrip("."))
        if dots and dots - 1 > len(parent):
            raise FP8ConfigError(f"{where}={value!r} climbs above the config root")
        target = (parent[: len(parent) - dots + 1] if dots else []) + reference[dots:].split(".")
        target_name = ".".join(target)
        if target_name in seen:
            raise FP8ConfigError(f"{where}={value!r}: the interpolation refers back to itself")
        node: Any = self.root
        for part in target:
            if not isinstance(node, Mapping) or part not in node:
                raise FP8ConfigError(f"{where}={value!r}: {target_name} is not in the config")
            node = node[part]
        return self._resolve(node, target[:-1], target_name, seen | {target_name})


#: `policy.generation.vllm_kwargs.quantization` of a NeMo RL config whose engines run fp8_align.
_NEMO_RL_ENGINE_QUANTIZATION = "fp8_align"


def _check_nemo_rl_fp8_align_engines(precision: Any, calibrated_kv_dtype: Any, engine_kv_dtype: Any) -> None:
    """For NeMo RL engines started with quantization=fp8_align: raise FP8ConfigError when NeMo RL's
    own FP8 is on too (`vllm_cfg.precision` fp8), or when `vllm_cfg.kv_cache_dtype` (what NeMo RL
    calibrates and streams KV scales for) and `vllm_kwargs.kv_cache_dtype` (the engine's KV cache;
    NeMo RL passes the former to vLLM only with its own FP8) disagree on FP8. Values as resolved."""
    if str(precision or "bfloat16").lower() == "fp8":
        raise FP8ConfigError(
            "policy.generation.vllm_cfg.precision: fp8 turns on NeMo RL's own FP8 generation (its init_fp8 patches "
            "vLLM and replaces vllm_kwargs.quantization with 'fp8'), and policy.generation.vllm_kwargs.quantization: "
            "fp8_align asks for fp8_align; turn one off. For fp8_align set vllm_cfg.precision: bfloat16 (the recipe "
            "comes from the other vllm_cfg keys); for NeMo RL's FP8 remove quantization: fp8_align from vllm_kwargs."
        )
    calibrated = str(calibrated_kv_dtype or "auto").startswith("fp8")
    engine = str(engine_kv_dtype or "auto").startswith("fp8")
    if calibrated != engine:
        raise FP8ConfigError(
            f"policy.generation.vllm_cfg.kv_cache_dtype={calibrated_kv_dtype!r} (NeMo RL calibrates and streams KV "
            f"scales for it) but vllm_kwargs.kv_cache_dtype={engine_kv_dtype!r} (the engine's KV cache: with precision "
            "bfloat16 NeMo RL does not pass vllm_cfg's to vLLM); set both to fp8 or both to auto."
        )


def _refuse_env_vars(
    nemo: _NemoRlView, section: Mapping[str, Any], path: str, refused: Callable[[str], bool], instead: str
) -> None:
    """Raise naming every `<path>.env_vars` entry for which `refused(name)` holds."""
    env_vars = nemo.section(f"{path}.env_vars") if section.get("env_vars") is not None else {}
    names = sorted(name for name in env_vars if refused(str(name)))
    if names:
        raise FP8ConfigError(
            f"{path}.env_vars sets {', '.join(names)}, which change(s) FP8 numerics behind fp8_align's "
            f"back ({instead}); remove them."
        )


def _is_vllm_fp8_env_var(name: str) -> bool:
    """vLLM switches that pick FP8 kernels or scale rounding (fp8_align sets its own)."""
    return "FP8" in name.upper() or name.upper().startswith("VLLM_USE_DEEP_GEMM")


def _is_other_te_fp8_env_var(name: str) -> bool:
    """TransformerEngine FP8 switches other than the one fp8_align reads."""
    return name.upper().startswith("NVTE_FP8") and name != TE_FP32_SCALES_ENV_VAR


def _check_vllm_kwargs(nemo: _NemoRlView) -> None:
    """Refuse `policy.generation.vllm_kwargs` entries that would quantize differently from fp8_align."""
    path = "policy.generation.vllm_kwargs"
    kwargs = nemo.section(path)
    quantization = nemo.value(kwargs, path, "quantization")
    if quantization not in (None, "fp8_align"):
        raise FP8ConfigError(
            f"{path}.quantization={quantization!r} replaces fp8_align's quantization; "
            "set it to 'fp8_align' or remove it"
        )
    if nemo.value(kwargs, path, "kv_cache_dtype") is not None and quantization != _NEMO_RL_ENGINE_QUANTIZATION:
        raise FP8ConfigError(
            f"{path}.kv_cache_dtype is not read by fp8_align; set policy.generation.vllm_cfg.kv_cache_dtype instead "
            f"(with {path}.quantization: fp8_align the two must agree)"
        )
    if nemo.value(kwargs, path, "calculate_kv_scales"):
        raise FP8ConfigError(
            f"{path}.calculate_kv_scales=True (vLLM's own KV scales from the first batch) is not supported: "
            "fp8_align's FP8 KV-cache scales come from push_kv_scales or calibrate_kv_scales. Remove it."
        )
    overrides = nemo.section(f"{path}.hf_overrides") if kwargs.get("hf_overrides") is not None else {}
    if overrides.get("quantization_config"):
        raise FP8ConfigError(
            f"{path}.hf_overrides.quantization_config would give vLLM a checkpoint quantization besides "
            "fp8_align's; remove it"
        )


def _refuse_fp8_model_overrides(nemo: _NemoRlView, megatron_cfg: Mapping[str, Any], path: str) -> None:
    """Refuse megatron-core FP8 fields set through NeMo RL's `model_overrides` (outside fp8_cfg)."""
    overrides = nemo.section(f"{path}.model_overrides") if megatron_cfg.get("model_overrides") is not None else {}
    names = sorted(
        str(name) for name in overrides if str(name).startswith("fp8") or name in _MEGATRON_BF16_LAYER_FIELDS
    )
    if names:
        raise FP8ConfigError(
            f"{path}.model_overrides sets {', '.join(names)}: fp8_align derives the Megatron FP8 settings from "
            "fp8_cfg and the vllm_cfg BF16 layer counts (fp8_align.megatron_ext); remove them."
        )


def _check_te_scale_env_var(nemo: _NemoRlView, megatron_cfg: Mapping[str, Any], path: str, cfg: FP8Config) -> None:
    """Refuse FP8 blockwise training whose TE scale rounding (from `env_vars`) is not generation's."""
    if cfg.fp8 is None or cfg.fp8_recipe != "blockwise" or cfg.allow_recipe_mismatch:
        return
    env_vars = nemo.section(f"{path}.env_vars") if megatron_cfg.get("env_vars") is not None else {}
    raw = nemo.value(env_vars, f"{path}.env_vars", TE_FP32_SCALES_ENV_VAR)
    te_pow2 = raw is None or str(raw) != "1"
    if te_pow2 == cfg.use_weight_pow2_scale:
        return
    setting = "unset (TransformerEngine's default: power-of-two scales)" if raw is None else f"{raw!r}"
    generation = "power-of-two" if cfg.use_weight_pow2_scale else "FP32"
    wanted = "'0'" if cfg.use_weight_pow2_scale else "'1'"
    raise FP8ConfigError(
        f"{path}.env_vars.{TE_FP32_SCALES_ENV_VAR} is {setting}, so FP8 training rounds block scales "
        f"{'to powers of two' if te_pow2 else 'in FP32'} while generation uses {generation} scales "
        "(vllm_cfg.pow2_weight_scaling_factors / pow2_activation_scaling_factors). "
        f"Set it to {wanted}, change the pow2 flags, or set fp8_cfg.allow_recipe_mismatch: true."
    )


def load_nemo_rl_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML config the way NeMo RL's `load_config` composes it (nemo_rl/utils/config.py).

    A top-level `defaults:` (one path or a list) names parent files, relative to the file's own
    directory unless absolute; each parent is read the same way (its `defaults:` relative to its
    directory), the parents are merged in order, then the file over them, so later wins. Merging is
    OmegaConf's: mappings merge key by key, anything else (scalars, lists, null) replaces, and a
    '???' value keeps what it merges onto. A top-level section carrying `_override_: true` replaces
    the section it merges onto instead (the marker is dropped). Interpolations stay unresolved
    (`from_nemo_rl` resolves the values it reads). Raises FP8ConfigError for a missing file, a
    non-mapping document, a malformed `defaults:` or a `defaults:` cycle.
    """
    import yaml

    def load(file: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
        named_by = f" (named in defaults: of {chain[-1]})" if chain else ""
        if file.resolve() in chain:
            raise FP8ConfigError(f"{file}: defaults: cycle {' -> '.join(map(str, (*chain, file.resolve())))}")
        if not file.is_file():
            raise FP8ConfigError(f"{file}: no such file{named_by}")
        data = yaml.safe_load(file.read_text())
        if not isinstance(data, dict):
            raise FP8ConfigError(f"{file}: expected a mapping at the top level, got {type(data).__name__}")
        if "defaults" not in data:
            return data
        defaults = data.pop("defaults")
        if isinstance(defaults, str):
            parents = [defaults]
        elif isinstance(defaults, list):
            parents = [str(parent) for parent in defaults]
        else:
            raise FP8ConfigError(f"{file}: defaults: must be a file name or a list of them, got {defaults!r}")
        merged: dict[str, Any] = {}
        for parent in parents:
            parent_file = Path(parent) if parent.startswith("/") else file.parent / parent
            merged = _merge_with_override(merged, load(parent_file, (*chain, file.resolve())))
        return _merge_with_override(merged, data)

    return load(Path(path), ())


def _merge_with_override(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` merged over `base`; a top-level section of `override` marked `_override_` replaces."""
    base = dict(base)
    override = dict(override)
    for key, value in override.items():
        if isinstance(value, dict) and value.get(_OVERRIDE_MARKER, False):
            override[key] = {k: v for k, v in value.items() if k != _OVERRIDE_MARKER}
            base.pop(key, None)
    return _merge(base, override)


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """OmegaConf's merge of plain YAML data: mappings recurse, other values replace, '???' keeps."""
    merged = dict(base)
    for key, value in override.items():
        if value == _MISSING and key in merged:
            continue
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


class NemoRlFields(NamedTuple):
    """What a NeMo RL master config says about FP8: `FP8Config` keyword arguments, the config key
    each was read from (for error messages), and `check(config)`, the checks that need the built
    config (TransformerEngine's scale rounding against generation's)."""

    kwargs: dict[str, Any]
    sources: dict[str, str]
    check: Callable[[Any], None]


def read_nemo_rl(cfg: Mapping[str, Any], precision_default: str) -> NemoRlFields:
    """The FP8 fields of a NeMo RL master config dict (what its `load_config` returns, resolved or not).

    Reads `policy.generation.vllm_cfg` (generation fields, NeMo RL's pow2 names), the FP8 keys of
    `policy.generation.vllm_kwargs`, `policy.megatron_cfg.fp8_cfg` (when it and Megatron are
    enabled), `policy.megatron_cfg.env_vars` / `model_overrides` and
    `loss_fn.use_importance_sampling_correction`; `${a.b}` / `${.b}` interpolations in the values
    read are resolved against `cfg`. Keys unrelated to FP8 are ignored. Raises FP8ConfigError,
    naming the NeMo RL key, for every FP8 key whose value fp8_align cannot honour (docs/megatron.md,
    "NeMo RL recipes", lists them).

    With `policy.generation.vllm_kwargs.quantization: fp8_align` (NeMo RL's engines run fp8_align)
    the generation side is FP8 and `vllm_cfg.precision` is NeMo RL's own FP8 switch: it must be
    off (bfloat16), else FP8ConfigError says which one to turn off. `precision_default` is
    FP8Config's default precision (generation is FP8 unless a key says otherwise).
    """
    nemo = _NemoRlView(cfg)
    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}

    vllm_path = "policy.generation.vllm_cfg"
    vllm_cfg = nemo.section(vllm_path)
    for name in GENERATION_FIELDS:
        value = nemo.value(vllm_cfg, vllm_path, name)
        if value is not None:
            kwargs[name], sources[name] = value, f"{vllm_path}.{name}"
    for nemo_name, name in _NEMO_RL_GENERATION_ALIASES.items():
        value = nemo.value(vllm_cfg, vllm_path, nemo_name)
        if value is None:
            continue
        if name in kwargs and kwargs[name] != value:
            raise FP8ConfigError(
                f"{vllm_path}.{nemo_name}={value!r} contradicts {vllm_path}.{name}={kwargs[name]!r}; keep one"
            )
        kwargs[name], sources[name] = value, f"{vllm_path}.{nemo_name}"
    if nemo.value(vllm_cfg, vllm_path, "is_mx"):
        raise FP8ConfigError(
            f"{vllm_path}.is_mx=True selects NeMo RL's MXFP8 (1x32 blocks, E8M0 scales), which fp8_align "
            "does not run: its recipe is 128x128 block FP8 with the trainer's quantizer. Remove is_mx."
        )
    engines_path = "policy.generation.vllm_kwargs"
    engine_kwargs = nemo.section(engines_path)
    if nemo.value(engine_kwargs, engines_path, "quantization") == _NEMO_RL_ENGINE_QUANTIZATION:
        _check_nemo_rl_fp8_align_engines(
            nemo.value(vllm_cfg, vllm_path, "precision"), nemo.value(vllm_cfg, vllm_path, "kv_cache_dtype"),
            nemo.value(engine_kwargs, engines_path, "kv_cache_dtype"),
        )  # fmt: skip
        kwargs["precision"], sources["precision"] = "fp8", f"{engines_path}.quantization"
    generates_fp8 = str(kwargs.get("precision", precision_default)).lower() == "fp8"
    if generates_fp8:
        _refuse_env_vars(nemo, vllm_cfg, vllm_path, _is_vllm_fp8_env_var, "use_deep_gemm and the FP8Config fields")
    _check_vllm_kwargs(nemo)

    megatron_path = "policy.megatron_cfg"
    megatron_cfg = nemo.section(megatron_path)
    fp8_path = f"{megatron_path}.fp8_cfg"
    fp8_cfg = nemo.section(fp8_path)
    megatron_enabled = bool(nemo.value(megatron_cfg, megatron_path, "enabled", default=True))
    training_fp8 = megatron_enabled and bool(nemo.value(fp8_cfg, fp8_path, "enabled", default=False))
    if training_fp8:
        unknown = sorted(set(fp8_cfg) - set(TRAINING_FIELDS) - _NEMO_RL_FP8_CFG_RUNTIME_KEYS - {"enabled"})
        if unknown:
            raise FP8ConfigError(
                f"{fp8_path} has key(s) fp8_align does not know: {', '.join(unknown)}. It reads "
                f"{', '.join(('enabled', *TRAINING_FIELDS))} (and passes "
                f"{', '.join(sorted(_NEMO_RL_FP8_CFG_RUNTIME_KEYS))}, which changes no numerics); "
                "remove the others."
            )
        for name in TRAINING_FIELDS:
            value = nemo.value(fp8_cfg, fp8_path, name)
            if value is not None:
                kwargs[name], sources[name] = value, f"{fp8_path}.{name}"
        _refuse_env_vars(
            nemo, megatron_cfg, megatron_path, _is_other_te_fp8_env_var, f"only {TE_FP32_SCALES_ENV_VAR} is read"
        )
    else:
        kwargs["fp8"] = None
    if megatron_enabled:
        _refuse_fp8_model_overrides(nemo, megatron_cfg, megatron_path)

    loss_value = nemo.value(nemo.section("loss_fn"), "loss_fn", "use_importance_sampling_correction")
    if loss_value is not None:
        kwargs["use_importance_sampling_correction"] = loss_value
        sources["use_importance_sampling_correction"] = "loss_fn.use_importance_sampling_correction"

    def check(built: Any) -> None:
        if training_fp8:
            _check_te_scale_env_var(nemo, megatron_cfg, megatron_path, built)

    return NemoRlFields(kwargs, sources, check)


def nemo_rl_layout(values: Mapping[str, Any]) -> dict[str, Any]:
    """The NeMo RL dict layout of FP8Config field values `values` (`FP8Config.model_dump()`)."""
    vllm_cfg = {name: values[name] for name in GENERATION_FIELDS}
    vllm_cfg["quantization_ignored_layer_kws"] = list(values["quantization_ignored_layer_kws"])
    for nemo_name, name in _NEMO_RL_GENERATION_ALIASES.items():
        vllm_cfg[nemo_name] = vllm_cfg.pop(name)
    fp8_cfg: dict[str, Any] = {"enabled": values["fp8"] is not None}
    fp8_cfg.update({name: values[name] for name in TRAINING_FIELDS})
    megatron_cfg: dict[str, Any] = {"fp8_cfg": fp8_cfg}
    if values["fp8"] is not None and values["fp8_recipe"] == "blockwise":
        # TE's blockwise scale rounding (weight rounding where allow_recipe_mismatch lets them differ)
        megatron_cfg["env_vars"] = {TE_FP32_SCALES_ENV_VAR: "0" if values["use_weight_pow2_scale"] else "1"}
    return {
        "policy": {"generation": {"vllm_cfg": vllm_cfg}, "megatron_cfg": megatron_cfg},
        "loss_fn": {"use_importance_sampling_correction": values["use_importance_sampling_correction"]},
    }

