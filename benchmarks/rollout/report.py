"""The rollout benchmark's report: device and versions, one report completed over several calls,
ratios, and the printed table."""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.rollout.checkpoints import DEFAULT_MODEL, MODELS, is_moe
from benchmarks.rollout.runner import SHAPES

#: Report fields that must be equal for variants measured in different calls to share a report.
SAME_RUN_FIELDS = ("device", "torch", "cuda", "triton", "transformers", "vllm", "model", "engine_settings", "shapes")
#: Engine settings a report's name leaves out at these values (and at None: vLLM's choice).
DEFAULT_SETTINGS = {"gpu_memory_utilization": 0.85, "tensor_parallel_size": 1}


class MergeError(ValueError):
    """An earlier report that this call's variants may not join (another device, software or setup)."""


def nvidia_smi(fields: str, gpu: int | None = None) -> str:
    """`nvidia-smi --query-gpu=FIELDS` as CSV without header: a line per GPU, or GPU index `gpu`'s."""
    select = ["-i", str(gpu)] if gpu is not None else []
    return subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", *select], capture_output=True, text=True, check=True
    ).stdout.strip()


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def device_and_versions() -> dict[str, str]:
    """GPU name and driver, and the versions of torch, CUDA, Triton, transformers and vLLM."""
    import torch
    import transformers
    import triton
    import vllm

    return {
        "device": nvidia_smi("name,driver_version"),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "vllm": vllm.__version__,
    }


def results_name(model: str, shape_names: list[str], settings: dict[str, Any]) -> str:
    """Report file name: the model unless it is the default, the shapes, and the engine settings
    changed from the defaults (ratios only within one model and setting)."""
    tag = "".join(f"_{key}_{value}" for key, value in settings.items() if value is not None and value != DEFAULT_SETTINGS.get(key))
    tag = tag.replace(",", "_").replace("=", "-")  # per-variant attention backends: file-name characters only
    prefix = "rollout_throughput" if model == DEFAULT_MODEL else f"rollout_throughput_{model}"
    return f"{prefix}_{'_'.join(shape_names)}{tag.lower()}.json"


def report_header(model: str, shape_names: list[str], repeats: dict[str, int], settings: dict[str, Any]) -> dict[str, Any]:
    """This call's report fields other than the variants (device and versions included), as they
    read back from a report file."""
    shape = MODELS[model]
    gemm = ("CUTLASS in every FP8 variant (VLLM_USE_DEEP_GEMM=0, FP8Config(use_deep_gemm=False)) but the _dg ones: "
            "DeepGEMM (VLLM_USE_DEEP_GEMM=1, FP8Config(use_deep_gemm=True))")
    if is_moe(shape.config):
        gemm += ("; routed experts: vLLM's Triton block-FP8 fused MoE (moe_backend triton) but in the _dg variants: "
                 "DeepGEMM's grouped GEMM (moe_backend deep_gemm); VLLM_USE_DEEP_GEMM_E8M0=0")
    header = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": utc_now(),
        **device_and_versions(),
        "model": {"name": model, "config": shape.config, "load_format": shape.load_format, "init": shape.init},
        "engine_settings": settings,
        "fp8_gemm_backend": gemm,
        "shapes": {name: {**dict(zip(("prompts", "prompt_tokens", "new_tokens"), SHAPES[name])), "repeats": repeats[name]}
                   for name in shape_names},
    }  # fmt: skip
    return json.loads(json.dumps(header))


