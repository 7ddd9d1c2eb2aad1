"""MLA + MoE in block FP8 on CUDA (vLLM 0.22 or 0.25.1, Hopper): a tiny Moonlight-shaped DeepSeek-V3.

The model of tests/test_mla_engine.py (2 layers: dense layer 0, MoE layer 1 with 8 routed experts
of 128 and a shared expert; MLA without q LoRA, kv_lora_rank 512 + rope 64) with Moonlight's head
dims (`MOONLIGHT_HEAD_DIMS`), saved once; engines
run in subprocesses (`fp8_align.error_bench.generate`) with vLLM's TRITON_MLA attention (any head
count; FlashMLA's kernels want more heads than this model has) and Triton routed experts
(vLLM 0.22 would pick FlashInfer CUTLASS for the BF16 engine's experts, a JIT-compiled module).
Checked:

- q_proj, kv_a_proj_with_mqa (576 rows: 4.5 blocks), kv_b_proj and o_proj of both layers hold
  `quantize_weight_blockwise` of their checkpoint tensors, bit for bit; the shared expert and the
  dense MLP are FP8 linears, the router is not;
- the routed experts run `Fp8AlignMoEMethod` on vLLM's Triton kernel with every expert's codes
  and scales equal to the reference;
- sampled-token logprobs against an HF forward running the same FP8 (`apply_fp8_emulation`):
  within 8x the BF16 engine's distance to BF16 HF and closer than to BF16 HF (the criterion of
  tests/test_gpu_plugin.py, whose docstring derives the 8x).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu_models import LLM_KWARGS, hf_logprobs_of, mean_logprob_distance, vllm_logprobs
from tests.gpu_moe_checks import assert_experts_hold, checkpoint_weights
from tests.mla_checks import assert_mla_projections_hold

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MLA_LLM_KWARGS = {**LLM_KWARGS, "attention_backend": "TRITON_MLA", "moe_backend": "triton"}
NUM_EXPERTS, INTER, HIDDEN, VOCAB = 8, 128, 256, 512
PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 24, 24
#: name -> FP8Config fields (None: BF16 engine)
ENGINES: dict[str, dict[str, Any] | None] = {"bf16": None, "fp8": {}}
#: Moonlight's per-head dims (query/key 128 + 64 rope = 192, value 128). The CPU model's 64 + 64 and 64
#: do not run on CUDA: vLLM's FlashAttention MLA prefill takes differing Q/K and V head dims only
#: for Q/K in (128, 192] and V in (96, 128] (the engine failed at its first prefill, vLLM 0.25.1, H200).
MOONLIGHT_HEAD_DIMS = {"qk_nope_head_dim": 128, "v_head_dim": 128}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model_factory import make_tiny_moonlight

    return make_tiny_moonlight(tmp_path_factory.mktemp("moonlight") / "w1", seed=0, **MOONLIGHT_HEAD_DIMS)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`engine(name)`: one engine run's output (cached per module)."""
    from fp8_align.error_bench.generate import run_generation

    out_dir = tmp_path_factory.mktemp("mla_engines")
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, VOCAB, (PROMPTS, PROMPT_LEN), generator=g).tolist()

    @functools.cache
    def run(name: str) -> dict[str, Any]:
        spec = {
            "model": str(model_dir), "fp8_config": ENGINES[name], "prompts": prompts, "max_tokens": NEW_TOKENS,
            "temperature": 0.0, "logprobs": 0, "inspect": True, "llm_kwargs": MLA_LLM_KWARGS,
        }  # fmt: skip
        return run_generation(spec, out_dir / f"{name}.pt", timeout_s=600)

    return run


def test_mla_projections_experts_and_shared_expert_hold_the_recipe(engine: Any, model_dir: Path) -> None:
    result = engine("fp8")
    weights = checkpoint_weights(model_dir)
    layers = result["layers"]
    assert_mla_projections_hold(layers, weights, num_layers=2)
    assert layers["model.layers.1.mlp.shared_experts.gate_up_proj"]["method"] == "Fp8AlignLinearMethod"
    assert layers["model.layers.0.mlp.gate_up_proj"]["method"] == "Fp8AlignLinearMethod"
    assert not any(name.endswith("mlp.gate") and entry["method"] == "Fp8AlignLinearMethod" for name, entry in layers.items())
    [(name, experts)] = result["experts"].items()
    assert (experts["method"], experts["kernel"]) == ("Fp8AlignMoEMethod", "vllm_triton")
    state = {"layers": {name: {key: experts[key].view(torch.uint8) if key in ("w13", "w2") else experts[key]
                               for key in ("w13", "w2", "w13_scale_inv", "w2_scale_inv")}}}  # fmt: skip
    assert_experts_hold(state, weights, NUM_EXPERTS, INTER, HIDDEN)


def test_mla_logprobs_match_hf_fp8_emulation(engine: Any, model_dir: Path) -> None:
    baseline_result = engine("bf16")
    baseline = mean_logprob_distance("bf16 vLLM vs bf16 HF", vllm_logprobs(baseline_result), hf_logprobs_of(model_dir, None, baseline_result))
    result = engine("fp8")
    assert all(len(out["token_ids"]) == NEW_TOKENS for out in result["outputs"])
    vllm_lp = vllm_logprobs(result)
    aligned = mean_logprob_distance("fp8: vLLM vs HF fp8 emulation", vllm_lp, hf_logprobs_of(model_dir, ENGINES["fp8"], result))
    unaligned = mean_logprob_distance("fp8: vLLM vs HF bf16", vllm_lp, hf_logprobs_of(model_dir, None, result))
    assert aligned <= 8 * baseline
    assert aligned < unaligned
