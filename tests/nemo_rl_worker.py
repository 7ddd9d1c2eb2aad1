"""NeMo RL's own refit code (vendored unmodified in tests/third_party/nemo_rl, see SOURCE.md there)
around an fp8_align engine, for tests/test_nemo_rl_refit.py and tests/test_gpu_nemo_rl_refit.py.

Importing this module puts the vendored tree on `sys.path`; `ENGINE_ENV` puts it on the
`PYTHONPATH` of vLLM's engine processes, which import the worker extension by name.

NeMo RL's colocated refit is CUDA IPC over ZMQ: the trainer's `stream_weights_via_ipc_zmq_impl`
(nemo_rl/models/policy/utils.py) packs tensors into a buffer and sends its IPC handle, the vLLM
worker's `VllmInternalWorkerExtension.update_weights_via_ipc_zmq` (vllm_backend.py) rebuilds the
buffer, loads every batch with `model.load_weights` and then runs vLLM's
`process_weights_after_loading` over the model. On a CPU exactly four CUDA-only calls are
replaced (`install_cpu_stand_ins`; nothing else of either side is changed):

- the ZMQ socket is named after the GPU's UUID (NVML): `CpuWorkerExtension.get_zmq_address`
  returns `ZMQ_ADDRESS_ENV` instead;
- `torch.cuda.nvtx.range_push` / `range_pop` (NeMo RL's `wrap_with_nvtx_name` profiling marks):
  no-ops;
- `torch.cuda.current_stream().synchronize()` (the fences before a handle is sent and before an
  ACK): a no-op, CPU copies are synchronous;
- `vllm_backend.rebuild_cuda_tensor_from_ipc`: for a CPU buffer the trainer's
  `get_handle_from_tensor` (`reduce_tensor`) gives `((cls, storage, metadata),)`; the stand-in
  rebuilds it with torch's `rebuild_tensor`. The buffer's bytes travel inside the ZMQ message
  (pickled) instead of staying in GPU memory behind a CUDA IPC handle.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

THIRD_PARTY = Path(__file__).resolve().parent / "third_party" / "nemo_rl"
if str(THIRD_PARTY) not in sys.path:
    sys.path.insert(0, str(THIRD_PARTY))

from nemo_rl.models.generation.vllm import vllm_backend  # noqa: E402
from nemo_rl.models.generation.vllm.quantization.fp8_train_utils import get_vllm_qkv_scale_names  # noqa: E402

#: `worker_extension_cls` of the GPU and the CPU engines (NeMo RL's vllm_worker.py passes
#: "nemo_rl.models.generation.vllm.vllm_backend.VllmInternalWorkerExtension"; see `CLASHES_WITH_VLLM_WORKER`).
GPU_WORKER = "tests.nemo_rl_worker.WorkerExtension"
CPU_WORKER = "tests.nemo_rl_worker.CpuWorkerExtension"
#: Environment variable holding the refit socket's address on CPU.
ZMQ_ADDRESS_ENV = "FP8_ALIGN_TEST_NEMO_RL_ZMQ"
#: Environment for engines that import NeMo RL in their worker processes.
ENGINE_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(THIRD_PARTY), os.environ.get("PYTHONPATH")]))}


#: Attributes of NeMo RL's extension that the installed vLLM's worker class defines too: vLLM
#: refuses to mix in an extension that redefines a worker attribute (`init_worker` of its
#: `WorkerWrapperBase`). On vLLM 0.32 that is `synchronize_device`, which NeMo RL's sparse-delta
#: refit uses and its IPC refit does not (NeMo RL pins vLLM 0.25.1); the extensions here leave
#: these out and are otherwise NeMo RL's class, its own method objects.
CLASHES_WITH_VLLM_WORKER = tuple(
    name for name in vars(vllm_backend.VllmInternalWorkerExtension)
    if not name.startswith("__") and hasattr(vllm_backend.VllmWorker, name)
)  # fmt: skip


def _nemo_rl_extension(name: str, **replaced: Any) -> type:
    """NeMo RL's `VllmInternalWorkerExtension` without `CLASHES_WITH_VLLM_WORKER`, `replaced` set."""
    kept = {
        key: value for key, value in vars(vllm_backend.VllmInternalWorkerExtension).items()
        if key not in (*CLASHES_WITH_VLLM_WORKER, "__dict__", "__weakref__")
    }  # fmt: skip
    return type(name, (), {**kept, **replaced, "__module__": __name__, "__qualname__": name})