def load_report(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    """The report of earlier calls at `path`, to add this call's variants to. MergeError unless it
    has this call's GPU name and driver, software versions, model, shapes and engine settings."""
    report = json.loads(path.read_text())
    differ = [
        f"{field}: {str(report.get(field))[:200]} there, {str(header[field])[:200]} here"
        for field in SAME_RUN_FIELDS
        if report.get(field) != header[field]
    ]
    if differ:
        raise MergeError(f"{path} holds another run, its variants' ratios would not compare; " + "; ".join(differ))
    return report


def run_info(device: str, gpus: list[int] | None = None) -> dict[str, Any]:
    """When, where (the host's GPUs `gpus` when given: `gpu_index` the one index, or the list of a
    tensor-parallel engine's; `gpu_uuid` their uuids joined by commas) and by which command a variant is measured."""
    return {
        "started_utc": utc_now(), "device": device, "gpu_uuid": ",".join(nvidia_smi("uuid", gpu) for gpu in gpus) if gpus else nvidia_smi("uuid"),
        "gpu_index": (gpus[0] if len(gpus) == 1 else gpus) if gpus else None,
        "host": socket.gethostname(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }  # fmt: skip


def save(report: dict[str, Any], paths: list[Path]) -> None:
    """Recompute the ratios and write the report to every path."""
    add_ratios(report)
    for path in paths:
        path.write_text(json.dumps(report, indent=2))


def add_ratios(report: dict[str, Any]) -> None:
    """Per shape: each variant's throughput over BF16's, and fp8_align over vLLM's own FP8 path;
    whether every measured variant ran on one GPU, or one set of GPUs at tensor_parallel_size > 1
    (one machine: --merge may join two of a kind)."""
    variants = {name: r for name, r in report["variants"].items() if "by_shape" in r}
    report["variants_on_one_gpu"] = len({r.get("run", {}).get("gpu_uuid") for r in variants.values()}) <= 1
    if "fp8_align" in variants and "vllm_fp8" in variants:
        report["fp8_align_extra_engine_start_vs_vllm_fp8_s"] = (
            variants["fp8_align"]["engine_start_s"] - variants["vllm_fp8"]["engine_start_s"]
        )
    report["ratios"] = {}
    for shape in report["shapes"]:
        ratios: dict[str, float] = {}
        tok_s = {name: r["by_shape"][shape]["output_tok_per_s"] for name, r in variants.items()}
        if "bf16" in tok_s:
            for name, value in tok_s.items():
                ratios[f"{name}_vs_bf16"] = value / tok_s["bf16"]
        for ours, theirs in (("fp8_align", "vllm_fp8"), ("fp8_align_kv", "vllm_fp8_kv"), ("fp8_align_kv_xqa", "vllm_fp8_kv"),
                             ("fp8_align_kv_xqa", "fp8_align_kv"), ("fp8_align_dg", "fp8_align"), ("fp8_align_dg", "vllm_fp8"),
                             ("fp8_align_kv_xqa_dg", "vllm_fp8_kv"), ("fp8_align_kv_xqa_dg", "fp8_align_kv_xqa"),
                             ("fp8_align_dg", "vllm_fp8_dg"), ("fp8_align_kv_xqa_dg", "vllm_fp8_kv_dg"),
                             ("fp8_align_kv_dg", "vllm_fp8_kv_dg"), ("fp8_align_kv_dg", "vllm_fp8_online_kv_dg")):
            if ours in tok_s and theirs in tok_s:
                ratios[f"{ours}_vs_{theirs}"] = tok_s[ours] / tok_s[theirs]
        report["ratios"][shape] = ratios


def print_table(report: dict[str, Any]) -> None:
    """Per shape and variant: output tok/s, ratio to BF16, engine start and model load seconds."""
    tp = report.get("engine_settings", {}).get("tensor_parallel_size") or 1
    print(f"\n{report['device']} vllm {report['vllm']}, tensor_parallel_size {tp}, variants on one GPU: {report['variants_on_one_gpu']}")
    print(f"{'shape':<6} {'variant':<20} {'out tok/s':>10} {'vs bf16':>8} {'start s':>8} {'load s':>7} {'repeats':>8}")
    for shape in report["shapes"]:
        for name, r in report["variants"].items():
            if "error" in r:
                print(f"{shape:<6} {name:<20} FAILED")
                continue
            timed, load = r["by_shape"][shape], r.get("model_load_s")
            ratio = report["ratios"].get(shape, {}).get(f"{name}_vs_bf16", float("nan"))
            print(
                f"{shape:<6} {name:<20} {timed['output_tok_per_s']:>10.0f} {ratio:>8.3f} {r['engine_start_s']:>8.1f} "
                f"{load if load is not None else float('nan'):>7.1f} {len(timed['generate_s']):>8}"
            )
