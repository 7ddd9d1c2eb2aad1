"""Tensor parallel (2 GPUs, vLLM 0.22): the plugin and a non-default config reach every worker.

Runs where at least two CUDA GPUs are visible (the nvidia-h200-x2 box); skipped elsewhere. The
small random Qwen3 of the GPU tests, tests/gpu_models.py (16 query / 8 KV heads of 128, intermediate 3072, so
every per-rank shard is a multiple of 128 rows or columns) runs with tensor_parallel_size=2 under
the multiprocessing executor and under Ray (when `ray` imports), with layer 0 in BF16 and
power-of-two weight and activation scales, carried by `engine_kwargs`. Checked in each rank's
worker: layer 0 is BF16; every other projection holds exactly `fp8_align.quant` of that rank's
slice of the HF weight (column-parallel q/k/v and gate/up: each projection's rows split in two,
stacked per rank; row-parallel o/down: the input columns split in two), bit for bit; all scales
are powers of two; generation works and its sampled-token logprobs agree with the HF FP8
emulation as well as the single-GPU test requires. Also `refit_weights` into a TP=2 engine
(eager): each rank's codes and scales equal the reference of its slice of the new weights.

Run with `--basetemp DIR` to keep the engine logs (next to each run's output). The same layout
on CPU: tests/test_vllm_plugin_tp.py. Runs so far: benchmarks/results_log.md.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8_align.config import FP8Config
from tests.gpu_models import LLM_KWARGS, SMALL, hf_logprobs, is_pow2, save_random_qwen3, vllm_logprobs
from tests.tp_slices import PROJECTIONS, assert_ranks_hold, expected_rank_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (tensor parallel size 2)"),
]

TP = 2
FIELDS = {"num_first_layers_in_bf16": 1, "use_weight_pow2_scale": True, "use_activation_pow2_scale": True}
BACKENDS = ["mp", pytest.param("ray", marks=pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed"))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_qwen3(tmp_path_factory.mktemp("qwen3_tp"), SMALL, seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, SMALL["vocab_size"], (8, 24), generator=g).tolist()


@pytest.fixture(scope="module")
def tp_engine(model_dir: Path, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`tp_engine(backend)`: output of one TP=2 fp8_align engine run, once per backend per module:
    a failed run is remembered and re-raised too, so a broken engine costs one start, not one per test."""
    from fp8_align.error_bench.generate import GenerationError, run_generation

    out_dir = tmp_path_factory.mktemp("tp_engines")
    outcomes: dict[str, dict[str, Any] | GenerationError] = {}

    def run(backend: str) -> dict[str, Any]:
        if backend not in outcomes:
            spec = {
                "model": str(model_dir), "fp8_config": FIELDS, "prompts": prompts, "max_tokens": 24, "temperature": 0.0,
                "logprobs": 0, "inspect": True,
                "llm_kwargs": {**LLM_KWARGS, "tensor_parallel_size": TP, "distributed_executor_backend": backend},
            }  # fmt: skip
            try:
                outcomes[backend] = run_generation(spec, out_dir / f"tp_{backend}.pt", timeout_s=900)
            except GenerationError as exc:
                outcomes[backend] = exc
        outcome = outcomes[backend]
        if isinstance(outcome, GenerationError):
            raise outcome
        return outcome

    return run


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_rank_holds_its_fp8_slice(tp_engine: Any, model_dir: Path, backend: str) -> None:
    from safetensors.torch import load_file

    weights = {name: t for file in sorted(model_dir.glob("*.safetensors")) for name, t in load_file(file).items()}
    result = tp_engine(backend)
    ranks = result["layers_by_worker"]
    assert len(ranks) == TP
    bf16_layers = FP8Config.from_kwargs(**FIELDS).bf16_layer_indices(SMALL["num_hidden_layers"])
    assert bf16_layers == {0}
    for rank, layers in enumerate(ranks):
        scales_seen = []
        for index in range(SMALL["num_hidden_layers"]):
            for projection in PROJECTIONS:
                state = layers[f"model.layers.{index}.{projection}"]
                if index in bf16_layers:
                    assert state["method"] == "Fp8AlignBf16LinearMethod", (rank, index, projection)
                    continue
                assert state["method"] == "Fp8AlignLinearMethod", (rank, index, projection)
                codes, scales = expected_rank_fp8(weights, index, projection, rank, TP, pow2=True)
                assert state["weight"].shape == codes.shape, (rank, index, projection)
                assert torch.equal(state["weight"].view(torch.uint8), codes.view(torch.uint8)), (rank, index, projection)
                assert torch.equal(state["weight_scale_inv"].view(torch.int32), scales.view(torch.int32)), (rank, index, projection)
                scales_seen.append(state["weight_scale_inv"].flatten())
        assert bool(is_pow2(torch.cat(scales_seen)).all()), f"rank {rank}: weight scales not all powers of two"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp_logprobs_match_hf_fp8_emulation(tp_engine: Any, model_dir: Path, backend: str) -> None:
    """TP=2 FP8 vLLM vs HF with the same FP8 recipe: closer than vs HF BF16 (as on one GPU).

    TP changes only the order of the row-parallel sums (an all-reduce of two partial products),
    a bf16-rounding-sized difference, so the single-GPU criterion applies unchanged.
    """
    result = tp_engine(backend)
    assert all(len(out["token_ids"]) == 24 for out in result["outputs"])
    completions = tuple((tuple(o["prompt_ids"]), tuple(o["token_ids"])) for o in result["outputs"])
    vllm_lp = vllm_logprobs(result)
    aligned = (vllm_lp - hf_logprobs(str(model_dir), json.dumps(FIELDS, sort_keys=True), completions)).abs().mean().item()
    unaligned = (vllm_lp - hf_logprobs(str(model_dir), None, completions)).abs().mean().item()
    print(f"\nTP={TP} {backend}: mean |dlogprob| vs HF fp8 emulation {aligned:.3e}, vs HF bf16 {unaligned:.3e}")
    assert aligned < unaligned


def test_refit_under_tensor_parallel_requantizes_each_rank_slice(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, vllm_runner: Any
) -> None:
    """`refit_weights(llm, W2 checkpoint)` into a TP=2 engine (multiprocessing executor, eager): the
    FP8 layers go through vLLM's layerwise reload, whose loaders cut each rank's slice, then
    fp8_align's processing; every rank then holds exactly `fp8_align.quant` of its slice of W2,
    and the engine generates. (Token equality with a fresh engine is checked on CPU,
    tests/test_vllm_plugin_tp.py: on this random GPU model engines do not repeat each other.)"""
    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align.vllm_plugin.inspection import read_linear_layers
    from fp8_align.vllm_plugin.refit import refit_weights

    w2_dir = save_random_qwen3(tmp_path_factory.mktemp("qwen3_tp_w2"), SMALL, seed=1)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(w2_dir.glob("*.safetensors")):
        weights.update(load_file(file))
    with vllm_runner(
        model_dir, FIELDS, enforce_eager=True, **{**LLM_KWARGS, "tensor_parallel_size": TP, "distributed_executor_backend": "mp"},
    ) as runner:  # fmt: skip
        llm = runner.llm
        results = refit_weights(llm, w2_dir)
        assert len(results) == TP and all(r.fp8_tensors == 0 and r.reloaded_tensors == len(weights) for r in results)
        assert_ranks_hold(read_linear_layers(llm), weights, range(1, SMALL["num_hidden_layers"]), pow2=True)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 124)))], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 8
