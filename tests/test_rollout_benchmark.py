"""benchmarks/rollout_throughput.py without engines: the MoE model's config-only checkpoints, the
per-variant specs and environment, completing one report over several calls (--merge), and
engines split over GPUs (--tensor-parallel-size)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import rollout_throughput as cli
from benchmarks.rollout import checkpoints, report, runner

MOE = "qwen3-30b-a3b"
H200 = {"device": "NVIDIA H200, 580.159.04", "torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0",
        "transformers": "5.17.0", "vllm": "0.22.0"}  # fmt: skip


def test_moe_checkpoints_are_qwen3_30b_a3b_configs(tmp_path: Path) -> None:
    """BF16 folder: the Qwen3-30B-A3B config (30.5 B parameters, 61 GB in BF16); FP8 folder: the
    same plus vLLM's block-FP8 quantization_config with lm_head and every router left BF16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    bf16_dir, fp8_dir = checkpoints.checkpoint_dirs(MOE, tmp_path)
    assert checkpoints.prepare_checkpoints(MOE, bf16_dir, fp8_dir) == {}
    assert sorted(p.name for p in bf16_dir.iterdir()) == sorted(p.name for p in fp8_dir.iterdir()) == ["config.json"]
    config = AutoConfig.from_pretrained(bf16_dir)
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    expected = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, vocab_size=151936,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                    max_position_embeddings=40960)  # fmt: skip
    assert {key: getattr(config, key) for key in expected} == expected
    assert getattr(config, "quantization_config", None) is None
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert 30.4e9 < params < 30.6e9 and 60.8e9 < 2 * params < 61.2e9

    fp8 = json.loads((fp8_dir / "config.json").read_text())
    quantization = fp8.pop("quantization_config")
    assert fp8 == json.loads((bf16_dir / "config.json").read_text())
    routers = quantization.pop("modules_to_not_convert")
    assert quantization == {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert routers == ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(48))]


