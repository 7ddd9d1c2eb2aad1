"""Find the tensors that hold NaN or +-Inf among many, reading each element once.

`nonfinite_tensors_reference` is the plain torch definition. `nonfinite_tensors` gives the same
answer; for CUDA tensors it runs `finite_triton.flag_nonfinite_triton` (one launch per device
and dtype over all tensors, one device sync per device), elsewhere the reference.
`start_nonfinite_check` queues the same check and returns a function that waits for its answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: Dtypes the CUDA kernel reads; other dtypes take the reference path.
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def nonfinite_tensors_reference(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Ascending indices of the `tensors` (any shapes, floating dtypes, devices) holding NaN or +-Inf."""
    return [i for i, tensor in enumerate(tensors) if not bool(torch.isfinite(tensor).all())]


def nonfinite_tensors(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Same result as `nonfinite_tensors_reference(tensors)` (`start_nonfinite_check(tensors)()`)."""
    return start_nonfinite_check(tensors)()


def start_nonfinite_check(tensors: Sequence[torch.Tensor]) -> Callable[[], list[int]]:
    """Start checking `tensors` for NaN/+-Inf; the returned function waits and gives the ascending
    indices of the offending tensors (the result of `nonfinite_tensors_reference(tensors)`).

    CUDA tensors of bf16/fp16/fp32 are checked by one Triton kernel per (device, dtype), queued
    without a device sync, so the host can do other work while they run; their flags are read
    back (one sync per device) by the returned function. Every other tensor is checked here,
    through the reference.
    """
    by_device: dict[torch.device, list[int]] = {}
    rest: list[int] = []
    for i, tensor in enumerate(tensors):
        if tensor.is_cuda and tensor.dtype in KERNEL_DTYPES:
            by_device.setdefault(tensor.device, []).append(i)
        else:
            rest.append(i)
    pending: list[tuple[list[int], torch.Tensor]] = []
    if by_device:
        # imported here: Triton is needed for CUDA tensors only (CPU-only installs have none)
        from fp8_align.checks.finite_triton import flag_nonfinite_triton

        pending = [(indices, flag_nonfinite_triton([tensors[i] for i in indices])) for indices in by_device.values()]
    bad_elsewhere = [rest[j] for j in nonfinite_tensors_reference([tensors[i] for i in rest])]

    def result() -> list[int]:
        bad = list(bad_elsewhere)
        for indices, flags in pending:
            bad += [index for index, flag in zip(indices, flags.tolist()) if flag]
        return sorted(bad)

    return result
