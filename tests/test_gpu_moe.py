"""MoE in block FP8 on CUDA (vLLM 0.22, Hopper): fp8_align's expert codes on vLLM's Triton MoE kernel.

Real parts: an in-process `vllm.LLM` (CUDA graphs on) from a small random Qwen3-MoE W1 (hidden 256,
8 experts of intermediate 128, top-2; layer 0 BF16 by the config). Checked:

- the experts run `Fp8AlignMoEMethod` on vLLM's TRITON block-FP8 MoE backend, routers BF16, and
  VLLM_USE_DEEP_GEMM_E8M0 in the worker equals the configured activation rounding (FP32: "0");
- codes and scales read back from the worker equal `quantize_weight_blockwise` of every
  per-expert checkpoint tensor, bit for bit;
- one MoE layer's forward (vLLM's kernel, its own activation quantization) against
  `block_fp8_moe_reference` on the same codes, within a tolerance derived in the test;
- `refit_weights` with W2 as CUDA tensors rewrites the experts in place (pointers unchanged,
  so captured graphs stay valid) to the W2 recipe, and the OpenRLHF-style `load_weights` path
  with transformers-5 fused expert tensors brings W1 back.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import FIRST_LAYER_BF16
from tests.gpu_models import IN_PROCESS_LLM_KWARGS
from tests.gpu_moe_checks import assert_experts_hold, assert_within_moe_tolerance, checkpoint_weights, expert_state, layer_vs_reference

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

#: moe_backend "triton": vLLM 0.22 would pick FlashInfer CUTLASS for the BF16 experts of layer 0,
#: which JIT-compiles and hung the engine's profile run on the box (no nvcc).
LLM_KWARGS = {**IN_PROCESS_LLM_KWARGS, "moe_backend": "triton"}
NUM_EXPERTS, INTER, HIDDEN, NUM_LAYERS = 8, 128, 256, 3


@pytest.fixture(scope="module")
def llm(qwen3_moe_models: dict[str, Path], vllm_runner: Any) -> Any:
    with vllm_runner(qwen3_moe_models["w1"], FIRST_LAYER_BF16, **LLM_KWARGS) as runner:
        yield runner.llm


def _assert_experts_hold(state: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    assert len(state["layers"]) == NUM_LAYERS - 1
    assert_experts_hold(state, weights, NUM_EXPERTS, INTER, HIDDEN)


def test_experts_run_fp8_on_vllm_triton_moe(llm: Any, qwen3_moe_models: dict[str, Path]) -> None:
    [state] = llm.apply_model(expert_state)
    assert {e["method"] for e in state["layers"].values()} == {"Fp8AlignMoEMethod"}
    assert {e["kernel"] for e in state["layers"].values()} == {"vllm_triton"}
    assert set(state["routers"].values()) == {"Fp8AlignBf16LinearMethod"}
    assert state["e8m0"] == "0"
    _assert_experts_hold(state, checkpoint_weights(qwen3_moe_models["w1"]))


def test_moe_layer_matches_the_reference(llm: Any) -> None:
    """64 tokens, top-2, on vLLM's Triton kernel; tolerance: `assert_within_moe_tolerance`."""
    [result] = llm.apply_model(functools.partial(layer_vs_reference, tokens=64, top_k=2))
    print("moe layer vs reference:", result)
    assert_within_moe_tolerance(result)


def test_refit_and_fused_sync_rewrite_experts_in_place(llm: Any, qwen3_moe_models: dict[str, Path], tmp_path: Path) -> None:
    from fp8_align.vllm_plugin.refit import refit_weights

    [before] = llm.apply_model(expert_state)
    w2 = checkpoint_weights(qwen3_moe_models["w2"], "cuda")
    refit_weights(llm, w2)
    [after] = llm.apply_model(expert_state)
    _assert_experts_hold(after, checkpoint_weights(qwen3_moe_models["w2"]))
    assert {n: e["pointers"] for n, e in after["layers"].items()} == {n: e["pointers"] for n, e in before["layers"].items()}
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=[5, 17, 99, 230])], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 8
    w1 = checkpoint_weights(qwen3_moe_models["w1"])
    fused = []
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = torch.stack([torch.cat([w1[f"{p}.{e}.gate_proj.weight"], w1[f"{p}.{e}.up_proj.weight"]]) for e in range(NUM_EXPERTS)])
        down = torch.stack([w1[f"{p}.{e}.down_proj.weight"] for e in range(NUM_EXPERTS)])
        fused += [(f"{p}.gate_up_proj", gate_up), (f"{p}.down_proj", down)]
    from safetensors.torch import save_file

    save_file(dict(fused), str(tmp_path / "fused.safetensors"))
    llm.collective_rpc(_load_fused, args=(str(tmp_path / "fused.safetensors"),))
    [synced] = llm.apply_model(expert_state)
    _assert_experts_hold(synced, w1)
    assert {n: e["pointers"] for n, e in synced["layers"].items()} == {n: e["pointers"] for n, e in before["layers"].items()}


def _load_fused(worker: Any, path: str) -> None:
    """Worker side: the stacks' call, `model.load_weights(list_of_pairs)` with CUDA tensors, one
    call (verl's shape). Tensors travel as a file: collective_rpc arguments lose tensor data."""
    from safetensors.torch import load_file

    worker.model_runner.model.load_weights(weights=list(load_file(path, device="cuda").items()))
