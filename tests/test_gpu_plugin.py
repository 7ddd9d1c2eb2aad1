"""End to end on CUDA with vLLM 0.22: `LLM(bf16 checkpoint, quantization="fp8_align")`.

A small random Qwen3-shaped model (hidden 1024, 4 layers, head_dim 128) is saved once; engines
run in subprocesses (`fp8_align.error_bench.generate`). Checked: the FP8 codes and scales read back
from the worker equal `fp8_align.quant` bit for bit (FP32 scales and power-of-two scales),
configured layers stay BF16, generation works, and sampled-token logprobs agree with an HF
forward that runs the same FP8 (`apply_fp8_emulation`) about as well as BF16 vLLM agrees with
BF16 HF (the measured baseline).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8_align.config import FP8Config
from tests.engines import MERGED_SHARDS
from tests.gpu_models import (
    LLM_KWARGS, SMALL, expected_codes, hf_logprobs_of, is_pow2, mean_logprob_distance, save_random_qwen3, vllm_logprobs,
)  # fmt: skip

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

#: gate|up shards of 1000 rows (not a multiple of 128) and down_proj K=1000 (partial K block).
ODD = {**SMALL, "intermediate_size": 1000}
PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 24, 24
#: name -> (model, FP8Config fields or None for BF16)
ENGINES: dict[str, tuple[str, dict[str, Any] | None]] = {
    "bf16": ("small", None),
    "fp8_fp32_scales": ("small", {"num_first_layers_in_bf16": 1}),
    "fp8_pow2_scales": ("small", {"num_last_layers_in_bf16": 1, "use_weight_pow2_scale": True, "use_activation_pow2_scale": True}),
    "fp8_odd_shapes": ("odd", {}),
}
#: Expected backend per projection on an H100 (the odd model's MLP leaves the uniform grid).
EXPECTED_KERNELS = {
    "small": dict.fromkeys(MERGED_SHARDS, "deepgemm"),
    "odd": {**dict.fromkeys(MERGED_SHARDS, "deepgemm"), "mlp.gate_up_proj": "triton_per_shard", "mlp.down_proj": "triton"},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random-init BF16 checkpoints (seed 0)."""
    return {
        name: save_random_qwen3(tmp_path_factory.mktemp(f"qwen3_{name}"), fields, seed=0)
        for name, fields in (("small", SMALL), ("odd", ODD))
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, SMALL["vocab_size"], (PROMPTS, PROMPT_LEN), generator=g).tolist()


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`engine(name)`: the output of one vLLM engine run (cached per module)."""
    from fp8_align.error_bench.generate import run_generation

    out_dir = tmp_path_factory.mktemp("engines")

    @functools.cache
    def run(name: str) -> dict[str, Any]:
        model, fp8_fields = ENGINES[name]
        spec = {
            "model": str(models[model]), "fp8_config": fp8_fields, "prompts": prompts, "max_tokens": NEW_TOKENS,
            "temperature": 0.0, "logprobs": 0, "inspect": True, "llm_kwargs": LLM_KWARGS,
        }  # fmt: skip
        return run_generation(spec, out_dir / f"{name}.pt", timeout_s=600)

    return run


@pytest.mark.parametrize("name", ["fp8_fp32_scales", "fp8_pow2_scales", "fp8_odd_shapes"])
def test_worker_weights_are_fp8_align_codes(engine: Any, models: dict[str, Path], name: str) -> None:
    model, fields = ENGINES[name]
    cfg = FP8Config.from_kwargs(**fields)
    layers = engine(name)["layers"]
    bf16_layers = cfg.bf16_layer_indices(SMALL["num_hidden_layers"])
    seen_scales = []
    for index in range(SMALL["num_hidden_layers"]):
        for projection in MERGED_SHARDS:
            state = layers[f"model.layers.{index}.{projection}"]
            if index in bf16_layers:
                assert state["method"] == "Fp8AlignBf16LinearMethod", (index, projection)
                continue
            assert state["method"] == "Fp8AlignLinearMethod", (index, projection)
            assert state["kernel"] == EXPECTED_KERNELS[model][projection], (index, projection)
            codes, scales = expected_codes(models[model], index, projection, cfg.use_weight_pow2_scale)
            assert state["weight"].dtype == torch.float8_e4m3fn and state["weight_scale_inv"].dtype == torch.float32
            assert torch.equal(state["weight"].view(torch.uint8), codes.view(torch.uint8)), (index, projection)
            assert torch.equal(state["weight_scale_inv"].view(torch.int32), scales.view(torch.int32)), (index, projection)
            seen_scales.append(state["weight_scale_inv"].flatten())
    all_scales = torch.cat(seen_scales)
    pow2_fraction = is_pow2(all_scales).float().mean().item()
    if cfg.use_weight_pow2_scale:
        assert pow2_fraction == 1.0
    else:
        assert pow2_fraction < 0.01, f"{pow2_fraction:.2%} of FP32 scales are powers of two: were they rounded?"


@pytest.mark.parametrize("name", list(ENGINES))
def test_generation_works(engine: Any, name: str) -> None:
    result = engine(name)
    assert result["vllm_version"].startswith("0.22")
    assert len(result["outputs"]) == PROMPTS
    for out in result["outputs"]:
        assert len(out["token_ids"]) == NEW_TOKENS
        assert all(-1e9 < lp <= 0 for lp in out["logprobs"])
    print(f"\n{name}: engine start {result['engine_start_s']:.1f} s, generate {result['generate_s']:.2f} s")


@pytest.mark.parametrize("name", ["fp8_fp32_scales", "fp8_pow2_scales"])
def test_logprobs_match_hf_fp8_emulation(engine: Any, models: dict[str, Path], name: str) -> None:
    """Aligned FP8 (vLLM vs HF with the same FP8) agrees about as well as BF16 vLLM vs BF16 HF.

    Baseline: BF16 vLLM vs BF16 HF differ by kernel rounding (attention, GEMM order, fused
    norms). With FP8 the same upstream difference δ (bf16-ulp sized, ~2^-8 relative) can flip
    an E4M3 code (step Δ ~ 2^-3 relative) with probability ~δ/Δ, giving an error variance δΔ
    instead of δ²: an rms amplification of sqrt(Δ/δ) = sqrt(32) < 6 per quantized input. So we
    require mean|Δlogprob| <= 8 x the BF16 baseline, and strictly less mismatch than the
    unaligned pair (FP8 vLLM vs BF16 HF). On a random-init model the FP8 quantization effect
    itself is small (near-uniform logits), so the second margin is modest; both are printed.
    """
    baseline_result = engine("bf16")
    baseline_hf = hf_logprobs_of(models["small"], None, baseline_result)
    baseline = mean_logprob_distance("bf16 vLLM vs bf16 HF", vllm_logprobs(baseline_result), baseline_hf)
    result = engine(name)
    fields = ENGINES[name][1]
    vllm_lp = vllm_logprobs(result)
    aligned = mean_logprob_distance(f"{name}: vLLM vs HF fp8 emulation", vllm_lp, hf_logprobs_of(models["small"], fields, result))
    unaligned = mean_logprob_distance(f"{name}: vLLM vs HF bf16", vllm_lp, hf_logprobs_of(models["small"], None, result))
    assert aligned <= 8 * baseline
    assert aligned < unaligned


def test_odd_shapes_logprobs_match_hf_fp8_emulation(engine: Any, models: dict[str, Path]) -> None:
    result = engine("fp8_odd_shapes")
    vllm_lp = vllm_logprobs(result)
    aligned = mean_logprob_distance("odd shapes: vLLM vs HF fp8 emulation", vllm_lp, hf_logprobs_of(models["odd"], {}, result))
    unaligned = mean_logprob_distance("odd shapes: vLLM vs HF bf16", vllm_lp, hf_logprobs_of(models["odd"], None, result))
    assert aligned < unaligned


def test_engine_log_names_kernel_per_layer(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The engine log has one INFO line per FP8 layer naming its backend and the passed ones."""
    engine("fp8_odd_shapes")
    log = next(Path(tmp_path_factory.getbasetemp()).glob("engines*/fp8_odd_shapes.log")).read_text()
    lines = re.findall(r"fp8_align: model\.layers\.\d+\.\S+ \[N=\d+ K=\d+ shards=\[[\d, ]+\]\] -> (\w+) \(passed: (.*)\)", log)
    assert len(lines) == SMALL["num_hidden_layers"] * len(MERGED_SHARDS)
    assert {kernel for kernel, _ in lines} == {"deepgemm", "triton", "triton_per_shard"}
    assert all("deepgemm:" in passed for kernel, passed in lines if kernel != "deepgemm")


def test_engine_log_has_one_plan_line(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One INFO line sums the engine up (`vllm_plugin.engine_plan`): its GEMM backends, DeepGEMM with
    its JIT-cache state and the others with why DeepGEMM was passed, and its decode kernel: a BF16
    KV cache here, so FLASH_ATTN's own, with the reason."""
    engine("fp8_odd_shapes")
    log = next(Path(tmp_path_factory.getbasetemp()).glob("engines*/fp8_odd_shapes.log")).read_text()
    plans = re.findall(r"fp8_align: engine plan: (.*)", log)
    assert len(plans) == 1, plans
    gemm, _, decode = plans[0].partition("; decode ")
    assert re.search(r"deepgemm x\d+ \((JIT cache .* shapes prepared ahead|no warm-up ran)", gemm), gemm
    assert re.search(r"triton x\d+ \(not deepgemm: ", gemm) and re.search(r"triton_per_shard x\d+ \(not deepgemm: ", gemm), gemm
    assert decode.startswith("FLASH_ATTN (kv_decode_kernel='auto': the KV cache is not FP8"), decode
