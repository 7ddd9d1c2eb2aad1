"""Worker-side functions the stack-sync tests run inside vLLM workers (`collective_rpc`).

Each one makes exactly the call a stack's own sync code makes on the worker, cited by file and
line of the release it was matched against, where that code cannot run on a CPU as a whole:

- OpenRLHF 0.11.2, `openrlhf/trainer/ray/vllm_worker_wrap.py`: `WorkerWrap.update_weight`
  (line 48) and `update_weight_cuda_ipc` (line 69) both end in
  `self.model_runner.model.load_weights(weights=[(name, weight)])`, one tensor per call, after
  receiving it over NCCL or CUDA IPC (the receive allocates on "cuda", so it runs on the GPU box
  only: tests/test_gpu_stack_sync.py). `self` is the vLLM worker with WorkerWrap mixed in (vLLM's
  `worker_extension_cls`); the engine in tests/test_stack_sync.py is started that way.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load_file

from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer


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


def load_weights_once(worker: Any, path: str, names: list[str] | None, extra_path: str | None = None) -> None:
    """One `model.load_weights(list_of_pairs)` call with the tensors of `path` (all, or `names` in
    that order, repeats kept), then those of `extra_path`, which replace entries of the same name:
    verl's `_update_weights` shape of call. (Tensors travel as files: collective_rpc arguments
    are serialized without their data.)"""
    tensors = load_file(path)
    batch = [(name, tensors[name]) for name in (names if names is not None else tensors)]
    for name, tensor in (load_file(extra_path) if extra_path else {}).items():
        batch = [(n, t) for n, t in batch if n != name] + [(name, tensor)]
    worker.model_runner.model.load_weights(batch)


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
