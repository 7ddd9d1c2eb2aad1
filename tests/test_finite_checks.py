"""`fp8_align.checks.nonfinite_tensors`: which tensors hold NaN or Inf.

The reference is checked against planted values; the Triton kernel is checked against the
reference on CPU through the Triton interpreter (a subprocess with TRITON_INTERPRET=1, which
must be set before Triton is imported), and compiled on the GPU box (`gpu` marker).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fp8_align.checks import nonfinite_tensors, nonfinite_tensors_reference
from tests.finite_cases import make_cases

_INTERPRETED = """
import json, sys
import torch
from fp8_align.checks.finite_triton import flag_nonfinite_triton
from tests.finite_cases import make_cases
results = []
for seed in range(int(sys.argv[1])):
    tensors, planted = make_cases(seed, count=12, max_numel=9000, device="cpu")
    results.append({"planted": planted, "flagged": [i for i, f in enumerate(flag_nonfinite_triton(tensors).tolist()) if f]})
print(json.dumps(results))
"""


@pytest.mark.parametrize("seed", range(5))
def test_reference_finds_exactly_the_planted_values(seed: int) -> None:
    tensors, planted = make_cases(seed, count=20, max_numel=5000, device="cpu")
    assert nonfinite_tensors_reference(tensors) == planted
    assert nonfinite_tensors(tensors) == planted  # CPU tensors: the reference path


def test_largest_finite_values_and_empty_tensors_pass() -> None:
    tensors = [torch.full((3,), torch.finfo(d).max, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32)]
    tensors += [-t for t in tensors] + [torch.empty(0), torch.empty(0, 5, dtype=torch.bfloat16)]
    assert nonfinite_tensors(tensors) == []


def test_triton_kernel_matches_reference_in_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED, "6"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(len(r["planted"]) for r in results) > 10  # the cases do plant values
    for r in results:
        assert r["flagged"] == r["planted"]


def test_triton_kernel_rejects_mixed_devices_or_dtypes() -> None:
    pytest.importorskip("triton")
    from fp8_align.checks.finite_triton import flag_nonfinite_triton

    with pytest.raises(ValueError, match="at least one"):
        flag_nonfinite_triton([])
    with pytest.raises(TypeError, match="expected"):
        flag_nonfinite_triton([torch.zeros(3), torch.zeros(3, dtype=torch.float64)])


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(10))
def test_cuda_kernel_matches_reference(seed: int) -> None:
    tensors, planted = make_cases(seed, count=40, max_numel=3_000_000, device="cuda")
    assert nonfinite_tensors(tensors) == planted == nonfinite_tensors_reference(tensors)


@pytest.mark.gpu
def test_cuda_kernel_aligned_path() -> None:
    """Element counts that are multiples of 16 (the kernel's vectorization-hinted path)."""
    tensors = [torch.randn(16 * int(n), device="cuda").to(d) for n, d in zip([1, 7, 4096, 100_003, 5], [torch.bfloat16] * 5)]
    assert nonfinite_tensors(tensors) == []
    for i, where in ((1, 0), (2, -1), (3, 777_777)):
        tensors[i][where] = float("nan") if i != 2 else float("-inf")
    assert nonfinite_tensors(tensors) == [1, 2, 3]


@pytest.mark.gpu
def test_cuda_kernel_reads_past_2_to_the_31_elements() -> None:
    """A bf16 tensor of 2^31 + 3 elements (4 GiB): int64 indexing reaches a NaN in the last one."""
    big = torch.zeros(2**31 + 3, dtype=torch.bfloat16, device="cuda")
    small = torch.ones(10, device="cuda")
    assert nonfinite_tensors([small, big]) == []
    big[-1] = float("nan")
    assert nonfinite_tensors([small, big]) == [1]


@pytest.mark.gpu
def test_cuda_check_is_queued_without_a_device_sync() -> None:
    """`start_nonfinite_check` returns while earlier device work is still running (the refit builds
    its plan on the host meanwhile); its result then waits and is correct.

    A ~0.5 s `torch.cuda._sleep` is queued first: had the call synchronized (a pageable
    host->device copy of its table does), the event after the sleep would be complete on return.
    """
    from fp8_align.checks import start_nonfinite_check

    tensors, planted = make_cases(3, count=40, max_numel=300_000, device="cuda")
    assert start_nonfinite_check(tensors)() == planted  # kernels compiled before the timed part
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    busy = torch.cuda.Event()
    busy.record()
    result = start_nonfinite_check(tensors)
    assert not busy.query(), "start_nonfinite_check waited for the device"
    assert result() == planted