def _socket_address(self: Any) -> str:
    """The refit socket's address on CPU: `ZMQ_ADDRESS_ENV` (NeMo RL: the GPU's NVML UUID)."""
    return os.environ[ZMQ_ADDRESS_ENV]


#: For GPU engines: NeMo RL's worker extension as it is (less the clashes).
WorkerExtension = _nemo_rl_extension("WorkerExtension")
#: For CPU engines: the same with the socket address from `ZMQ_ADDRESS_ENV`.
CpuWorkerExtension = _nemo_rl_extension("CpuWorkerExtension", get_zmq_address=_socket_address)


class _NoStream:
    def synchronize(self) -> None:
        """CPU work is synchronous: nothing to wait for."""


def _rebuild_cpu_tensor(handle: tuple[Any, ...], device_id: int | None) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_tensor

    return rebuild_tensor(*handle[0])


def install_cpu_stand_ins(monkeypatch: Any) -> None:
    """Replace the four CUDA-only calls of the module docstring, through `monkeypatch` (a
    `pytest.MonkeyPatch`: its `undo()` restores them)."""
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: 0)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _NoStream())
    monkeypatch.setattr(vllm_backend, "rebuild_cuda_tensor_from_ipc", _rebuild_cpu_tensor)


def install_cpu_stand_ins_in_worker(worker: Any) -> None:
    """`collective_rpc` target: `install_cpu_stand_ins` in a vLLM worker process, for its lifetime."""
    import pytest

    install_cpu_stand_ins(pytest.MonkeyPatch())


def refit_stream(weights: Iterable[tuple[str, torch.Tensor]], kv_scales: dict[str, float] | None, num_layers: int,
                 device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """What NeMo RL's trainer streams at a refit with an FP8 KV cache, after the weights: for every
    layer its Q/K/V scale names (`get_vllm_qkv_scale_names`) with the calibrated value or 1.0, one
    FP32 element each, as `MegatronPolicyWorker._iter_params_with_optional_kv_scales` appends them
    (nemo_rl/models/policy/workers/megatron_policy_worker.py:2328-2400; its weight export needs
    Megatron-Bridge, so the weights come from a checkpoint here). `kv_scales=None`: weights only
    (NeMo RL with a BF16 KV cache)."""
    yield from weights
    if kv_scales is None:
        return
    for layer in range(num_layers):
        for name in get_vllm_qkv_scale_names(layer).values():
            yield name, torch.tensor(kv_scales.get(name, 1.0), dtype=torch.float32, device=device).reshape(1)


def state_dict_info(stream: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{name: (shape, dtype)}: what NeMo RL hands the worker's `prepare_refit_info` before refits."""
    return {name: (tensor.shape, tensor.dtype) for name, tensor in stream}


def start_ipc_sender(address: str, stream: Iterable[tuple[str, torch.Tensor]], buffer_size_bytes: int) -> tuple[threading.Thread, list[BaseException]]:
    """NeMo RL's trainer side in a thread: a REQ socket bound at `address` with its policy worker's
    settings (base_policy_worker.py:139-151), then `stream_weights_via_ipc_zmq_impl`. Returns the
    thread and the list it appends an exception to."""
    import zmq
    from nemo_rl.models.policy.utils import stream_weights_via_ipc_zmq_impl

    context = zmq.Context()
    socket = context.socket(zmq.REQ)
    for option, value in ((zmq.SNDTIMEO, 120000), (zmq.RCVTIMEO, 120000), (zmq.LINGER, 0)):
        socket.setsockopt(option, value)
    socket.bind(address)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            stream_weights_via_ipc_zmq_impl(iter(stream), buffer_size_bytes, socket, rank=0, worker_name="test-trainer")
        except BaseException as error:  # reported by the caller
            errors.append(error)
        finally:
            socket.close()
            context.term()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, errors
