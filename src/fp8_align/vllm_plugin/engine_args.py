"""How an `FP8Config` reaches every vLLM process: engine keyword arguments or one env var."""

from __future__ import annotations

import os
from typing import Any

from fp8_align.config import FP8Config

#: Set by `engine_kwargs` for `on_policy="bitwise"`: vLLM's batch-invariant mode (read by the engine
#: and its workers when they start, so it must be in this process's environment before `LLM(...)`).
BATCH_INVARIANT_ENV_VAR = "VLLM_BATCH_INVARIANT"
#: Set to "0" by `engine_kwargs` for `on_policy="bitwise"`: vLLM's V1 model runner, whose sampler the
#: bitwise proofs cover (0.25 makes V2 the default for dense models, quantized or not).
V2_MODEL_RUNNER_ENV_VAR = "VLLM_USE_V2_MODEL_RUNNER"
#: Lab switch for a GPU proof run: a comma-separated list of `UNPROVEN_BITWISE_FEATURES` the bitwise
#: engine then runs although no proof of them is in benchmarks/results/ (never for RL runs).
UNPROVEN_BITWISE_ENV_VAR = "FP8_ALIGN_UNPROVEN_BITWISE"
#: What `UNPROVEN_BITWISE_ENV_VAR` may name: "v2_runner", vLLM's V2 model runner (its sampler's
#: temperature and log-softmax kernels); "qwen3_moe", the bitwise Mixture-of-Experts layer.
UNPROVEN_BITWISE_FEATURES = ("v2_runner", "qwen3_moe")
#: Engine arguments of `on_policy="bitwise"` (what `vllm_plugin.on_policy` checks at engine start).
BITWISE_ENGINE_KWARGS = {"attention_backend": "TRITON_ATTN", "enable_prefix_caching": False, "disable_cascade_attn": True}

QUANTIZATION_NAME = "fp8_align"
#: Key fp8_align puts into `hf_overrides["quantization_config"]`, as checkpoints do.
QUANT_METHOD_KEY = "quant_method"


def quantization_config_dict(cfg: FP8Config) -> dict[str, Any]:
    """The `quantization_config` entry (as in a checkpoint's config.json) that carries `cfg`."""
    return {QUANT_METHOD_KEY: QUANTIZATION_NAME, **cfg.model_dump(mode="json")}


def unproven_bitwise_features() -> frozenset[str]:
    """The features `UNPROVEN_BITWISE_ENV_VAR` lets a bitwise engine run before their GPU proof;
    ValueError naming any entry that is not in `UNPROVEN_BITWISE_FEATURES`."""
    named = frozenset(part.strip() for part in os.environ.get(UNPROVEN_BITWISE_ENV_VAR, "").split(",") if part.strip())
    unknown = sorted(named - set(UNPROVEN_BITWISE_FEATURES))
    if unknown:
        raise ValueError(f"{UNPROVEN_BITWISE_ENV_VAR} names {unknown}; it takes a comma-separated list of {UNPROVEN_BITWISE_FEATURES}")
    return named


def engine_kwargs(cfg: FP8Config | None = None, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM(...)` / `EngineArgs(...)` that run `cfg` in every worker.

    The config travels inside `hf_overrides["quantization_config"]`, which vLLM ships with the
    model config to every worker (multiprocessing and Ray alike). `kv_cache_dtype` follows
    `cfg.kv_cache_dtype`. Extra keyword arguments are merged in (an `hf_overrides` dict is merged
    key by key). With `cfg.precision == "bf16"` no quantization is requested at all, except with
    `cfg.on_policy == "bitwise"`, which also needs fp8_align in a BF16 engine: then the kwargs hold
    `BITWISE_ENGINE_KWARGS` and this function sets VLLM_BATCH_INVARIANT=1 and
    VLLM_USE_V2_MODEL_RUNNER=0 in `os.environ`; it raises ValueError when the environment already
    asks for the V2 model runner (VLLM_USE_V2_MODEL_RUNNER other than 0), unless
    `UNPROVEN_BITWISE_ENV_VAR` names "v2_runner" (then the runner is left to the environment).
    """
    cfg = FP8Config() if cfg is None else cfg
    kwargs: dict[str, Any] = {}
    if cfg.precision == "fp8" or cfg.on_policy == "bitwise":
        kwargs["quantization"] = QUANTIZATION_NAME
        kwargs["hf_overrides"] = {"quantization_config": quantization_config_dict(cfg)}
        if cfg.kv_cache_dtype == "fp8":
            kwargs["kv_cache_dtype"] = "fp8"
    if cfg.on_policy == "bitwise":
        if "v2_runner" not in unproven_bitwise_features():
            if os.environ.get(V2_MODEL_RUNNER_ENV_VAR, "0") != "0":
                raise ValueError(
                    f"on_policy='bitwise' runs vLLM's V1 model runner, but {V2_MODEL_RUNNER_ENV_VAR}="
                    f"{os.environ[V2_MODEL_RUNNER_ENV_VAR]!r} asks for V2; unset it or set it to 0"
                )
            os.environ[V2_MODEL_RUNNER_ENV_VAR] = "0"
        os.environ[BATCH_INVARIANT_ENV_VAR] = "1"
        kwargs.update(BITWISE_ENGINE_KWARGS)
    extra_overrides = overrides.pop("hf_overrides", None)
    if extra_overrides:
        if "quantization_config" in extra_overrides and "hf_overrides" in kwargs:
            raise ValueError("hf_overrides['quantization_config'] is set by engine_kwargs(cfg); pass the config as cfg")
        kwargs["hf_overrides"] = {**kwargs.get("hf_overrides", {}), **extra_overrides}
    kwargs.update(overrides)
    return kwargs


def config_from_engine(quant_config: dict[str, Any] | None, environ: dict[str, str] | None = None) -> FP8Config:
    """The FP8Config an engine runs: from its `quantization_config` dict when present, else from
    the `FP8_ALIGN_CONFIG` env var, else defaults. Both present and different is an error.
    """
    env = os.environ if environ is None else environ
    from_env = FP8Config.from_env(env)
    if not quant_config:
        return from_env
    fields = {k: v for k, v in quant_config.items() if k != QUANT_METHOD_KEY}
    method = quant_config.get(QUANT_METHOD_KEY, QUANTIZATION_NAME)
    if method != QUANTIZATION_NAME:
        raise ValueError(f"quantization_config.quant_method is {method!r}, expected {QUANTIZATION_NAME!r}")
    from_engine = FP8Config.from_kwargs(**fields)
    if from_env.model_dump() != from_engine.model_dump() and env.get("FP8_ALIGN_CONFIG"):
        raise ValueError(
            "FP8_ALIGN_CONFIG and the engine's quantization_config disagree; set one of them. "
            f"env: {from_env.to_json()} engine: {from_engine.to_json()}"
        )
    return from_engine