def test_moonlight_checkpoints_are_deepseek_v3_configs_of_16b(tmp_path: Path) -> None:
    """Moonlight-16B-A3B's shape: DeepSeek-V3 with MLA (no q LoRA), 64 routed experts of 1408 and 2
    shared, top-6, layer 0 dense; 15.96 B parameters. Its FP8 folder keeps lm_head and the routers BF16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    bf16_dir, fp8_dir = checkpoints.checkpoint_dirs("moonlight-16b-a3b", tmp_path)
    assert checkpoints.prepare_checkpoints("moonlight-16b-a3b", bf16_dir, fp8_dir) == {}
    config = AutoConfig.from_pretrained(bf16_dir)
    assert config.architectures == ["DeepseekV3ForCausalLM"] and config.q_lora_rank is None
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.n_routed_experts, config.num_experts_per_tok) == (512, 64, 64, 6)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert 15.9e9 < params < 16.0e9
    quantization = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert quantization["modules_to_not_convert"] == ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(27))]
    assert checkpoints.is_moe(config.to_dict()) and not checkpoints.is_moe(checkpoints.QWEN3_8B)


def test_default_model_keeps_its_names_and_fp8_config(tmp_path: Path) -> None:
    settings = {"attention_backend": None, "gpu_memory_utilization": 0.85, "max_num_seqs": None, "model_runner": None}
    assert report.results_name("qwen3-8b", ["short", "long"], settings) == "rollout_throughput_short_long.json"
    assert report.results_name(MOE, ["long"], settings) == "rollout_throughput_qwen3-30b-a3b_long.json"
    assert report.results_name(MOE, ["long"], {**settings, "max_num_seqs": 320}) == (
        "rollout_throughput_qwen3-30b-a3b_long_max_num_seqs_320.json"
    )
    bf16_dir, fp8_dir = checkpoints.checkpoint_dirs("qwen3-8b", tmp_path)
    assert (bf16_dir.name, fp8_dir.name) == ("qwen3_8b_random_bf16", "qwen3_8b_random_vllm_fp8")
    assert checkpoints.vllm_fp8_quantization_config(checkpoints.QWEN3_8B) == checkpoints.VLLM_FP8_QUANTIZATION


@pytest.mark.parametrize("variant", runner.VARIANTS)
def test_variant_specs(tmp_path: Path, variant: str) -> None:
    """MoE: every variant loads dummy weights; both FP8 paths get E8M0 rounding off. 8B: as before.
    _dg variants: DeepGEMM in the config and the process, with the prepared JIT cache when given,
    and (MoE) DeepGEMM's grouped GEMM for the routed experts; vllm_fp8_online: the BF16 checkpoint
    with vLLM's online block FP8."""
    bf16_dir, fp8_dir, cache = tmp_path / "bf16", tmp_path / "fp8", tmp_path / "dg"
    moe = runner.variant_spec(variant, MOE, bf16_dir, fp8_dir, [], {"model_runner": None})
    dense = runner.variant_spec(variant, "qwen3-8b", bf16_dir, fp8_dir, [], {"model_runner": None}, deepgemm_cache=cache)
    deep_gemm, online = variant.endswith("_dg"), variant.startswith("vllm_fp8_online")
    assert moe["load_format"] == "dummy" and dense["load_format"] == "auto"
    assert moe["model"] == dense["model"] == str(fp8_dir if variant.startswith("vllm_fp8") and not online else bf16_dir)
    vllm_dg = {"VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"} if deep_gemm and variant.startswith("vllm_fp8") else {}
    assert moe["env"] == {**({} if variant == "bf16" else {"VLLM_USE_DEEP_GEMM_E8M0": "0"}), **({"VLLM_USE_DEEP_GEMM": "1"} if deep_gemm else {}),
                          **vllm_dg}  # fmt: skip
    assert dense["env"] == ({"VLLM_USE_DEEP_GEMM": "1", "DG_JIT_CACHE_DIR": str(cache), **vllm_dg} if deep_gemm else {})
    quantization = {"quantization": "fp8_per_block"} if online else {}  # vLLM's online block FP8
    assert moe["llm_kwargs"] == {"moe_backend": "deep_gemm" if deep_gemm else "triton", **quantization}  # routed experts
    assert dense["llm_kwargs"] == quantization
    jit = runner.variant_spec(variant, "qwen3-8b", bf16_dir, fp8_dir, [], {"model_runner": None}, flashinfer_jit=True)
    assert "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER" not in jit["env"]  # where FlashInfer compiles, vLLM's own choice
    assert moe["fp8_align"] == variant.startswith("fp8_align")
    assert moe["kv_cache_dtype"] == ("fp8" if "_kv" in variant else "auto")
    if moe["fp8_align"]:
        from fp8_align import FP8Config

        cfg = FP8Config(**moe["fp8_config"])
        assert cfg.use_deep_gemm == deep_gemm
        # fp8_align_kv: the backend's own decode; _auto: the default, as a user runs it; _bitwise: TRITON_ATTN's
        bitwise = "_bitwise" in variant
        assert cfg.on_policy == ("bitwise" if bitwise else "off")
        assert cfg.kv_decode_kernel == ("xqa" if "_xqa" in variant else "auto" if "_auto" in variant or bitwise else "backend")
        assert cfg.kv_cache_dtype == ("fp8" if "_xqa" in variant or "_auto" in variant or variant == "fp8_align_bitwise_kv" else "auto")
        assert moe["calibrate_kv"] == ("_kv" in variant)  # the engine calibrates its K/V scales before the timed rollouts


