"""Worker-side functions the stack-sync tests run inside vLLM workers (`collective_rpc`).

Each one makes exactly the call a stack's own sync code makes on the worker, cited by file and
line of the release it was matched against, where that code cannot run on a CPU as a whole:

- OpenRLHF 0.11.2, `openrlhf/trainer/ray/vllm_worker_wrap.py`: `WorkerWrap.update_weight`
  (line 48) and `update_weight_cuda_ipc` (line 69) both end in
  `self.model_runner.model.load_weights(weights=[(name, weight)])`, one tensor per call, after
  receiving it over NCCL or CUDA IPC (the receive allocates on "cuda", so it runs on the GPU box
  only: tests/test_gpu_stack_sync.py). `self` is the vLLM worker with WorkerWrap mixed in (vLLM's
  `worker_extension_cls`); the engines in tests/test_stack_sync.py and tests/test_stack_sync_tp.py
  are started that way.
- verl 0.9.1: `model.load_weights(bucket)` per bucket, then vLLM's `process_weights_after_loading`
  (`load_weights_once`, `vllm_process_weights_after_loading`).
- NeMo RL (NVIDIA-NeMo/RL at 7ea279ab, `nemo_rl/models/generation/vllm/vllm_backend.py`):
  `VllmInternalWorkerExtension._load_full_hf_weights` (line 199) calls
  `self.model_runner.model.load_weights(weights=policy_weights)` once per received bucket of
  (HF name, tensor) pairs (via `_load_weights`, line 574, from `update_weights_via_ipc_zmq`, line
  701, or `update_weights_from_collective`, line 764); after the last bucket its `finalize`
  (lines 620-624) runs vLLM's `process_weights_after_loading` under `set_current_vllm_config`
  (`nemo_rl_update_weights`). The receive (ZMQ + CUDA IPC, or NCCL) needs CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load_file

from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer
from tests.engines import fp8_storage_pointers


def openrlhf_update_weights(worker: Any, path: str, names: list[str]) -> dict[str, Any]:
    """For each name in order: OpenRLHF's own dtype assertion (vllm_worker_wrap.py:39) and its
    load call (line 48), one tensor per call. Returns what the worker is: the WorkerWrap mix-in."""
    tensors = load_file(path)
    for name in names:
        weight = tensors[name]
        assert weight.dtype == worker.model_config.dtype, f"mismatch dtype: src {weight.dtype}, dst {worker.model_config.dtype}"
        worker.model_runner.model.load_weights(weights=[(name, weight)])
    inner = getattr(worker, "worker", worker)  # collective_rpc hands functions vLLM's WorkerWrapperBase
    return {"worker_classes": [cls.__qualname__ for cls in type(inner).__mro__]}


def load_weights_once(
    worker: Any, path: str, names: list[str] | None, extra_path: str | None = None, extra_on_rank: int | None = None
) -> None:
    """One `model.load_weights(list_of_pairs)` call with the tensors of `path` (all, or `names` in
    that order, repeats kept), then those of `extra_path`, which replace entries of the same name:
    verl's `_update_weights` shape of call. With `extra_on_rank`, only the worker of that
    tensor-parallel rank takes the `extra_path` tensors (a sync that differs between ranks).
    (Tensors travel as files: collective_rpc arguments are serialized without their data.)"""
    from vllm.distributed import get_tensor_model_parallel_rank

    tensors = load_file(path)
    batch = [(name, tensors[name]) for name in (names if names is not None else tensors)]
    takes_extra = extra_path is not None and extra_on_rank in (None, get_tensor_model_parallel_rank())
    for name, tensor in (load_file(extra_path) if takes_extra else {}).items():
        batch = [(n, t) for n, t in batch if n != name] + [(name, tensor)]
    worker.model_runner.model.load_weights(batch)


def load_weights_refused(worker: Any, path: str, names: list[str], bad_path: str, bad_rank: int) -> dict[str, Any]:
    """`load_weights_once(worker, path, names, bad_path, bad_rank)` (a call that is bad on TP rank
    `bad_rank` only), its exception caught on this rank, with what this rank held around it.
    Returns `rank` (TP rank), `refused` ("<exception type>: <message>", None if the call returned)
    and `before` / `after` (`held_weights`). Caught here, not in the caller: vLLM 0.32's
    multiprocessing executor stops reading workers' replies at the first failed rank, so a
    `collective_rpc` that fails on rank 0 leaves rank 1's reply queued and every later
    `collective_rpc` reads a stale one (vllm-project/vllm#49972)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    model = worker.model_runner.model
    before = held_weights(model)
    try:
        load_weights_once(worker, path, names, bad_path, bad_rank)
    except Exception as error:
        refused: str | None = f"{type(error).__name__}: {error}"
    else:
        refused = None
    return {"rank": get_tensor_model_parallel_rank(), "refused": refused, "before": before, "after": held_weights(model)}


def held_weights(model: torch.nn.Module) -> dict[str, Any]:
    """CPU copies of what this worker's model holds: `fp8` (per FP8 layer {"weight": codes as
    uint8, "weight_scale_inv": scales}; dicts, not tuples: vLLM's msgpack reply drops the tensor
    type inside tuples), `bf16` (`bf16_weights`) and `pointers` (`fp8_storage_pointers`)."""
    fp8 = {
        name: {"weight": module.weight.detach().cpu().view(torch.uint8).clone(),
               "weight_scale_inv": module.weight_scale_inv.detach().cpu().clone()}  # fmt: skip
        for name, module in model.named_modules()
        if is_fp8_align_layer(module, "linear")
    }
    return {"fp8": fp8, "bf16": bf16_weights(model), "pointers": fp8_storage_pointers(model)}


def bf16_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the weights of every module that is not FP8 and has a 2-D weight (BF16
    linears, embeddings, lm_head)."""
    return {
        name: module.weight.detach().cpu().clone()
        for name, module in model.named_modules()
        if not is_fp8_align_layer(module) and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2
    }


def sync_state(model: torch.nn.Module) -> dict[str, Any]:
    """Whether fp8_align's weight sync is installed on this model and which patches are applied."""
    from fp8_align.vllm_plugin.patches import applied_patches

    return {"instance_load_weights": "load_weights" in model.__dict__, "patches": applied_patches()}


def vllm_process_weights_after_loading(worker: Any) -> None:
    """vLLM's `process_weights_after_loading` over the whole model, as verl 0.9.1 runs it after
    every sync (verl/workers/rollout/vllm_rollout/utils.py:344-347)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    runner = worker.model_runner
    process_weights_after_loading(runner.model, runner.vllm_config.model_config, runner.device)


def nemo_rl_update_weights(worker: Any, path: str, buckets: list[list[str]]) -> None:
    """NeMo RL's worker-side refit: per bucket (names of `path`, in order) its load call
    `self.model_runner.model.load_weights(weights=policy_weights)` (vllm_backend.py:199), then its
    `finalize` (lines 620-624): vLLM's `process_weights_after_loading` over the model under
    `set_current_vllm_config`. Not run: NeMo RL's receive, its Gemma3/draft-model name handling
    and FP8 KV-cache step (none apply to a Llama with a BF16 KV cache)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    tensors = load_file(path)
    runner = worker.model_runner
    for bucket in buckets:
        runner.model.load_weights(weights=[(name, tensors[name]) for name in bucket])
    with set_current_vllm_config(runner.vllm_config):
        process_weights_after_loading(runner.model, worker.model_config, worker.device)
