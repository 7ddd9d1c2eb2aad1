"""Find the tensors that hold NaN or +-Inf among many, reading each element once.

`nonfinite_tensors_reference` is the plain torch definition. `nonfinite_tensors` gives the same
answer; for CUDA tensors it runs `finite_triton.flag_nonfinite_triton` (one launch per device
and dtype over all tensors, one device sync per device), elsewhere the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Dtypes the CUDA kernel reads; other dtypes take the reference path.
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def nonfinite_tensors_reference(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Ascending indices of the `tensors` (any shapes, floating dtypes, devices) holding NaN or +-Inf."""
    return [i for i, tensor in enumerate(tensors) if not bool(torch.isfinite(tensor).all())]


def nonfinite_tensors(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Same result as `nonfinite_tensors_reference(tensors)`.

    CUDA tensors of bf16/fp16/fp32 are checked by one Triton kernel per (device, dtype) whose
    flags are read back once per device; every other tensor through the reference.
    """
    by_device: dict[torch.device, list[int]] = {}
    rest: list[int] = []
    for i, tensor in enumerate(tensors):
        if tensor.is_cuda and tensor.dtype in KERNEL_DTYPES:
            by_device.setdefault(tensor.device, []).append(i)
        else:
            rest.append(i)
    bad = [rest[j] for j in nonfinite_tensors_reference([tensors[i] for i in rest])]
    if by_device:
        from fp8_align.checks.finite_triton import flag_nonfinite_triton

        pending = [(indices, flag_nonfinite_triton([tensors[i] for i in indices])) for indices in by_device.values()]
        for indices, flags in pending:
            bad += [index for index, flag in zip(indices, flags.tolist()) if flag]
    return sorted(bad)