def test_attention_backend_per_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--attention-backend FLASHINFER,bf16=auto: FlashInfer for the FP8-KV variants, vLLM's choice
    (None) for BF16, in each engine's spec; the file name keeps file-name characters; unknown
    variants and a second default are refused before any engine starts."""
    setting = "FLASHINFER,bf16=auto"
    settings = {"attention_backend": setting, "model_runner": None}
    specs = {v: runner.variant_spec(v, "qwen3-8b", tmp_path, tmp_path, [], settings) for v in ("bf16", "vllm_fp8_kv_dg", "fp8_align_kv_dg")}
    assert {v: spec["attention_backend"] for v, spec in specs.items()} == {
        "bf16": None, "vllm_fp8_kv_dg": "FLASHINFER", "fp8_align_kv_dg": "FLASHINFER"}  # fmt: skip
    assert runner.attention_backend_of("FLASH_ATTN", "bf16") == "FLASH_ATTN" and runner.attention_backend_of(None, "bf16") is None
    assert runner.attention_backend_of("auto,fp8_align_kv_dg=FLASHINFER", "fp8_align_kv_dg") == "FLASHINFER"
    name = report.results_name("qwen3-8b", ["short", "long"], {**settings, "gpu_memory_utilization": 0.85})
    assert name == "rollout_throughput_short_long_attention_backend_flashinfer_bf16-auto.json"
    for bad in ("FLASHINFER,bf17=auto", "FLASHINFER,TRITON_ATTN"):
        with pytest.raises(ValueError, match="--attention-backend"):
            runner.attention_backends(bad)
    _fake_machine(monkeypatch, "GPU-0", {})
    with pytest.raises(SystemExit):
        _call(tmp_path, "a", "bf16", "--attention-backend", "FLASHINFER,bf17=auto")


# --------------------------------------------------------------------------- one report over calls
def _measured(tok_per_s: float, start_s: float) -> dict[str, Any]:
    """The fields of one variant's result that the report's ratios and table read."""
    long = {"output_tok_per_s": tok_per_s, "generate_s": [60.0]}
    return {"engine_start_s": start_s, "model_load_s": 1.0, "by_shape": {"long": long}}


def _fake_machine(monkeypatch: pytest.MonkeyPatch, uuid: str, rates: dict[str, float], **versions: str) -> list[dict[str, Any]]:
    """The script on a machine without GPU work: fixed device and versions, and each variant's
    engine replaced by its throughput in `rates`. Returns the specs the engines would have run."""
    specs: list[dict[str, Any]] = []

    def run_variant(name: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
        specs.append(spec)
        return _measured(rates[name], 100.0 + len(name))

    monkeypatch.setattr(report, "device_and_versions", lambda: {**H200, **versions})
    monkeypatch.setattr(report, "nvidia_smi", lambda fields, gpu=None: uuid)
    monkeypatch.setattr(runner, "run_variant", run_variant)
    return specs


def _call(tmp_path: Path, machine: str, variants: str, *extra: str) -> int:
    return cli.main([
        "--model", MOE, "--shapes", "long", "--variants", variants, "--models", str(tmp_path / machine / "models"),
        "--work", str(tmp_path / machine / "work"), "--results", str(tmp_path / machine / "out"), *extra,
    ])  # fmt: skip


REPORT = "rollout_throughput_qwen3-30b-a3b_long.json"


def test_variants_of_one_run_over_calls_and_machines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on machine A; fp8_align later on A (its report under --work); vllm_fp8 on machine B
    from A's results file (--merge): ratios against A's bf16, the GPUs recorded per variant."""
    rates = {"bf16": 10000.0, "fp8_align": 14000.0, "vllm_fp8": 13000.0}
    specs = _fake_machine(monkeypatch, "GPU-a", rates)
    assert _call(tmp_path, "a", "bf16") == 0
    assert _call(tmp_path, "a", "bf16,fp8_align") == 0  # bf16 kept, not re-measured
    assert [spec["fp8_align"] for spec in specs] == [False, True]
    written = json.loads((tmp_path / "a" / "out" / REPORT).read_text())
    assert written["model"]["load_format"] == "dummy" and written["model"]["config"]["num_experts"] == 128
    assert written["ratios"]["long"]["fp8_align_vs_bf16"] == pytest.approx(1.4)
    assert written["variants_on_one_gpu"] is True

    specs = _fake_machine(monkeypatch, "GPU-b", rates)
    assert _call(tmp_path, "b", "vllm_fp8", "--merge", str(tmp_path / "a" / "out" / REPORT)) == 0
    assert len(specs) == 1 and specs[0]["env"] == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    written = json.loads((tmp_path / "b" / "out" / REPORT).read_text())
    assert list(written["variants"]) == ["bf16", "fp8_align", "vllm_fp8"]
    assert {name: r["run"]["gpu_uuid"] for name, r in written["variants"].items()} == {
        "bf16": "GPU-a", "fp8_align": "GPU-a", "vllm_fp8": "GPU-b"
    }  # fmt: skip
    assert all(r["run"]["device"] == H200["device"] for r in written["variants"].values())
    assert written["ratios"]["long"] == pytest.approx(
        {"bf16_vs_bf16": 1.0, "fp8_align_vs_bf16": 1.4, "vllm_fp8_vs_bf16": 1.3, "fp8_align_vs_vllm_fp8": 14 / 13}
    )
    assert written["fp8_align_extra_engine_start_vs_vllm_fp8_s"] == pytest.approx(1.0)
    assert written["variants_on_one_gpu"] is False


