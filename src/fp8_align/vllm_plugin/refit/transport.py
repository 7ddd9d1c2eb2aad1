"""How `refit_weights` moves a weight update from the trainer's process into vLLM's workers.

Raw tensors do not survive vLLM's multiprocess RPC, so an update travels as two picklable parts:
its CUDA tensors as CUDA IPC handles (`share_cuda_tensors`; the worker maps the trainer's memory,
no copy through the host, `open_cuda_tensors`) and its CPU tensors as one safetensors file
staged under /dev/shm (or safetensors files the caller already has). `staged_update` is the
trainer's side, `received_update` the worker's.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.multiprocessing.reductions import reduce_tensor

from fp8_align.vllm_plugin.checkpoint import RefitError

#: Where trainer-side tensors are staged for the workers (RAM-backed when available).
STAGING_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None


@contextmanager
def staged_update(weights: Mapping[str, torch.Tensor] | str | os.PathLike[str]) -> Iterator[tuple[list[str], bytes]]:
    """The trainer's side: (safetensors files, CUDA IPC handles) that carry `weights` to the
    workers, valid inside the `with` block (a staged file is deleted on exit).

    weights: tensors by name (CUDA ones shared, CPU ones staged as one file), or a path to one
    `.safetensors` file or a directory of them (sent as they are). Raises RefitError for a value
    that is not a tensor or a path without safetensors files.
    """
    if not isinstance(weights, Mapping):
        yield safetensors_files(Path(weights)), b""
        return
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            raise RefitError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    on_gpu = {name: tensor for name, tensor in weights.items() if tensor.is_cuda}
    on_host = {name: tensor for name, tensor in weights.items() if not tensor.is_cuda}
    handles = share_cuda_tensors(on_gpu) if on_gpu else b""
    if not on_host:
        yield [], handles
        return
    with tempfile.TemporaryDirectory(prefix="fp8_align_refit_", dir=STAGING_ROOT) as staging:
        path = Path(staging) / "weights.safetensors"
        save_file({name: tensor.detach().contiguous().cpu() for name, tensor in on_host.items()}, str(path))
        yield [str(path)], handles


def received_update(files: list[str], cuda_handles: bytes) -> dict[str, torch.Tensor]:
    """The worker's side of `staged_update`: every tensor of the update by name (CUDA ones mapped,
    not copied). Raises RefitError for a name sent twice."""
    updates: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in load_file(path).items():
            if name in updates:
                raise RefitError(f"{name}: sent twice ({path} and an earlier file)")
            updates[name] = tensor
    for name, tensor in open_cuda_tensors(cuda_handles).items() if cuda_handles else ():
        if name in updates:
            raise RefitError(f"{name}: sent twice (as a CPU and as a CUDA tensor)")
        updates[name] = tensor
    return updates


def safetensors_files(path: Path) -> list[str]:
    """The `.safetensors` file `path`, or the ones in directory `path` (sorted); RefitError when
    there are none or `path` is another kind of file."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or any(f.suffix != ".safetensors" or not f.is_file() for f in files):
        raise RefitError(f"{path}: expected a .safetensors file or a directory holding some")
    return [str(f) for f in files]


def share_cuda_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Pickled CUDA IPC handles of `tensors` (name -> CUDA tensor), for `open_cuda_tensors` in
    another process on the same machine. The caller keeps the tensors alive until the receiver
    is done with them (`refit_weights` does: `collective_rpc` returns after the workers)."""
    return pickle.dumps({name: reduce_tensor(tensor.detach()) for name, tensor in tensors.items()})


def open_cuda_tensors(handles: bytes) -> dict[str, torch.Tensor]:
    """The tensors `share_cuda_tensors` shared, mapped into this process (no copy)."""
    return {name: rebuild(*args) for name, (rebuild, args) in pickle.loads(handles).items()}
