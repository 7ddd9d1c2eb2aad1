"""benchmarks/decode_profile.py without engines: each variant's engine environment, and the
per-step breakdown it computes from a profiler table that a GPU run saved (session 6, H100)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import decode_profile

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize("variant", decode_profile.VARIANTS)
def test_variant_env_turns_deepgemm_on_only_where_the_config_asks(variant: str, tmp_path: Path) -> None:
    fields = decode_profile.VARIANTS[variant]
    env = decode_profile.variant_env(fields, tmp_path, "v2")
    deep_gemm = bool(fields and fields.get("use_deep_gemm"))
    assert env["VLLM_USE_DEEP_GEMM"] == ("1" if deep_gemm else "0")
    assert env.get("DG_JIT_CACHE_DIR") == (str(tmp_path) if deep_gemm else None)
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in decode_profile.variant_env(fields, None, None)


def test_best_rollout_configuration_is_a_variant() -> None:
    """The configuration issue #26 profiles at batch 512: DeepGEMM linears, FP8 KV, XQA decode
    (fp8_align's route on vLLM 0.22; on 0.25.1 the attention backend's, FLASHINFER's XQA)."""
    from fp8_align.config import FP8Config

    cfg = FP8Config(**decode_profile.VARIANTS["fp8_align_kv_xqa_dg"])
    assert (cfg.use_deep_gemm, cfg.kv_cache_dtype, cfg.kv_decode_kernel) == (True, "fp8", "xqa")
    cfg = FP8Config(**decode_profile.VARIANTS["fp8_align_kv_dg"])
    assert (cfg.use_deep_gemm, cfg.kv_cache_dtype, cfg.kv_decode_kernel) == (True, "fp8", "backend")


def test_summary_of_a_saved_table_matches_its_report_and_adds_the_launch_gap() -> None:
    """The saved BF16 table (20 profiled steps) sums to the GPU ms per step its report holds; with a
    measured step wall time the gap is that time less the GPU time."""
    report = json.loads((RESULTS / "decode_profile.json").read_text())
    entry = report["variants"]["bf16"]
    table = (RESULTS / "decode_profile_bf16" / "profiler_out_0.txt").read_text()
    measured = {"engine_kwargs": {}, "prefill_steps": 1, "generate_s": 1.0, "step_wall_ms": 25.0}
    summary = decode_profile.summarize(measured, table, entry["batch"], report["steps"])
    assert summary["gpu_ms_per_step"] == pytest.approx(entry["gpu_ms_per_step"], rel=1e-9)
    assert summary["launch_gap_ms_per_step"] == pytest.approx(25.0 - entry["gpu_ms_per_step"], rel=1e-9)
    assert sum(summary["families_ms_per_step"].values()) == pytest.approx(summary["gpu_ms_per_step"])
    without_wall = decode_profile.summarize({k: v for k, v in measured.items() if k != "step_wall_ms"}, table, 140, 20)
    assert "launch_gap_ms_per_step" not in without_wall