@pytest.mark.parametrize(
    ("versions", "extra", "field"),
    [
        ({"device": "NVIDIA H100 80GB HBM3, 580.159.04"}, (), "device"),
        ({"vllm": "0.25.1"}, (), "vllm"),
        ({}, ("--max-num-seqs", "320"), "engine_settings"),
    ],
)
def test_merge_refuses_another_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    versions: dict[str, str], extra: tuple[str, ...], field: str,
) -> None:  # fmt: skip
    _fake_machine(monkeypatch, "GPU-a", {"bf16": 10000.0})
    assert _call(tmp_path, "a", "bf16") == 0
    specs = _fake_machine(monkeypatch, "GPU-b", {"fp8_align": 14000.0}, **versions)
    with pytest.raises(SystemExit):
        _call(tmp_path, "b", "fp8_align", "--merge", str(tmp_path / "a" / "out" / REPORT), *extra)
    assert specs == [] and f"{field}:" in capsys.readouterr().err


def test_vllm_reads_the_routers_as_bf16(tmp_path: Path) -> None:
    """vLLM's Fp8Config takes modules_to_not_convert as its ignored layers: routers and lm_head
    stay unquantized, attention projections and experts do not."""
    fp8 = pytest.importorskip("vllm.model_executor.layers.quantization.fp8")
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    config = fp8.Fp8Config.from_config(checkpoints.vllm_fp8_quantization_config(checkpoints.QWEN3_30B_A3B))
    assert config.weight_block_size == [128, 128] and config.is_checkpoint_fp8_serialized
    expected = {"model.layers.47.mlp.gate": True, "lm_head": True, "model.layers.0.self_attn.qkv_proj": False,
                "model.layers.0.mlp.experts": False}  # fmt: skip
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert {prefix: is_layer_skipped(prefix, config.ignored_layers, fused) for prefix in expected} == expected


def test_merge_refuses_another_model(tmp_path: Path) -> None:
    header = {field: None for field in report.SAME_RUN_FIELDS}
    earlier = tmp_path / "report.json"
    earlier.write_text(json.dumps({**header, "model": {"name": "qwen3-8b"}, "variants": {}}))
    with pytest.raises(report.MergeError, match="model: "):
        report.load_report(earlier, {**header, "model": {"name": MOE}})
    assert report.load_report(earlier, {**header, "model": {"name": "qwen3-8b"}})["variants"] == {}


