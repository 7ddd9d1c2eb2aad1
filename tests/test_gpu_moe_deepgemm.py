"""Routed experts on DeepGEMM's grouped GEMM (vLLM 0.22, Hopper): fp8_align's codes read in place.

Real parts: an in-process `vllm.LLM` (CUDA graphs on, `moe_backend="deep_gemm"`) from a small random
Qwen3-MoE (hidden 256, 8 experts of intermediate 768, top-2, every layer FP8; intermediate 768 so
that vLLM's `TritonOrDeepGemmExperts` runs DeepGEMM, which it does only for N > 512 and M >= 128).
vLLM's own DeepGEMM kernels (bundled with vLLM, compiled by NVRTC on first use) run the experts.
Checked:

- the experts' backend is vLLM's DEEPGEMM, VLLM_USE_DEEP_GEMM_E8M0 is "0" (FP32 scales), and the
  weight scales vLLM's kernel was built with are fp8_align's scale Parameters (same pointers);
- codes and scales equal `quantize_weight_blockwise` of every expert tensor, bit for bit;
- a 256-token batch goes to `DeepGemmExperts` and matches `block_fp8_moe_reference` within the
  MoE tolerance of tests/gpu_moe_checks.py;
- after `refit_weights` to W2 (in place, pointers unchanged) the same batch matches the reference
  on W2's codes: DeepGEMM computes with what the refit wrote, not a copy made at load.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from fp8_align.config import FP8Config
from tests.gpu_models import IN_PROCESS_LLM_KWARGS
from tests.gpu_moe_checks import assert_experts_hold, assert_within_moe_tolerance, checkpoint_weights, expert_state, layer_vs_reference

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

NUM_EXPERTS, INTER, HIDDEN, NUM_LAYERS = 8, 768, 256, 3
#: fp8_align's linears on CUTLASS (no DeepGEMM JIT for them): this module is about the experts.
FP8_CONFIG = FP8Config(use_deep_gemm=False)
#: Tokens of the batch the layer checks run: >= 128 so vLLM picks DeepGEMM over its Triton fallback.
TOKENS = 256
#: max_num_batched_tokens sizes vLLM's MoE workspace, which is locked after start: TOKENS must fit.
LLM_KWARGS = {**IN_PROCESS_LLM_KWARGS, "max_num_batched_tokens": TOKENS, "moe_backend": "deep_gemm"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.model_factory import make_tiny_qwen3_moe

    return {name: make_tiny_qwen3_moe(tmp_path_factory.mktemp(f"moe_dg_{name}"), seed=seed, moe_intermediate_size=INTER)
            for name, seed in (("w1", 0), ("w2", 1))}  # fmt: skip


@pytest.fixture(scope="module")
def llm(checkpoints: dict[str, Path], vllm_runner: Any) -> Any:
    with vllm_runner(checkpoints["w1"], FP8_CONFIG, **LLM_KWARGS) as runner:
        yield runner.llm


def test_experts_run_on_deepgemm_with_fp8_align_codes(llm: Any, checkpoints: dict[str, Path]) -> None:
    [state] = llm.apply_model(expert_state)
    assert len(state["layers"]) == NUM_LAYERS
    assert {e["kernel"] for e in state["layers"].values()} == {"vllm_deepgemm"}
    assert {e["experts_impl"] for e in state["layers"].values()} == {"TritonOrDeepGemmExperts"}
    assert state["e8m0"] == "0"
    for entry in state["layers"].values():
        assert entry["kernel_scale_pointers"] == entry["pointers"][2:]
    assert_experts_hold(state, checkpoint_weights(checkpoints["w1"]), NUM_EXPERTS, INTER, HIDDEN)


def test_deepgemm_layer_matches_the_reference(llm: Any) -> None:
    [result] = llm.apply_model(functools.partial(layer_vs_reference, tokens=TOKENS, top_k=2))
    print("deepgemm moe layer vs reference:", result)
    assert result["experts_impl"] == "DeepGemmExperts"
    assert_within_moe_tolerance(result)


def test_refit_is_what_deepgemm_computes_with(llm: Any, checkpoints: dict[str, Path]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align.vllm_plugin.refit import refit_weights

    [before] = llm.apply_model(expert_state)
    refit_weights(llm, checkpoint_weights(checkpoints["w2"], "cuda"))
    [after] = llm.apply_model(expert_state)
    assert_experts_hold(after, checkpoint_weights(checkpoints["w2"]), NUM_EXPERTS, INTER, HIDDEN)
    assert {n: e["pointers"] for n, e in after["layers"].items()} == {n: e["pointers"] for n, e in before["layers"].items()}
    [result] = llm.apply_model(functools.partial(layer_vs_reference, tokens=TOKENS, top_k=2))
    print("deepgemm moe layer vs reference after refit:", result)
    assert result["experts_impl"] == "DeepGemmExperts"
    assert_within_moe_tolerance(result)
    out = llm.generate([TokensPrompt(prompt_token_ids=[5, 17, 99, 230])], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 8
