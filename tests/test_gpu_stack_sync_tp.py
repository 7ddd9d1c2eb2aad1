"""The RL stacks' own weight sync, their real code, into an fp8_align engine with
`tensor_parallel_size=2` on two CUDA GPUs (vLLM 0.22; issue #42, item 1), under the
multiprocessing executor and under Ray (where `ray` imports: the bundle `.gpukit_ray`).

One in-process `vllm.LLM` per executor (CUDA graphs on) from W1 (tests/gpu_models.py's SMALL
Qwen3, layer 0 BF16), with OpenRLHF's and verl's worker extensions mixed in
(tests/gpu_stack_workers.py, their methods unchanged). The trainer side is this test process,
playing both trainer ranks of a colocated job (one per GPU):

- OpenRLHF 0.11.2 (`openrlhf/trainer/ray/ppo_actor.py:439-465`): each trainer rank clones the
  full parameter on its GPU and shares it (`reduce_tensor`) keyed by its physical GPU id; rank 0
  merges the all-gathered handles and calls `update_weight_cuda_ipc` once per tensor. Here one
  clone per GPU, the handles merged as the all-gather would merge them. Each worker opens its own
  GPU's handle (`WorkerWrap.update_weight_cuda_ipc`) and vLLM's loaders cut its slice.
- verl 0.9.1: one `BucketedWeightSender` per engine rank, on that rank's socket
  (`rl-colocate-zmq-{job}-replica-0-rank-{rank}.sock`) and GPU, against each worker's own
  `vLLMColocateWorkerExtension.update_weights_from_ipc`.

Each test stands alone: it first puts W1 into the engine with `refit_weights`, then syncs W2
through the stack. After the sync every rank's FP8 codes and scales equal `fp8_align.quant` of
that rank's slice of W2 (tests/tp_slices.py), in the storage the engine started with, and the
engine generates. A tensor holding Inf is refused on every rank with nothing written on any,
through OpenRLHF's sync and through fp8_align's own `refit_weights`. The engines' KV cache is FP8, so
`push_kv_scales` is checked at TP=2 too: every rank holds the pushed scales, and a refused push
leaves every rank's scales as they were. fp8_align's own refusals are raised after every rank
replied (`worker_calls.call_workers`), so the engine's next calls read fresh replies; OpenRLHF's
refusal raises inside vLLM's executor, which leaves rank 1's reply queued (vllm-project/vllm#49972),
so that test is each engine's last.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tests.engines import FIRST_LAYER_BF16, generate_greedy
from tests.gpu_models import IN_PROCESS_LLM_KWARGS, NEW_TOKENS, SMALL, assert_same_storage, fp8_state, refit_prompts
from tests.tp_slices import TP, assert_ranks_hold

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < TP, reason=f"needs {TP} CUDA GPUs (tensor parallel size {TP})"),
]

T = TypeVar("T")
#: Layer 0 in BF16, an FP8 KV cache decoded by the attention backend (FA3; XQA has no module for
#: these 2 query heads per KV head on the offline box).
FP8_KV_CONFIG = {**FIRST_LAYER_BF16, "kv_cache_dtype": "fp8", "kv_decode_kernel": "backend"}
VERL_JOB_ID = f"fp8aligntp{os.getpid()}"
#: The repository root: Ray's workers import tests.gpu_stack_workers through PYTHONPATH (pytest's
#: sys.path does not reach them, as it reaches spawned multiprocessing workers).
ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["mp", pytest.param("ray", marks=pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed"))]


@pytest.fixture(scope="module")
def weights(refit_models: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    """W1's and W2's tensors on the host, by HF name."""
    from safetensors.torch import load_file

    return {name: {k: t for file in sorted(path.glob("*.safetensors")) for k, t in load_file(file).items()} for name, path in refit_models.items()}


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request: pytest.FixtureRequest, refit_models: dict[str, Path], vllm_runner: Any) -> Any:
    env = {"VERL_RAY_JOB_ID": VERL_JOB_ID, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with vllm_runner(
        refit_models["w1"], FP8_KV_CONFIG, **IN_PROCESS_LLM_KWARGS, tensor_parallel_size=TP,
        distributed_executor_backend=request.param,
        worker_extension_cls="tests.gpu_stack_workers.OpenRLHFAndVerlWorkerExtension", env=env,
    ) as runner:  # fmt: skip
        yield runner.llm


#: The FP8 decoder layers (layer 0 stays BF16).
FP8_LAYERS = range(1, SMALL["num_hidden_layers"])


def _assert_synced(llm: Any, before: list[dict[str, Any]], weights: dict[str, torch.Tensor], w1_outputs: list[Any], stack: str) -> None:
    """After a stack's sync of `weights`: every rank holds its slice of them in the storage it had
    `before`, and the engine generates, other tokens than with W1."""
    after = llm.apply_model(fp8_state)
    assert_ranks_hold(after, weights, FP8_LAYERS, pow2=False)
    for rank in range(TP):
        assert_same_storage(before[rank], after[rank])
    outputs = generate_greedy(llm, refit_prompts(), NEW_TOKENS)
    assert all(len(out["token_ids"]) == NEW_TOKENS for out in outputs)
    assert outputs != w1_outputs, f"generation after {stack}'s sync is the same as with W1"


def _start_from_w1(llm: Any, refit_models: dict[str, Path], weights: dict[str, dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """W1 into the engine through fp8_align's own refit; returns every rank's FP8 state."""
    from fp8_align.vllm_plugin.refit import refit_weights

    refit_weights(llm, refit_models["w1"])
    states = llm.apply_model(fp8_state)
    assert_ranks_hold(states, weights["w1"], FP8_LAYERS, pow2=False)
    return states


def _read_after_refusal(read: Callable[[], T], refusal: str) -> T:
    """`read()`, an all-rank call, after a collective call every rank refused. vLLM's executor
    raises at the first failed reply and leaves the other ranks' replies queued (vLLM issue #49972;
    seen under Ray in session 28), so the next all-rank call may get rank 1's stale refusal; the
    call after it then reads every rank after the refusal (nothing runs in between)."""
    try:
        return read()
    except Exception as stale:  # the queued reply of the refused call, nothing else
        assert re.search(refusal, str(stale)), stale
        return read()


def _openrlhf_push(llm: Any, name: str, tensor: torch.Tensor, last: bool) -> None:
    """OpenRLHF's colocated trainer side of one tensor at TP=2 and its engine call (module docstring)."""
    from openrlhf.trainer.ray.utils import get_physical_gpu_id
    from torch.multiprocessing.reductions import reduce_tensor

    clones, handles = [], {}
    for device in range(TP):
        with torch.cuda.device(device):
            clones.append(tensor.to(f"cuda:{device}").clone())
            handles[get_physical_gpu_id()] = reduce_tensor(clones[-1])
    llm.collective_rpc("update_weight_cuda_ipc", args=(name, tensor.dtype, tensor.shape, handles, last))