def test_log_fields_read_the_engine_logs_of_a_gpu_run() -> None:
    """The engine-log fields `run_variant` records, read from the saved log of session 17's
    fp8_align Moonlight engine (vLLM 0.25.1, H200): load time, model memory, fp8_align's BF16
    high point while loading; fields whose line that run did not print (the device peak, new
    since) stay unmatched."""
    text = (Path(__file__).resolve().parents[1] / "benchmarks/logs/session17_h200_vllm025/fp8_align.log").read_text()
    fields = {name: re.search(pattern, text) for name, pattern in runner._LOG_FIELDS.items()}
    read = {name: float(match.group(1)) for name, match in fields.items() if match}
    assert read["model_load_s"] == 6.274759 and read["model_memory_gib"] == 15.63
    assert read["fp8_align_load_bf16_peak_mib"] == 1056.0 and read["graph_capture_s"] == 30.0
    assert "load_device_peak_gib" not in read


def test_engine_log_of_a_vllm_025_flashinfer_run() -> None:
    """`read_engine_log` on session 18's engine logs (vLLM 0.25.1, H100): fp8_align's FP8-KV engine
    on FLASHINFER decodes with XQA (vLLM logs no backend choice when one is asked for), its load
    peaks and DeepGEMM kernels; the BF16 engine on vLLM's own choice, FLASH_ATTN."""
    logs = Path(__file__).resolve().parents[1] / "benchmarks/logs/session18_h100x4_vllm025"
    fp8 = runner.read_engine_log((logs / "fp8_align_kv_dg.log").read_text())
    assert fp8["flashinfer_decode_backend"] == ["xqa"] and fp8["attention_backend"] == [] and fp8["model_runner"] == "v2"
    assert fp8["fp8_align_load_bf16_peak_mib"] == 192.0 and fp8["load_device_peak_gib"] == 9.33 and fp8["fp8_align_kernels"] == ["deepgemm"]
    bf16 = runner.read_engine_log((logs / "bf16.log").read_text())
    assert bf16["attention_backend"] == ["FLASH_ATTN"] and bf16["flashinfer_decode_backend"] == [] and bf16["model_memory_gib"] == 15.27


