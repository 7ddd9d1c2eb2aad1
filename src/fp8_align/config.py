"""One configuration object for both halves of an FP8 RL run (generation and training).

`FP8Config` carries the generation recipe (vLLM side), the training recipe (Megatron side) and
the loss-side switch. Both sides read the same object, so they cannot disagree. It loads from
keyword arguments, from a NeMo RL master config (a dict, or a YAML recipe read with NeMo RL's
`defaults:` inheritance), and from one environment variable (`FP8_ALIGN_CONFIG`, JSON) so every
worker process of an engine sees exactly the same config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fp8_align.errors import FP8ConfigError
from fp8_align.nemo_rl_config import load_nemo_rl_yaml, nemo_rl_layout, read_nemo_rl
from fp8_align.rounding import DEFAULT_SCALE_RULE, Rounding, ScaleRule

__all__ = ["CONFIG_ENV_VAR", "FP8Config", "FP8ConfigError"]

#: Environment variable that carries a serialized `FP8Config` into worker processes.
CONFIG_ENV_VAR = "FP8_ALIGN_CONFIG"

_PRECISION_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp8": "fp8"}
_KV_CACHE_ALIASES = {"auto": "auto", "bf16": "auto", "bfloat16": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}


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
    scale_rule: ScaleRule = Field(
        default=DEFAULT_SCALE_RULE,
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
        "Qwen3 models, one CUDA GPU or two (tensor_parallel_size=2, scored by BitwiseForward(..., "
        "tensor_parallel_size=2)), a BF16 or (kv_cache_dtype='fp8') E4M3 KV cache with per-layer scales the "
        "trainer is given (BitwiseForward.set_kv_scales); anything else is refused at engine start. "
        "Build the engine with `engine_kwargs(cfg)`.",
    )
    bitwise_linear_backward: Literal["bf16", "fp8"] = Field(
        default="bf16",
        description="The backward of each linear the bitwise trainer (BitwiseForward, make_bitwise, build_bitwise_gpt) "
        "runs in block FP8: 'bf16', the gradients of x @ w.T with the BF16 weight (straight through both quantizers); "
        "'fp8', the two gradient products in block FP8 as TransformerEngine's blockwise recipe runs them (E4M3, 1x128 "
        "groups along each product's reduction dimension, the forward's 128x128 weight blocks; cuBLAS on CUDA): "
        "faster, gradients with FP8 rounding, every FP8 layer's sizes whole 128-blocks. The log-probs are the "
        "engine's either way. 'fp8' needs on_policy='bitwise', precision='fp8', fp8='e4m3' and fp8_recipe='blockwise'.",
    )
    bitwise_attention_tiling: Literal["tile64", "tile128_split"] = Field(
        default="tile64",
        description="The launch constants of fp8_align's FP8-cache attention kernel in the bitwise mode with "
        "kv_cache_dtype='fp8' (fp8_align.bitwise.fp8_cache_attention.ATTENTION_TILINGS). They fix the order of its sums, so "
        "the engine and the trainer both read this field, and the log-probs' bits differ from one tiling to the other. "
        "'tile64': 64-key tiles, 2 warps, 3 software-pipelining stages (the fastest rollout on an H200 at Qwen3-8B's heads). "
        "'tile128_split': 128-key tiles, 4 warps, 3 stages, each product taken in two halves of the head dimension "
        "(1.28x faster decode than 'tile64' at Qwen3-1.7B's heads on an H100, benchmarks/RESULTS.md). Needs "
        "on_policy='bitwise' and kv_cache_dtype='fp8'.",
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
        if self.bitwise_linear_backward == "fp8" and (
            self.on_policy != "bitwise" or self.precision != "fp8" or self.fp8 != "e4m3" or self.fp8_recipe != "blockwise"
        ):
            raise ValueError(
                "bitwise_linear_backward='fp8' runs the bitwise trainer's FP8 linears' backward in E4M3 block FP8; it needs "
                "on_policy='bitwise', precision='fp8' and the E4M3 blockwise training recipe (fp8='e4m3', fp8_recipe='blockwise'); "
                f"got on_policy={self.on_policy!r}, precision={self.precision!r}, fp8={self.fp8!r}, fp8_recipe={self.fp8_recipe!r}"
            )
        if self.bitwise_attention_tiling != "tile64" and (self.on_policy != "bitwise" or self.kv_cache_dtype != "fp8"):
            raise ValueError(
                f"bitwise_attention_tiling={self.bitwise_attention_tiling!r} tiles the bitwise mode's FP8-cache attention; it needs "
                f"on_policy='bitwise' and kv_cache_dtype='fp8' (got on_policy={self.on_policy!r}, kv_cache_dtype={self.kv_cache_dtype!r})"
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

    @property
    def rounding(self) -> Rounding:
        """The generation side's scale rounding: the two pow2 flags and `scale_rule`, as one value."""
        return Rounding(
            weight_pow2=self.use_weight_pow2_scale, activation_pow2=self.use_activation_pow2_scale, scale_rule=self.scale_rule
        )

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
        """Build from a NeMo RL master config dict (what its `load_config` returns, resolved or not):
        the keys `fp8_align.nemo_rl_config.read_nemo_rl` reads and checks, FP8ConfigError naming the
        NeMo RL key for every FP8 key whose value fp8_align cannot honour (docs/megatron.md)."""
        fields = read_nemo_rl(cfg, cls.model_fields["precision"].default)
        built = cls._from_sources(fields.kwargs, fields.sources)
        fields.check(built)
        return built

    @classmethod
    def _from_sources(cls, kwargs: dict[str, Any], sources: Mapping[str, str]) -> FP8Config:
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise FP8ConfigError(_format_validation_error(exc, sources)) from None

    def to_nemo_rl(self) -> dict[str, Any]:
        """The NeMo RL dict layout of this config (inverse of `from_nemo_rl`)."""
        return nemo_rl_layout(self.model_dump())

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
