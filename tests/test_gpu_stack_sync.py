"""The RL stacks' own weight sync, their real code, into an fp8_align engine on CUDA (vLLM 0.22).

One in-process `vllm.LLM` (CUDA graphs on) from a random Qwen3-shaped BF16 checkpoint W1, layer 0
BF16, with OpenRLHF's and verl's worker extensions mixed in (tests/gpu_stack_workers.py). The
trainer side is this test process, as in a colocated RL job:

- OpenRLHF 0.11.2: the trainer's `_handle_cuda_ipc` (openrlhf/trainer/ray/ppo_actor.py:437-463)
  clones each parameter, shares it with `reduce_tensor` keyed by `get_physical_gpu_id()`, and
  calls the engine's `collective_rpc("update_weight_cuda_ipc", args=(name, dtype, shape,
  ipc_handles, empty_cache))` (vllm_engine.py:121-125), one tensor per call; the worker side is
  OpenRLHF's own `WorkerWrap.update_weight_cuda_ipc` (vllm_worker_wrap.py:52-70).
- verl 0.9.1: the trainer's `BucketedWeightSender.async_send_weights` (CUDA-IPC buckets over
  ZMQ) against the worker's own `vLLMColocateWorkerExtension.update_weights_from_ipc`, which
  loads each bucket with `model.load_weights` and then runs vLLM's
  `process_weights_after_loading` over the model.

After each sync every FP8 layer's codes and scales equal the torch reference quantization of the
new weights, in the same storage, and the engine generates. Each test stands alone: it first puts
its starting weights into the engine with `refit_weights` (`tests.gpu_models.start_from`). As in tests/test_gpu_refit.py,
equality with a fresh engine is asserted through the weights (two fresh engines do not
reproduce each other's greedy tokens on this random model on the GPU box).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import FIRST_LAYER_BF16, generate_greedy
from tests.gpu_models import (
    IN_PROCESS_LLM_KWARGS, NEW_TOKENS, assert_codes_equal, assert_same_storage, cuda_weights, fp8_state,
    refit_prompts, start_from,
)  # fmt: skip

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="OpenRLHF's worker module imports ray: run on the vLLM bundle with Ray (FP8_ALIGN_GPUKIT=.gpukit_ray)",
    ),
]

VERL_JOB_ID = f"fp8align{os.getpid()}"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return refit_prompts()


@pytest.fixture(scope="module")
def llm(refit_models: dict[str, Path], vllm_runner: Any) -> Any:
    with vllm_runner(
        refit_models["w1"], FIRST_LAYER_BF16, **IN_PROCESS_LLM_KWARGS,
        worker_extension_cls="tests.gpu_stack_workers.OpenRLHFAndVerlWorkerExtension",
        env={"VERL_RAY_JOB_ID": VERL_JOB_ID},  # names verl's ZMQ socket; the workers inherit it
    ) as runner:  # fmt: skip
        yield runner.llm


def _openrlhf_push(llm: Any, name: str, param: torch.Tensor, last: bool) -> None:
    """OpenRLHF's trainer side of one tensor (ppo_actor.py:437-463) and its engine call (vllm_engine.py:121)."""
    from openrlhf.trainer.ray.utils import get_physical_gpu_id
    from torch.multiprocessing.reductions import reduce_tensor

    weight = param.data.clone()
    ipc_handles = {get_physical_gpu_id(): reduce_tensor(weight)}
    llm.collective_rpc("update_weight_cuda_ipc", args=(name, param.dtype, param.shape, ipc_handles, last))


def test_openrlhf_cuda_ipc_sync_requantizes_in_place(llm: Any, refit_models: dict[str, Path], prompts: list[list[int]]) -> None:
    before = start_from(llm, refit_models["w1"])
    w1_outputs = generate_greedy(llm, prompts, NEW_TOKENS)  # graphs captured and replayed before the sync
    weights = cuda_weights(refit_models["w2"])
    for count, (name, param) in enumerate(weights.items(), start=1):
        _openrlhf_push(llm, name, param, count == len(weights))
    after = llm.apply_model(fp8_state)[0]
    assert_codes_equal(after, refit_models["w2"])
    assert_same_storage(before, after)
    outputs = generate_greedy(llm, prompts, NEW_TOKENS)
    assert all(len(out["token_ids"]) == NEW_TOKENS for out in outputs)
    assert outputs != w1_outputs, "generation after OpenRLHF's sync is the same as with W1"


def test_verl_bucketed_ipc_sync_requantizes_in_place(llm: Any, refit_models: dict[str, Path], prompts: list[list[int]]) -> None:
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    before = start_from(llm, refit_models["w2"])
    w2_outputs = generate_greedy(llm, prompts, NEW_TOKENS)
    weights = cuda_weights(refit_models["w1"])
    # Two buckets at least: the embeddings alone are 64 MiB here.
    sender = BucketedWeightSender(f"ipc:///tmp/rl-colocate-zmq-{VERL_JOB_ID}-replica-0-rank-0.sock", bucket_size_mb=96)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            asyncio.run(sender.async_send_weights(iter(weights.items())))
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    thread = threading.Thread(target=send)
    thread.start()
    llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": False})
    thread.join(timeout=120)
    assert not thread.is_alive() and not errors, errors
    after = llm.apply_model(fp8_state)[0]
    assert_codes_equal(after, refit_models["w1"])
    assert_same_storage(before, after)
    outputs = generate_greedy(llm, prompts, NEW_TOKENS)
    assert all(len(out["token_ids"]) == NEW_TOKENS for out in outputs)
    assert outputs != w2_outputs, "generation after verl's sync is the same as with W2"


def test_bad_tensor_through_openrlhf_is_refused_and_nothing_written(llm: Any, refit_models: dict[str, Path]) -> None:
    before = start_from(llm, refit_models["w1"])
    name = "model.layers.2.mlp.down_proj.weight"
    weight = cuda_weights(refit_models["w2"])[name].clone()
    weight[5, 7] = float("inf")
    with pytest.raises(Exception, match=rf"{name}: holds NaN or Inf"):
        _openrlhf_push(llm, name, weight, True)
    after = llm.apply_model(fp8_state)[0]
    for layer in before:
        assert torch.equal(before[layer]["weight"].view(torch.uint8), after[layer]["weight"].view(torch.uint8)), layer