def test_variants_side_by_side_on_the_gpus_of_one_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpus 2: two engines at once, each on its own GPU (CUDA_VISIBLE_DEVICES and the GPU's uuid
    recorded per variant), the third variant on whichever GPU frees first; the report lists the
    variants as asked, and a host with fewer GPUs is refused before any engine starts."""
    import threading
    import time

    uuids = {0: "GPU-0", 1: "GPU-1"}
    running, overlap, lock = set(), [], threading.Lock()

    def run_variant(name: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
        with lock:
            running.add(name)
            overlap.append(len(running))
        time.sleep({"bf16": 0.3, "fp8_align": 0.1, "vllm_fp8": 0.1}[name])
        with lock:
            running.discard(name)
        return {**_measured({"bf16": 10000.0, "fp8_align": 14000.0, "vllm_fp8": 13000.0}[name], 100.0),
                "visible": spec["env"]["CUDA_VISIBLE_DEVICES"]}  # fmt: skip

    monkeypatch.setattr(report, "device_and_versions", lambda: H200)
    monkeypatch.setattr(report, "nvidia_smi", lambda fields, gpu=None: uuids[gpu] if gpu is not None else "GPU-0\nGPU-1")
    monkeypatch.setattr(runner, "run_variant", run_variant)
    assert _call(tmp_path, "x2", "bf16,fp8_align,vllm_fp8", "--gpus", "2") == 0
    written = json.loads((tmp_path / "x2" / "out" / REPORT).read_text())
    assert list(written["variants"]) == ["bf16", "fp8_align", "vllm_fp8"] and max(overlap) == 2
    runs = {name: (r["visible"], r["run"]["gpu_index"], r["run"]["gpu_uuid"]) for name, r in written["variants"].items()}
    assert all(visible == str(index) and uuid == uuids[index] for visible, index, uuid in runs.values())
    assert runs["bf16"][1] != runs["fp8_align"][1] == runs["vllm_fp8"][1]  # the first GPU to free takes the third
    assert written["ratios"]["long"]["fp8_align_vs_bf16"] == pytest.approx(1.4) and written["variants_on_one_gpu"] is False
    with pytest.raises(SystemExit):
        _call(tmp_path, "x2", "bf16", "--gpus", "4")


def test_gpus_from_the_callers_visible_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES=1,3 with --gpus 2 (a box chain that owns GPUs 1 and 3): the engines run
    on host GPUs 1 and 3, recorded with those uuids; --gpus 3 is refused there."""
    import time

    uuids = {1: "GPU-1", 3: "GPU-3"}

    def run_variant(name: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
        time.sleep(0.2)  # both engines running at once
        return {**_measured({"bf16": 10000.0, "fp8_align": 14000.0}[name], 100.0), "visible": spec["env"]["CUDA_VISIBLE_DEVICES"]}

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    monkeypatch.setattr(report, "device_and_versions", lambda: H200)
    monkeypatch.setattr(report, "nvidia_smi", lambda fields, gpu=None: uuids[gpu] if gpu is not None else "GPU-0\nGPU-1\nGPU-2\nGPU-3")
    monkeypatch.setattr(runner, "run_variant", run_variant)
    assert _call(tmp_path, "v", "bf16,fp8_align", "--gpus", "2") == 0
    written = json.loads((tmp_path / "v" / "out" / REPORT).read_text())
    runs = {name: (r["visible"], r["run"]["gpu_index"], r["run"]["gpu_uuid"]) for name, r in written["variants"].items()}
    assert sorted(runs.values()) == [("1", 1, "GPU-1"), ("3", 3, "GPU-3")]
    with pytest.raises(SystemExit):
        _call(tmp_path, "v3", "bf16", "--gpus", "3")


def test_page_size_and_layout_reach_every_engine(tmp_path: Path) -> None:
    """--block-size 64 --kv-cache-layout HND: vLLM's block_size in the engine's spec (run_engine
    passes it on), VLLM_KV_CACHE_LAYOUT=HND in its environment, and both in the report's name."""
    settings = {"model_runner": None, "block_size": 64, "kv_cache_layout": "HND"}
    for variant in ("bf16", "fp8_align_kv_dg"):
        spec = runner.variant_spec(variant, "qwen3-8b", tmp_path, tmp_path, [], settings)
        assert spec["block_size"] == 64 and spec["env"]["VLLM_KV_CACHE_LAYOUT"] == "HND"
    assert "VLLM_KV_CACHE_LAYOUT" not in runner.variant_spec("bf16", "qwen3-8b", tmp_path, tmp_path, [], {"model_runner": None})["env"]
    name = report.results_name("qwen3-8b", ["long"], {**settings, "gpu_memory_utilization": 0.85})
    assert name == "rollout_throughput_long_block_size_64_kv_cache_layout_hnd.json"


def _rollout_report(device: str, variants: dict[str, dict[str, list[float]]]) -> dict[str, object]:
    """A rollout report as rollout_throughput.py writes it, with only what bitwise_speed reads."""
    return {
        "device": device, "vllm": "0.22.0", "torch": "2.11.0", "date_utc": "2026-11-27T00:00:00+00:00",
        "variants": {name: {"kv_cache_tokens": 1000, "by_shape": {shape: {"output_tok_per_s_each": each, "preemptions_each": [0] * len(each)}
                                                                 for shape, each in shapes.items()}}
                     for name, shapes in variants.items()},
    }  # fmt: skip


def test_bitwise_speed_summary_checks_the_targets_on_medians() -> None:
    """bitwise_speed.json from reports of one machine: every repeat kept, targets judged on medians
    (long: >= 0.9x the fast mode and >= 1.9x BF16; short: >= 1.35x BF16); reports of two devices,
    a missing or a doubled variant are refused."""
    from benchmarks import bitwise_speed

    first = _rollout_report("H100", {"bf16": {"long": [10.0, 11.0, 12.0], "short": [20.0, 20.0, 21.0]},
                                     "fp8_align_kv_auto_dg": {"long": [22.0, 20.0, 21.0], "short": [30.0, 30.0, 30.0]}})  # fmt: skip
    second = _rollout_report("H100", {"fp8_align_bitwise_kv": {"long": [19.0, 21.0, 20.0], "short": [26.0, 28.0, 27.0]}})
    summary = bitwise_speed.summarize([first, second])
    assert summary["shapes"]["long"] == {"bf16": [10.0, 11.0, 12.0], "fp8_fast": [22.0, 20.0, 21.0], "fp8_bitwise_kv": [19.0, 21.0, 20.0]}
    assert [(t["shape"], t["value"], t["met"]) for t in summary["targets"]] == [
        ("long", round(20 / 21, 3), True), ("long", round(20 / 11, 3), False), ("short", 1.35, True)]  # fmt: skip
    with pytest.raises(ValueError, match="disagree on device"):
        bitwise_speed.summarize([first, _rollout_report("H200", {"fp8_align_bitwise_kv": {"long": [1.0]}})])
    with pytest.raises(ValueError, match="no report has \\['fp8_align_bitwise_kv'\\]"):
        bitwise_speed.summarize([first])
    with pytest.raises(ValueError, match="in two reports"):
        bitwise_speed.summarize([first, second, second])


# --------------------------------------------------------------------------- tensor parallel
RATES = {"bf16": 10000.0, "fp8_align": 14000.0, "vllm_fp8": 13000.0}


def _fake_host(monkeypatch: pytest.MonkeyPatch, gpus: int) -> list[dict[str, Any]]:
    """`_fake_machine` on a host of `gpus` GPUs (uuid GPU-i), each engine running 0.2 s so that
    engines of one call overlap. Returns the specs the engines would have run."""
    import time

    specs: list[dict[str, Any]] = []

    def run_variant(name: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
        specs.append(spec)
        time.sleep(0.2)
        return {**_measured(RATES[name], 100.0), "visible": spec["env"].get("CUDA_VISIBLE_DEVICES")}

    monkeypatch.setattr(report, "device_and_versions", lambda: H200)
    monkeypatch.setattr(
        report, "nvidia_smi", lambda fields, gpu=None: f"GPU-{gpu}" if gpu is not None else "\n".join(f"GPU-{i}" for i in range(gpus))
    )
    monkeypatch.setattr(runner, "run_variant", run_variant)
    return specs


TP2_REPORT = "rollout_throughput_qwen3-30b-a3b_long_tensor_parallel_size_2.json"


def test_tensor_parallel_engines_on_gpu_pairs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--tensor-parallel-size 2 --gpus 4: two engines at once, each on a pair of GPUs
    (CUDA_VISIBLE_DEVICES=0,1 / 2,3, both indices and uuids recorded), each spec and vLLM's
    arguments with tensor_parallel_size 2 on the multiprocessing executor; the report records the
    size in its engine settings and name. Without --gpus, one engine after another on GPUs 0,1."""
    specs = _fake_host(monkeypatch, 4)
    assert _call(tmp_path, "x4", "bf16,fp8_align,vllm_fp8", "--tensor-parallel-size", "2", "--gpus", "4") == 0
    written = json.loads((tmp_path / "x4" / "out" / TP2_REPORT).read_text())
    assert written["engine_settings"]["tensor_parallel_size"] == 2 and list(written["variants"]) == ["bf16", "fp8_align", "vllm_fp8"]
    runs = {name: (r["visible"], tuple(r["run"]["gpu_index"]), r["run"]["gpu_uuid"]) for name, r in written["variants"].items()}
    assert set(runs.values()) <= {("0,1", (0, 1), "GPU-0,GPU-1"), ("2,3", (2, 3), "GPU-2,GPU-3")}
    assert runs["bf16"] != runs["fp8_align"] and written["variants_on_one_gpu"] is False
    assert [spec["tensor_parallel_size"] for spec in specs] == [2, 2, 2]
    for spec in specs:
        kwargs = runner.llm_kwargs(spec)
        assert (kwargs["tensor_parallel_size"], kwargs["distributed_executor_backend"]) == (2, "mp")

    specs = _fake_host(monkeypatch, 2)
    assert _call(tmp_path, "x2", "bf16,fp8_align", "--tensor-parallel-size", "2") == 0
    written = json.loads((tmp_path / "x2" / "out" / TP2_REPORT).read_text())
    assert {r["visible"] for r in written["variants"].values()} == {"0,1"} and written["variants_on_one_gpu"] is True
    assert [spec["tensor_parallel_size"] for spec in specs] == [2, 2]


def test_tensor_parallel_size_one_keeps_the_engine_arguments(tmp_path: Path) -> None:
    """TP 1 (the default): no tensor-parallel arguments reach vLLM, and the report keeps its name."""
    shapes = runner.make_shapes(["short"], {"short": 1}, 1000)
    settings = {"model_runner": None, "gpu_memory_utilization": 0.85, "max_num_seqs": None, "tensor_parallel_size": 1}
    kwargs = runner.llm_kwargs(runner.variant_spec("bf16", "qwen3-8b", tmp_path, tmp_path, shapes, settings))
    assert "tensor_parallel_size" not in kwargs and "distributed_executor_backend" not in kwargs
    assert report.results_name("qwen3-8b", ["short"], settings) == "rollout_throughput_short.json"


def test_tensor_parallel_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Before any engine starts: a --gpus that the tensor-parallel size does not divide, the bitwise
    variants at TP 4 (their engine refuses more than 2 ranks), more GPUs than the host has."""
    specs = _fake_host(monkeypatch, 4)
    for extra, message in ((("--gpus", "3"), "--gpus 3 with --tensor-parallel-size 2"), (("--gpus", "8"), "--gpus 8: 4 GPU(s)")):
        with pytest.raises(SystemExit):
            _call(tmp_path, "a", "bf16", "--tensor-parallel-size", "2", *extra)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _call(tmp_path, "a", "bf16,fp8_align_bitwise,fp8_align_bitwise_kv", "--tensor-parallel-size", "4")
    assert "fp8_align_bitwise, fp8_align_bitwise_kv run FP8Config(on_policy='bitwise')" in capsys.readouterr().err
    assert specs == [] and runner.refused_at(1, list(runner.VARIANTS)) == runner.refused_at(2, list(runner.VARIANTS)) == []


def test_merge_refuses_another_tensor_parallel_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TP=2 report does not take a TP=1 variant (nor the reverse: the sizes are engine settings)."""
    _fake_host(monkeypatch, 2)
    assert _call(tmp_path, "a", "bf16", "--tensor-parallel-size", "2") == 0
    specs = _fake_host(monkeypatch, 2)
    with pytest.raises(SystemExit):
        _call(tmp_path, "b", "fp8_align", "--merge", str(tmp_path / "a" / "out" / TP2_REPORT))
    err = capsys.readouterr().err
    assert specs == [] and "engine_settings:" in err and "'tensor_parallel_size': 2" in err


def test_deepgemm_warmup_of_tensor_parallel_ranks() -> None:
    """The DeepGEMM warm-up seconds of an engine: summed per process, the longest rank's where
    ranks warm up side by side (one process, or no prefix: the sum)."""
    line = "{}INFO 11-28 [gpu.py:201] fp8_align: DeepGEMM warm-up N=6144 K=4096: 438 M values in {} s (cache)"
    ranks = [line.format("(Worker_TP0 pid=11) ", 1.5), line.format("(Worker_TP1 pid=12) ", 2.0), line.format("(Worker_TP0 pid=11) ", 1.0)]
    assert runner.read_engine_log("\n".join(ranks))["fp8_align_deepgemm_warmup_s"] == 2.5
    assert runner.read_engine_log("\n".join([line.format("", 1.5), line.format("", 2.0)]))["fp8_align_deepgemm_warmup_s"] == 3.5
    assert runner.read_engine_log("")["fp8_align_deepgemm_warmup_s"] is None
