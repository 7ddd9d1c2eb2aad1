"""One configuration object for both halves of an FP8 RL run (generation and training).

`FP8Config` carries the generation recipe (vLLM side), the training recipe (Megatron side) and
the loss-side switch. Both sides read the same object, so they cannot disagree. It loads from
keyword arguments, from a NeMo RL style dict or YAML file, and from one environment variable
(`FP8_ALIGN_CONFIG`, JSON) so every worker process of an engine sees exactly the same config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: Environment variable that carries a serialized `FP8Config` into worker processes.
CONFIG_ENV_VAR = "FP8_ALIGN_CONFIG"

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
    kv_decode_kernel: Literal["auto", "xqa"] = Field(
        default="auto",
        description="Decode kernel over the FP8 KV cache. 'auto': the attention backend vLLM picks. 'xqa': "
        "vLLM 0.22 FLASH_ATTN engines on Hopper send pure-decode batches to FlashInfer's XQA kernel "
        "(prefill stays on FA3); needs kv_cache_dtype='fp8' and the XQA module (docs/xqa_decode.md).",
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
        "Qwen3 models, one CUDA GPU, BF16 KV cache; anything else is refused at engine start. "
        "Build the engine with `engine_kwargs(cfg)`.",
    )
    strict: bool = Field(
        default=False,
        description="Refuse to start when a layer the recipe would run in FP8 has to stay BF16 "
        "(outside the decoder layers, a shape or a module kind fp8_align cannot quantize).",
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
                "kv_decode_kernel='xqa' decodes an FP8 KV cache: set kv_cache_dtype='fp8' or kv_decode_kernel='auto'."
            )
        if self.precision == "bf16" and self.kv_cache_dtype == "fp8":
            raise ValueError(
                "precision='bf16' with an FP8 KV cache is not a recipe fp8_align "
                "aligns; set precision='fp8' or kv_cache_dtype='auto'."
            )
        if self.on_policy == "bitwise" and self.kv_cache_dtype != "auto":
            raise ValueError(
                "on_policy='bitwise' needs the BF16 KV cache: an FP8 KV cache quantizes K/V with scales the "
                "trainer's full-sequence attention does not see, so decode and training attention differ. "
                "Set kv_cache_dtype='auto' (and fp8_attention=False, kv_decode_kernel='auto') or on_policy='off'."
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
        """Build from a NeMo RL master config dict (`policy.generation.vllm_cfg.*`,
        `policy.megatron_cfg.fp8_cfg.*`, `loss_fn.use_importance_sampling_correction`).

        With `policy.generation.vllm_kwargs.quantization: fp8_align` (NeMo RL's engines run
        fp8_align) the generation side is FP8 and `vllm_cfg.precision` is NeMo RL's own FP8
        switch: it must be off (bfloat16), else FP8ConfigError says which one to turn off.

        Keys fp8_align does not know inside those sections are ignored (NeMo RL sections carry
        many unrelated settings); known keys are validated.
        """
        policy = _section(cfg, "policy")
        generation = _section(policy, "generation")
        vllm_cfg = _section(generation, "vllm_cfg")
        megatron_cfg = _section(policy, "megatron_cfg")
        fp8_cfg = _section(megatron_cfg, "fp8_cfg")
        loss_fn = _section(cfg, "loss_fn")

        kwargs: dict[str, Any] = {}
        for name in _GENERATION_FIELDS:
            if name in vllm_cfg and vllm_cfg[name] is not None:
                kwargs[name] = vllm_cfg[name]
        for nemo_name, name in _NEMO_RL_GENERATION_ALIASES.items():
            if vllm_cfg.get(nemo_name) is None:
                continue
            if name in kwargs and kwargs[name] != vllm_cfg[nemo_name]:
                raise FP8ConfigError(
                    f"vllm_cfg.{nemo_name}={vllm_cfg[nemo_name]!r} contradicts vllm_cfg.{name}={kwargs[name]!r}; keep one"
                )
            kwargs[name] = vllm_cfg[nemo_name]
        training_enabled = bool(megatron_cfg.get("enabled", True)) and bool(fp8_cfg.get("enabled", bool(fp8_cfg)))
        if training_enabled:
            for name in _TRAINING_FIELDS:
                if name in fp8_cfg and fp8_cfg[name] is not None:
                    kwargs[name] = fp8_cfg[name]
        else:
            kwargs["fp8"] = None
        if "use_importance_sampling_correction" in loss_fn:
            kwargs["use_importance_sampling_correction"] = loss_fn["use_importance_sampling_correction"]
        vllm_kwargs = _section(generation, "vllm_kwargs")
        if vllm_kwargs.get("quantization") == _NEMO_RL_ENGINE_QUANTIZATION:
            _check_nemo_rl_fp8_align_engines(vllm_cfg, vllm_kwargs)
            kwargs["precision"] = "fp8"
        return cls.from_kwargs(**kwargs)

    def to_nemo_rl(self) -> dict[str, Any]:
        """The NeMo RL dict layout of this config (inverse of `from_nemo_rl`)."""
        vllm_cfg = {name: getattr(self, name) for name in _GENERATION_FIELDS}
        for nemo_name, name in _NEMO_RL_GENERATION_ALIASES.items():
            vllm_cfg[nemo_name] = vllm_cfg.pop(name)
        fp8_cfg: dict[str, Any] = {"enabled": self.fp8 is not None}
        fp8_cfg.update({name: getattr(self, name) for name in _TRAINING_FIELDS})
        return {
            "policy": {"generation": {"vllm_cfg": vllm_cfg}, "megatron_cfg": {"fp8_cfg": fp8_cfg}},
            "loss_fn": {"use_importance_sampling_correction": self.use_importance_sampling_correction},
        }

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> FP8Config:
        """Load a YAML file: NeMo RL layout (has a `policy` key) or a flat mapping of fields."""
        import yaml

        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, Mapping):
            raise FP8ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
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
)
#: NeMo RL's own names for generation fields (its vllm_cfg keys) -> FP8Config field names.
_NEMO_RL_GENERATION_ALIASES = {
    "pow2_weight_scaling_factors": "use_weight_pow2_scale",
    "pow2_activation_scaling_factors": "use_activation_pow2_scale",
}
_TRAINING_FIELDS = ("fp8", "fp8_recipe", "fp8_param", "allow_recipe_mismatch")


#: `policy.generation.vllm_kwargs.quantization` of a NeMo RL config whose engines run fp8_align.
_NEMO_RL_ENGINE_QUANTIZATION = "fp8_align"


def _check_nemo_rl_fp8_align_engines(vllm_cfg: Mapping[str, Any], vllm_kwargs: Mapping[str, Any]) -> None:
    """For NeMo RL engines started with quantization=fp8_align: raise FP8ConfigError when NeMo RL's
    own FP8 is on too (`vllm_cfg.precision: fp8`), or when `vllm_cfg.kv_cache_dtype` (what NeMo RL
    calibrates and streams KV scales for) and `vllm_kwargs.kv_cache_dtype` (the engine's KV cache;
    NeMo RL passes the former to vLLM only with its own FP8) disagree on FP8."""
    if str(vllm_cfg.get("precision", "bfloat16")).lower() == "fp8":
        raise FP8ConfigError(
            "policy.generation.vllm_cfg.precision: fp8 turns on NeMo RL's own FP8 generation (its init_fp8 patches "
            "vLLM and replaces vllm_kwargs.quantization with 'fp8'), and policy.generation.vllm_kwargs.quantization: "
            "fp8_align asks for fp8_align; turn one off. For fp8_align set vllm_cfg.precision: bfloat16 (the recipe "
            "comes from the other vllm_cfg keys); for NeMo RL's FP8 remove quantization: fp8_align from vllm_kwargs."
        )
    calibrated = str(vllm_cfg.get("kv_cache_dtype") or "auto").startswith("fp8")
    engine = str(vllm_kwargs.get("kv_cache_dtype") or "auto").startswith("fp8")
    if calibrated != engine:
        raise FP8ConfigError(
            f"policy.generation.vllm_cfg.kv_cache_dtype={vllm_cfg.get('kv_cache_dtype')!r} (NeMo RL calibrates and "
            f"streams KV scales for it) but vllm_kwargs.kv_cache_dtype={vllm_kwargs.get('kv_cache_dtype')!r} (the "
            "engine's KV cache: with precision bfloat16 NeMo RL does not pass vllm_cfg's to vLLM); set both to fp8 or both to auto."
        )


def _section(cfg: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = cfg.get(key) or {}
    if not isinstance(value, Mapping):
        raise FP8ConfigError(f"config section '{key}' must be a mapping, got {type(value).__name__}")
    return value


def _format_validation_error(exc: ValidationError) -> str:
    lines = ["invalid FP8Config:"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (known fields: {', '.join(sorted(FP8Config.model_fields))})"
        lines.append(f"  - {where}: {msg}")
    return "\n".join(lines)
