"""One configuration object for both halves of an FP8 RL run (generation and training).

`FP8Config` carries the generation recipe (vLLM side), the training recipe (Megatron side) and
the loss-side switch. Both sides read the same object, so they cannot disagree. It loads from
keyword arguments, from a NeMo RL master config (a dict, or a YAML recipe read with NeMo RL's
`defaults:` inheritance), and from one environment variable (`FP8_ALIGN_CONFIG`, JSON) so every
worker process of an engine sees exactly the same config.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: Environment variable that carries a serialized `FP8Config` into worker processes.
CONFIG_ENV_VAR = "FP8_ALIGN_CONFIG"
#: TransformerEngine reads this once, when `transformer_engine.common.recipe` is imported: exactly
#: "1" selects FP32 block scales, anything else (or unset) power-of-two scales.
TE_FP32_SCALES_ENV_VAR = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"

_PRECISION_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp8": "fp8"}
_KV_CACHE_ALIASES = {"auto": "auto", "bf16": "auto", "bfloat16": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}


class FP8ConfigError(ValueError):
    """A configuration that cannot run, with a message that says what to change."""


class FP8Config(BaseModel):
    """The aligned FP8 recipe for generation (vLLM) and training (Megatron Core + TE).

    Generation fields use NeMo RL's `policy.generation.vllm_cfg` names; training fields use
    `policy.megatron_cfg.fp8_cfg` names. Scales are FP32 (`amax / 448`) unless the matching
    `*_pow2_scale` flag rounds them up to a power of two; `scale_rule="transformer_engine"`
    computes them as TransformerEngine does instead (`1 / fl(448 / amax)`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    # --- generation (vLLM) ---
    precision: Literal["bf16", "fp8"] = "fp8"
    use_deep_gemm: bool = True
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    use_weight_pow2_scale: bool = False
    use_activation_pow2_scale: bool = False
    scale_rule: Literal["amax_over_max", "transformer_engine"] = Field(
        default="amax_over_max",
        description="How weight and activation scales are computed from a group's amax. "
        "'amax_over_max': stored scale amax/448 (rounded up to a power of two with the pow2 flags), "
        "codes x/scale. 'transformer_engine': multiplier 448/amax (rounded down to a power of two "
        "with the pow2 flags), codes x*multiplier, stored scale 1/multiplier: bit-identical to "
        "TransformerEngine's Float8BlockQuantizer, for FP32 and pow2 scales alike. All divisions "
        "are correctly rounded FP32.",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    kv_decode_kernel: Literal["auto", "backend", "xqa"] = Field(
        default="auto",
        description="Decode kernel over the KV cache, decided at engine start and logged with the reason "
        "(fp8_align.vllm_plugin.engine_plan). 'auto': the fastest safe one: FlashInfer's XQA kernel for pure-decode "
        "batches where fp8_align implements it and it can run (an FP8 KV cache, vLLM 0.22, an SM90 GPU, the "
        "FLASH_ATTN backend, a BF16 model, on_policy='off', the XQA module loads; prefill stays on FA3), else the "
        "attention backend's own decode, with a warning where only the XQA module was missing; on vLLM 0.25 an FP8 "
        "cache on SM90 gets attention_backend='FLASHINFER' (vLLM's own XQA decode) where the engine left it unset. "
        "'backend': always the attention backend's own decode, on the backend vLLM chooses (what vLLM does). 'xqa': "
        "XQA or refuse to start; needs kv_cache_dtype='fp8' (docs/xqa_decode.md).",
    )
    fp8_attention: bool = Field(
        default=False,
        description="Only False is accepted: FP8 attention is not a switch fp8_align has. With "
        "kv_cache_dtype='fp8', vLLM itself quantizes the query to FP8 wherever its attention backend "
        "takes FP8 queries (FlashAttention on CUDA, with the q_scale pushed by push_kv_scales); other "
        "backends (vLLM's CPU attention) attend in BF16 over the FP8 cache.",
    )
    quantize_during_load: bool = Field(
        default=True,
        description="Quantize each FP8 layer as soon as its checkpoint tensors are loaded: its BF16 weights "
        "are created on the meta device and vLLM's online (layerwise) processing materializes and processes "
        "one layer at a time, so besides the FP8 model at most the layers being loaded hold BF16 weights. "
        "False: every BF16 weight is created, the whole checkpoint loaded, then quantized (peak: the BF16 model).",
    )
    recalibrate_scales_every_step: bool = Field(
        default=True,
        description="Only True is accepted, and it is what always happens: a refit re-quantizes every "
        "weight block from the new weights and activation scales are computed per 1x128 group in every "
        "forward. FP8 KV-cache scales change when push_kv_scales or calibrate_kv_scales is called.",
    )
    weight_block_size: tuple[int, int] = (128, 128)
    activation_group_size: int = 128
    on_policy: Literal["off", "bitwise"] = Field(
        default="off",
        description="'bitwise': the engine runs batch- and prefill/decode-invariant kernels "
        "(vLLM's VLLM_BATCH_INVARIANT mode with TRITON_ATTN, prefix caching off, fp8_align's own "
        "RMSNorm, SiLU-and-mul and RoPE ops and a block-FP8 GEMM with one tile configuration for every "
        "token count), and `fp8_align.hf_training.BitwiseForward` runs the same kernels in the trainer, "
        "so the log-probs that generated each token equal the trainer's bit for bit. Llama, Qwen2 and "
        "Qwen3 models, one CUDA GPU, a BF16 or (kv_cache_dtype='fp8') E4M3 KV cache with per-layer scales the "
        "trainer is given (BitwiseForward.set_kv_scales); anything else is refused at engine start. "
        "Build the engine with `engine_kwargs(cfg)`.",
    )
    strict: bool = Field(
        default=False,
        description="Refuse to start when a layer the recipe would run in FP8 has to stay BF16 "
        "(outside the decoder layers, a shape or a module kind fp8_align cannot quantize).",
    )
    quantization_ignored_layer_kws: tuple[str, ...] = Field(
        default=(),
        description="NeMo RL's vllm_cfg key: a linear or routed-expert group whose module name contains "
        "one of these substrings stays BF16 in generation. A module vLLM merges from several checkpoint "
        "modules (qkv_proj from q/k/v_proj, gate_up_proj, ...) stays BF16 when all of the merged names "
        "match; a partial match is refused (one GEMM has one precision). Megatron has no such "
        "setting, so fp8_align.megatron_ext refuses it for FP8 training unless allow_recipe_mismatch.",
    )

    # --- training (Megatron Core / TransformerEngine) ---
    fp8: Literal["hybrid", "e4m3"] | None = "e4m3"
    fp8_recipe: Literal["tensorwise", "blockwise"] = "blockwise"
    fp8_param: bool = False
    allow_recipe_mismatch: bool = Field(
        default=False,
        description="Accept a training recipe or scale rounding that differs from generation.",
    )

    # --- loss ---
    use_importance_sampling_correction: bool = True

    @field_validator("precision", mode="before")
    @classmethod
    def _normalize_precision(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in _PRECISION_ALIASES:
            return _PRECISION_ALIASES[value.lower()]
        return value

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _normalize_kv_cache_dtype(cls, value: Any) -> Any:
        if value is None:
            return "auto"
        if isinstance(value, str) and value.lower() in _KV_CACHE_ALIASES:
            return _KV_CACHE_ALIASES[value.lower()]
        return value

    @field_validator("num_first_layers_in_bf16", "num_last_layers_in_bf16")
    @classmethod
    def _non_negative(cls, value: int, info: Any) -> int:
        if value < 0:
            raise ValueError(f"{info.field_name} must be >= 0 (number of decoder layers kept in BF16), got {value}")
        return value

    @field_validator("quantization_ignored_layer_kws", mode="before")
    @classmethod
    def _keywords_are_strings(cls, value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, str) or not isinstance(value, Sequence):
            # ValueError, not TypeError: pydantic reports only ValueError as a validation error
            raise ValueError(  # noqa: TRY004
                f"quantization_ignored_layer_kws must be a list of module-name substrings, got {value!r}"
            )
        if not all(isinstance(kw, str) and kw for kw in value):
            raise ValueError(f"quantization_ignored_layer_kws entries must be non-empty strings, got {list(value)!r}")
        return tuple(value)

    @field_validator("fp8_attention")
    @classmethod
    def _no_fp8_attention_switch(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "fp8_attention=True (also NeMo RL's policy.generation.vllm_cfg.fp8_attention) is not supported: "
                "fp8_align has no FP8-attention switch. Set kv_cache_dtype='fp8' instead: vLLM then quantizes the "
                "query to FP8 itself where its attention backend takes FP8 queries (FlashAttention on CUDA; push "
                "q_scale with push_kv_scales), and leave fp8_attention unset (False)."
            )
        return value

    @field_validator("recalibrate_scales_every_step")
    @classmethod
    def _scales_always_follow_the_weights(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "recalibrate_scales_every_step=False (also NeMo RL's policy.generation.vllm_cfg key) is not supported: "
                "fp8_align has no static scales to keep. Every refit re-quantizes each weight block from the new "
                "weights and activation scales are computed in every forward; FP8 KV-cache scales change only when "
                "you call push_kv_scales or calibrate_kv_scales. Leave recalibrate_scales_every_step unset (True)."
            )
        return value

    @field_validator("weight_block_size")
    @classmethod
    def _block_is_128(cls, value: tuple[int, int]) -> tuple[int, int]:
        if tuple(value) != (128, 128):
            raise ValueError(
                f"weight_block_size must be (128, 128): the DeepGEMM/CUTLASS block-FP8 kernels and "
                f"TransformerEngine's blockwise recipe use 128x128 weight blocks, got {tuple(value)}"
            )
        return value

    @field_validator("activation_group_size")
    @classmethod
    def _group_is_128(cls, value: int) -> int:
        if value != 128:
            raise ValueError(
                f"activation_group_size must be 128 (1x128 per-token groups match the 128-wide K "
                f"slices of the weight blocks), got {value}"
            )
        return value

    @model_validator(mode="after")
    def _cross_field_checks(self) -> FP8Config:
        if self.kv_decode_kernel == "xqa" and self.kv_cache_dtype != "fp8":
            raise ValueError(
                "kv_decode_kernel='xqa' decodes an FP8 KV cache: set kv_cache_dtype='fp8', or kv_decode_kernel='auto' "
                "(the default: XQA where it can run) or 'backend'."
            )
        if self.precision == "bf16" and self.kv_cache_dtype == "fp8":
            raise ValueError(
                "precision='bf16' with an FP8 KV cache is not a recipe fp8_align "
                "aligns; set precision='fp8' or kv_cache_dtype='auto'."
            )
        if self.on_policy == "bitwise" and self.kv_decode_kernel == "xqa":
            raise ValueError(
                "on_policy='bitwise' decodes with TRITON_ATTN's batch-invariant kernel, the one the trainer runs; "
                "kv_decode_kernel='xqa' would decode with another. Leave kv_decode_kernel='auto'."
            )
        if self.fp8_param and self.fp8 is None:
            raise ValueError("fp8_param=True keeps training parameters in FP8 and needs fp8='e4m3' (training in FP8)")
        if self.precision == "fp8" and self.fp8 is not None and not self.allow_recipe_mismatch:
            if self.fp8_recipe != "blockwise":
                raise ValueError(
                    f"training fp8_recipe='{self.fp8_recipe}' cannot match the generation recipe "
                    "(128x128 weight blocks, 1x128 activation groups): use fp8_recipe='blockwise', "
                    "or set allow_recipe_mismatch=True to accept a misaligned run."
                )
            if self.use_weight_pow2_scale != self.use_activation_pow2_scale:
                raise ValueError(
                    "use_weight_pow2_scale and use_activation_pow2_scale differ, but TransformerEngine's "
                    "blockwise recipe rounds weight and activation scales the same way (one switch, "
                    "NVTE_FP8_BLOCK_SCALING_FP32_SCALES), so training cannot match. Set both flags "
                    "equal, set fp8=None (BF16 training), or allow_recipe_mismatch=True."
                )
            if self.fp8 != "e4m3":
                raise ValueError(
                    f"training fp8='{self.fp8}' is not the blockwise recipe's format: 128x128 block "
                    "scaling is defined for E4M3 tensors throughout (as on the generation side). "
                    "Use fp8='e4m3' or set allow_recipe_mismatch=True."
                )
        return self

    # ----------------------------------------------------------------- model-dependent checks
    def bf16_layer_indices(self, num_hidden_layers: int) -> frozenset[int]:
        """Indices of decoder layers kept in BF16 for a model with `num_hidden_layers` layers.

        Raises FP8ConfigError when first+last exceed the model's depth.
        """
        self.validate_for_model(num_hidden_layers)
        first = range(self.num_first_layers_in_bf16)
        last = range(num_hidden_layers - self.num_last_layers_in_bf16, num_hidden_layers)
        return frozenset(first) | frozenset(last)

    def validate_for_model(self, num_hidden_layers: int) -> None:
        """Check the layer counts against a model of `num_hidden_layers` decoder layers."""
        if num_hidden_layers <= 0:
            raise FP8ConfigError(f"num_hidden_layers must be positive, got {num_hidden_layers}")
        kept = self.num_first_layers_in_bf16 + self.num_last_layers_in_bf16
        if kept > num_hidden_layers:
            raise FP8ConfigError(
                f"num_first_layers_in_bf16 ({self.num_first_layers_in_bf16}) + num_last_layers_in_bf16 "
                f"({self.num_last_layers_in_bf16}) = {kept} is larger than the model's "
                f"{num_hidden_layers} decoder layers; lower them (keeping every layer in BF16 is "
                "precision='bf16')."
            )

    # ----------------------------------------------------------------- loading and saving
    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> FP8Config:
        """Build from keyword arguments, raising FP8ConfigError with every problem listed."""
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise FP8ConfigError(_format_validation_error(exc)) from None

    @classmethod
    def from_nemo_rl(cls, cfg: Mapping[str, Any]) -> FP8Config:
        """Build from a NeMo RL master config dict (what its `load_config` returns, resolved or not).

        Reads `policy.generation.vllm_cfg` (generation fields, NeMo RL's pow2 names), the FP8 keys of
        `policy.generation.vllm_kwargs`, `policy.megatron_cfg.fp8_cfg` (when it and Megatron are
        enabled), `policy.megatron_cfg.env_vars` / `model_overrides` and
        `loss_fn.use_importance_sampling_correction`; `${a.b}` / `${.b}` interpolations in the values
        read are resolved against `cfg`. Keys unrelated to FP8 are ignored. Raises FP8ConfigError,
        naming the NeMo RL key, for every FP8 key whose value fp8_align cannot honour (docs/megatron.md,
        "NeMo RL recipes", lists them).

        With `policy.generation.vllm_kwargs.quantization: fp8_align` (NeMo RL's engines run fp8_align)
        the generation side is FP8 and `vllm_cfg.precision` is NeMo RL's own FP8 switch: it must be
        off (bfloat16), else FP8ConfigError says which one to turn off.
        """
        nemo = _NemoRlView(cfg)
        kwargs: dict[str, Any] = {}
        sources: dict[str, str] = {}

        vllm_path = "policy.generation.vllm_cfg"
        vllm_cfg = nemo.section(vllm_path)
        for name in _GENERATION_FIELDS:
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
        generates_fp8 = str(kwargs.get("precision", cls.model_fields["precision"].default)).lower() == "fp8"
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
            unknown = sorted(set(fp8_cfg) - set(_TRAINING_FIELDS) - _NEMO_RL_FP8_CFG_RUNTIME_KEYS - {"enabled"})
            if unknown:
                raise FP8ConfigError(
                    f"{fp8_path} has key(s) fp8_align does not know: {', '.join(unknown)}. It reads "
                    f"{', '.join(('enabled', *_TRAINING_FIELDS))} (and passes "
                    f"{', '.join(sorted(_NEMO_RL_FP8_CFG_RUNTIME_KEYS))}, which changes no numerics); "
                    "remove the others."
                )
            for name in _TRAINING_FIELDS:
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

        cfg_out = cls._from_sources(kwargs, sources)
        if training_fp8:
            _check_te_scale_env_var(nemo, megatron_cfg, megatron_path, cfg_out)
        return cfg_out

    @classmethod
    def _from_sources(cls, kwargs: dict[str, Any], sources: Mapping[str, str]) -> FP8Config:
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise FP8ConfigError(_format_validation_error(exc, sources)) from None

    def to_nemo_rl(self) -> dict[str, Any]:
        """The NeMo RL dict layout of this config (inverse of `from_nemo_rl`)."""
        vllm_cfg = {name: getattr(self, name) for name in _GENERATION_FIELDS}
        vllm_cfg["quantization_ignored_layer_kws"] = list(self.quantization_ignored_layer_kws)
        for nemo_name, name in _NEMO_RL_GENERATION_ALIASES.items():
            vllm_cfg[nemo_name] = vllm_cfg.pop(name)
        fp8_cfg: dict[str, Any] = {"enabled": self.fp8 is not None}
        fp8_cfg.update({name: getattr(self, name) for name in _TRAINING_FIELDS})
        megatron_cfg: dict[str, Any] = {"fp8_cfg": fp8_cfg}
        if self.fp8 is not None and self.fp8_recipe == "blockwise":
            # TE's blockwise scale rounding (weight rounding where allow_recipe_mismatch lets them differ)
            megatron_cfg["env_vars"] = {TE_FP32_SCALES_ENV_VAR: "0" if self.use_weight_pow2_scale else "1"}
        return {
            "policy": {"generation": {"vllm_cfg": vllm_cfg}, "megatron_cfg": megatron_cfg},
            "loss_fn": {"use_importance_sampling_correction": self.use_importance_sampling_correction},
        }

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> FP8Config:
        """Load a YAML file, following NeMo RL's `defaults:` inheritance (`load_nemo_rl_yaml`): a
        NeMo RL master config or recipe (has a `policy` key) goes through `from_nemo_rl`, any other
        mapping is taken as FP8Config fields."""
        data = load_nemo_rl_yaml(path)
        return cls.from_nemo_rl(data) if "policy" in data else cls.from_kwargs(**data)

    def to_json(self) -> str:
        """Compact JSON with every field, stable key order."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> FP8Config:
        """Inverse of `to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FP8ConfigError(f"{CONFIG_ENV_VAR} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise FP8ConfigError(f"{CONFIG_ENV_VAR} must hold a JSON object, got {type(data).__name__}")
        return cls.from_kwargs(**data)

    def to_env(self) -> dict[str, str]:
        """Environment entries that carry this config into every worker process."""
        return {CONFIG_ENV_VAR: self.to_json()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FP8Config:
        """The config from `FP8_ALIGN_CONFIG`, or the defaults when it is unset."""
        env = os.environ if environ is None else environ
        text = env.get(CONFIG_ENV_VAR)
        return cls() if not text else cls.from_json(text)


_GENERATION_FIELDS = (
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
_TRAINING_FIELDS = ("fp8", "fp8_recipe", "fp8_param", "allow_recipe_mismatch")
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


def _format_validation_error(exc: ValidationError, sources: Mapping[str, str] | None = None) -> str:
    """One line per error; `sources` (field -> the config key it was read from) names those keys."""
    sources = sources or {}
    lines = ["invalid FP8Config:"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        if err["loc"] and err["loc"][0] in sources:
            where = sources[str(err["loc"][0])]
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (known fields: {', '.join(sorted(FP8Config.model_fields))})"
        named = [f"{field} <- {key}" for field, key in sources.items() if not err["loc"] and field in msg]
        lines.append(f"  - {where}: {msg}" + (f" (read from: {'; '.join(named)})" if named else ""))
    return "\n".join(lines)
