"""`fp8-align doctor` and the vLLM version gate."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from fp8_align.doctor import EnvironmentFacts, build_report, detect_environment, format_report
from fp8_align.versions import (
    ALLOW_UNTESTED_ENV_VAR,
    UnsupportedVLLMVersionError,
    check_vllm_version,
    installed_vllm_version,
    vllm_series,
)

H100 = EnvironmentFacts(
    python="3.12.3", torch="2.11.0+cu130", torch_cuda="13.0", cuda_available=True, gpu_name="NVIDIA H100 80GB HBM3",
    compute_capability=(9, 0), vllm="0.22.0", deep_gemm=True, megatron_core="0.19.2",
    transformer_engine="2.9.0", te_block_scaling=True, triton="3.6.0",
)


def test_hopper_with_everything_can_run_the_whole_recipe():
    report = build_report(H100)
    assert report.vllm_supported is True
    assert all(o.usable for o in report.options), format_report(report)


@pytest.mark.parametrize(("vllm", "v2_said", "moe_said"), [("0.22.0", "yes", "yes"), ("0.25.1", "yes", "vLLM 0.22 only")])
def test_the_bitwise_line_says_where_its_v2_runner_and_moe_proofs_hold(vllm: str, v2_said: str, moe_said: str) -> None:
    """The V2 runner of the bitwise mode is proven on 0.22 and 0.25, its Qwen3-MoE on 0.22 only: the
    doctor's bitwise line names each with its answer for the installed release."""
    [bitwise] = [o for o in build_report(replace(H100, vllm=vllm)).options if o.name.startswith("on_policy='bitwise'")]
    assert bitwise.usable
    assert f"on the V2 model runner (dense models, raw log-probs, TP 1): {v2_said}" in bitwise.reason, bitwise.reason
    assert f"for Qwen3-MoE (V1 model runner, TP 1): {moe_said}" in bitwise.reason, bitwise.reason


@pytest.mark.parametrize(
    ("change", "option", "reason"),
    [
        ({"compute_capability": (10, 0), "gpu_name": "B200"}, "training", "Blackwell: use FP8 generation with BF16 training"),
        ({"compute_capability": (8, 0)}, "use_deep_gemm", "need Hopper"),
        ({"torch_cuda": "12.4"}, "training", "CUDA 12.4 < 12.9"),
        ({"te_block_scaling": False}, "training", "no Float8BlockScaling"),
        ({"transformer_engine": None, "te_block_scaling": False}, "training", "TransformerEngine not installed"),
        ({"deep_gemm": False}, "use_deep_gemm", "DeepGEMM not found"),
        ({"vllm": "0.27.1"}, "on_policy='bitwise'", "runs on vLLM 0.22, 0.25; the installed vLLM is 0.27.1"),
        ({"compute_capability": None, "cuda_available": False, "gpu_name": None}, "on_policy='bitwise'", "no CUDA GPU visible"),
        ({"compute_capability": (8, 0)}, "on_policy='bitwise'", "compute capability >= 8.9"),
        ({"triton": None}, "on_policy='bitwise'", "Triton not installed"),
    ],
)
def test_each_missing_piece_is_reported_with_its_reason(change, option, reason):
    report = build_report(replace(H100, **change))
    matching = [o for o in report.options if o.name.startswith(option) or option in o.name]
    assert matching and not matching[0].usable and reason in matching[0].reason


def test_untested_vllm_is_flagged_in_report():
    text = format_report(build_report(replace(H100, vllm="0.26.0")))
    assert "OUTSIDE the tested range" in text and "0.22.x" in text and "0.32.x" in text


def test_detect_environment_reads_this_machine():
    facts = detect_environment()
    assert facts.vllm == installed_vllm_version()
    assert facts.cuda_available == (facts.compute_capability is not None)


def test_cli_doctor_json_runs_as_console_script():
    out = subprocess.run([sys.executable, "-m", "fp8_align.cli", "doctor", "--json"], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert {"facts", "vllm_supported", "options"} <= set(data)
    assert data["facts"]["torch"]


@pytest.mark.parametrize(("version", "series"), [("0.22.0", (0, 22)), ("0.32.0+cpu", (0, 32)), ("0.22.1rc1", (0, 22))])
def test_vllm_series_parsing(version, series):
    assert vllm_series(version) == series


def test_version_gate():
    """Exactly the series of the release matrix (0.20, 0.22, 0.25, 0.27, 0.29, 0.32) pass; the error
    for any other names them all."""
    for version in ("0.20.2", "0.22.0", "0.25.1", "0.27.1", "0.29.0", "0.32.3"):
        assert check_vllm_version(version, {}) is None, version
    for version in ("0.19.1", "0.21.0", "0.26.0", "0.33.0"):
        with pytest.raises(UnsupportedVLLMVersionError, match=rf"0\.20\.x .*0\.22\.x .*0\.25\.x .*0\.27\.x .*0\.29\.x .*0\.32\.x.*installed vLLM is {version}"):
            check_vllm_version(version, {})
    warning = check_vllm_version("0.26.0", {ALLOW_UNTESTED_ENV_VAR: "1"})
    assert warning and "Running anyway" in warning
    with pytest.raises(UnsupportedVLLMVersionError, match="cannot parse"):
        check_vllm_version("banana", {})


def test_the_feature_table_in_the_docs_is_the_codes() -> None:
    """docs/vllm_versions.md's feature table has one row per `FEATURE_SERIES` entry, in order, each
    naming exactly that feature's series; every gate that reads the table reads its own row."""
    from pathlib import Path

    from fp8_align.versions import FEATURE_SERIES, TESTED_VLLM_SERIES, series_text
    from fp8_align.vllm_plugin import engine_args, on_policy, patches
    from fp8_align.vllm_plugin.kv import flashinfer_scales, probe, xqa_decode

    text = (Path(__file__).resolve().parents[1] / "docs" / "vllm_versions.md").read_text()
    section = text.split("## Which feature runs on which release", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert [(name, series) for name, series, *_ in rows] == [(f"`{name}`", series_text(s)) for name, s in FEATURE_SERIES.items()]
    proven = [FEATURE_SERIES[feature] for feature in engine_args.PROVEN_BITWISE_FEATURES.values()]
    gates = [patches.PATCHED_SERIES, patches.KV_SCALES_SERIES, probe.PROBE_VERSIONS, on_policy.BITWISE_SERIES,
             *proven, xqa_decode.XQA_SERIES, flashinfer_scales.LIVE_SCALES_SERIES]  # fmt: skip
    assert gates == list(FEATURE_SERIES.values())
    assert all(set(series) <= set(TESTED_VLLM_SERIES) for series in FEATURE_SERIES.values())