def _verl_push(llm: Any, weights: dict[str, torch.Tensor]) -> None:
    """verl's colocated sync at TP=2: one sender per engine rank on its GPU, the workers' receive."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    errors: list[BaseException] = []

    def send(rank: int) -> None:
        try:
            torch.cuda.set_device(rank)  # the sender's bucket buffer lives on the current device
            sender = BucketedWeightSender(f"ipc:///tmp/rl-colocate-zmq-{VERL_JOB_ID}-replica-0-rank-{rank}.sock", bucket_size_mb=96)
            asyncio.run(sender.async_send_weights((name, t.to(f"cuda:{rank}")) for name, t in weights.items()))
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=send, args=(rank,)) for rank in range(TP)]
    for thread in threads:
        thread.start()
    llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": False})
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads) and not errors, errors


def test_openrlhf_cuda_ipc_sync_requantizes_each_rank_in_place(
    llm: Any, refit_models: dict[str, Path], weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    before = _start_from_w1(llm, refit_models, weights)
    w1_outputs = generate_greedy(llm, refit_prompts(), NEW_TOKENS)
    w2 = weights["w2"]
    for count, (name, tensor) in enumerate(w2.items(), start=1):
        _openrlhf_push(llm, name, tensor, count == len(w2))
    _assert_synced(llm, before, w2, w1_outputs, "OpenRLHF")


def test_verl_bucketed_ipc_sync_requantizes_each_rank_in_place(
    llm: Any, refit_models: dict[str, Path], weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    before = _start_from_w1(llm, refit_models, weights)
    w1_outputs = generate_greedy(llm, refit_prompts(), NEW_TOKENS)
    _verl_push(llm, weights["w2"])
    _assert_synced(llm, before, weights["w2"], w1_outputs, "verl")


def test_refit_weights_with_an_inf_tensor_is_refused_on_every_rank(
    llm: Any, refit_models: dict[str, Path], weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    """fp8_align's own `refit_weights` of all of W2 with one tensor holding Inf (host tensors,
    staged as one file): refused naming that tensor; every rank still holds W1, in place."""
    from fp8_align.vllm_plugin.refit import RefitError, refit_weights

    before = _start_from_w1(llm, refit_models, weights)
    name = "model.layers.1.self_attn.q_proj.weight"
    bad = dict(weights["w2"])
    bad[name] = bad[name].clone()
    bad[name][1500, 3] = float("inf")  # in rank 1's half of the column-parallel rows
    with pytest.raises(RefitError, match=rf"{name}: holds NaN or Inf") as refused:
        refit_weights(llm, bad)
    assert f"raised in worker(s) {list(range(TP))} of {TP}" in refused.value.__notes__
    after = llm.apply_model(fp8_state)
    assert_ranks_hold(after, weights["w1"], FP8_LAYERS, pow2=False)
    for rank in range(TP):
        assert_same_storage(before[rank], after[rank])


def test_push_kv_scales_reaches_every_rank_and_a_refused_push_writes_none(llm: Any) -> None:
    """`push_kv_scales` into the TP=2 engine's FP8 cache: every rank holds the pushed FP32 scales; a
    push that leaves out a layer is refused by the workers and every rank keeps the pushed ones; a
    NaN scale is refused before any worker is called; the engine generates after both."""
    from fp8_align.vllm_plugin.kv.scales import KVScaleError, push_kv_scales, read_kv_scales

    layers = range(SMALL["num_hidden_layers"])
    pushed = {layer: {"k_scale": 0.0625 * (layer + 1), "v_scale": 0.03125 * (layer + 1), "q_scale": 1.0} for layer in layers}
    push_kv_scales(llm, pushed)  # powers of two and their small multiples: exact in the FP32 buffers
    assert read_kv_scales(llm) == [pushed] * TP
    with pytest.raises(KVScaleError, match=re.escape("missing [2]")):
        push_kv_scales(llm, {layer: values for layer, values in pushed.items() if layer != 2})
    assert read_kv_scales(llm) == [pushed] * TP
    with pytest.raises(KVScaleError, match="layer 1 k_scale"):
        push_kv_scales(llm, {**pushed, 1: {"k_scale": float("nan"), "v_scale": 0.5}})
    assert read_kv_scales(llm) == [pushed] * TP
    outputs = generate_greedy(llm, refit_prompts(), NEW_TOKENS)
    assert all(len(out["token_ids"]) == NEW_TOKENS for out in outputs)


def test_an_inf_tensor_through_openrlhf_is_refused_on_every_rank(
    llm: Any, refit_models: dict[str, Path], weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    """OpenRLHF's own `update_weight_cuda_ipc` of a tensor holding Inf: refused on both ranks,
    each still holds W1 in place. The refusal raises inside vLLM's executor (the stack's call, not
    fp8_align's), which leaves rank 1's reply queued (vllm-project/vllm#49972): every later
    all-rank call of this engine reads rank 1's previous reply, so this test is the engine's last."""
    before = _start_from_w1(llm, refit_models, weights)
    name = "model.layers.2.mlp.down_proj.weight"
    bad = weights["w2"][name].clone()
    bad[5, 7] = float("inf")  # in rank 0's half of the row-parallel input columns
    with pytest.raises(Exception, match=rf"{name}: holds NaN or Inf"):
        _openrlhf_push(llm, name, bad, True)
    after = _read_after_refusal(lambda: llm.apply_model(fp8_state), rf"{name}: holds NaN or Inf")
    assert_ranks_hold(after, weights["w1"], FP8_LAYERS, pow2=False)
    for rank in range(TP):
        assert_same_storage(before[rank], after[rank])
