"""How an `FP8Config` reaches every vLLM process: engine keyword arguments or one env var."""

from __future__ import annotations

import os
from typing import Any

from fp8_align.config import FP8Config
from fp8_align.versions import BITWISE_MOE_FEATURE, BITWISE_V2_FEATURE, FEATURE_SERIES, installed_vllm_version, series_text, vllm_series

#: Set by `engine_kwargs` for `on_policy="bitwise"`: vLLM's batch-invariant mode (read by the engine
#: and its workers when they start, so it must be in this process's environment before `LLM(...)`).
BATCH_INVARIANT_ENV_VAR = "VLLM_BATCH_INVARIANT"
#: vLLM's switch of its V2 model runner. `engine_kwargs` sets it to "0" for `on_policy="bitwise"` unless
#: the user asked for V2 ("1") on a release where the bitwise V2 proof exists (0.25 makes V2 the
#: default for dense models, quantized or not).
V2_MODEL_RUNNER_ENV_VAR = "VLLM_USE_V2_MODEL_RUNNER"
#: Lab switch for a GPU proof run: a comma-separated list of `PROVEN_BITWISE_FEATURES` keys the
#: bitwise engine then runs although no proof of them on the installed vLLM is in benchmarks/results/
#: (never for RL runs).
UNPROVEN_BITWISE_ENV_VAR = "FP8_ALIGN_UNPROVEN_BITWISE"
#: The bitwise engine's features proven release by release -> their `versions.FEATURE_SERIES` entry:
#: "v2_runner", vLLM's V2 model runner (its sampler's temperature and log-softmax kernels);
#: "qwen3_moe", the bitwise Mixture-of-Experts layer. `UNPROVEN_BITWISE_ENV_VAR` may name these.
PROVEN_BITWISE_FEATURES = {"v2_runner": BITWISE_V2_FEATURE, "qwen3_moe": BITWISE_MOE_FEATURE}
#: Engine arguments of `on_policy="bitwise"` (what `vllm_plugin.on_policy` checks at engine start).
BITWISE_ENGINE_KWARGS = {"attention_backend": "TRITON_ATTN", "enable_prefix_caching": False, "disable_cascade_attn": True}

QUANTIZATION_NAME = "fp8_align"
#: Key fp8_align puts into `hf_overrides["quantization_config"]`, as checkpoints do.
QUANT_METHOD_KEY = "quant_method"


def quantization_config_dict(cfg: FP8Config) -> dict[str, Any]:
    """The `quantization_config` entry (as in a checkpoint's config.json) that carries `cfg`."""
    return {QUANT_METHOD_KEY: QUANTIZATION_NAME, **cfg.model_dump(mode="json")}


def unproven_bitwise_features() -> frozenset[str]:
    """The features `UNPROVEN_BITWISE_ENV_VAR` lets a bitwise engine run without their GPU proof on the
    installed vLLM; ValueError naming any entry that is not a `PROVEN_BITWISE_FEATURES` key."""
    named = frozenset(part.strip() for part in os.environ.get(UNPROVEN_BITWISE_ENV_VAR, "").split(",") if part.strip())
    unknown = sorted(named - set(PROVEN_BITWISE_FEATURES))
    if unknown:
        raise ValueError(f"{UNPROVEN_BITWISE_ENV_VAR} names {unknown}; it takes a comma-separated list of {tuple(PROVEN_BITWISE_FEATURES)}")
    return named


def bitwise_proven(feature: str) -> bool:
    """True when the bitwise engine's `feature` (a `PROVEN_BITWISE_FEATURES` key) has its GPU proof on
    the installed vLLM's release series (`versions.FEATURE_SERIES`); False elsewhere and without vLLM."""
    version = installed_vllm_version()
    return version is not None and vllm_series(version) in FEATURE_SERIES[PROVEN_BITWISE_FEATURES[feature]]


def bitwise_runs(feature: str) -> bool:
    """True when a bitwise engine may run `feature`: proven on the installed vLLM (`bitwise_proven`),
    or named by the lab switch `UNPROVEN_BITWISE_ENV_VAR`."""
    return bitwise_proven(feature) or feature in unproven_bitwise_features()


def lab_switch_unless_proven(feature: str) -> bool:
    """For a GPU proof run: name `feature` in the lab switch `UNPROVEN_BITWISE_ENV_VAR` (beside the
    features it names already) unless it is proven on the installed vLLM; True when it had to."""
    if bitwise_proven(feature):
        return False
    os.environ[UNPROVEN_BITWISE_ENV_VAR] = ",".join(sorted(unproven_bitwise_features() | {feature}))
    return True


def proven_series_text(feature: str) -> str:
    """The release series (e.g. '0.22') where `feature` of the bitwise engine was proven."""
    return series_text(FEATURE_SERIES[PROVEN_BITWISE_FEATURES[feature]])


def engine_kwargs(cfg: FP8Config | None = None, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM(...)` / `EngineArgs(...)` that run `cfg` in every worker.

    The config travels inside `hf_overrides["quantization_config"]`, which vLLM ships with the
    model config to every worker (multiprocessing and Ray alike). `kv_cache_dtype` follows
    `cfg.kv_cache_dtype`. Extra keyword arguments are merged in (an `hf_overrides` dict is merged
    key by key). With `cfg.precision == "bf16"` no quantization is requested at all, except with
    `cfg.on_policy == "bitwise"`, which also needs fp8_align in a BF16 engine: then the kwargs hold
    `BITWISE_ENGINE_KWARGS` and this function sets VLLM_BATCH_INVARIANT=1 and
    VLLM_USE_V2_MODEL_RUNNER=0 in `os.environ`. A user's VLLM_USE_V2_MODEL_RUNNER=1 is kept where
    the bitwise V2 proof covers the installed vLLM (`bitwise_runs("v2_runner")`); elsewhere it
    raises ValueError. With the lab switch naming "v2_runner" the runner is left to the environment.
    """
    cfg = FP8Config() if cfg is None else cfg
    kwargs: dict[str, Any] = {}
    if cfg.precision == "fp8" or cfg.on_policy == "bitwise":
        kwargs["quantization"] = QUANTIZATION_NAME
        kwargs["hf_overrides"] = {"quantization_config": quantization_config_dict(cfg)}
        if cfg.kv_cache_dtype == "fp8":
            kwargs["kv_cache_dtype"] = "fp8"
    if cfg.on_policy == "bitwise":
        asks_v2 = os.environ.get(V2_MODEL_RUNNER_ENV_VAR, "0") != "0"
        if asks_v2 and not bitwise_runs("v2_runner"):
            raise ValueError(
                f"{V2_MODEL_RUNNER_ENV_VAR}={os.environ[V2_MODEL_RUNNER_ENV_VAR]!r} asks for vLLM's V2 model runner, but the "
                f"bitwise mode's V2 proof covers vLLM {proven_series_text('v2_runner')}, not the installed "
                f"{installed_vllm_version()}: unset it or set it to 0 (the V1 runner)"
            )
        if not asks_v2 and "v2_runner" not in unproven_bitwise_features():
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
