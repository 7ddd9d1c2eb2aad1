"""Random tensor lists with NaN/Inf planted in some, for the `fp8_align.checks` tests."""

from __future__ import annotations

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def make_cases(seed: int, count: int, max_numel: int, device: str) -> tuple[list[torch.Tensor], list[int]]:
    """`count` tensors (sizes 0..max_numel, the three dtypes, some non-contiguous, some holding the
    dtype's largest finite value) and the ascending indices of those given a NaN, +Inf or -Inf
    (at the first, the last or a random element)."""
    g = torch.Generator().manual_seed(seed)
    tensors, planted = [], []
    for i in range(count):
        dtype = DTYPES[int(torch.randint(len(DTYPES), (), generator=g))]
        numel = int(torch.randint(max_numel + 1, (), generator=g)) if i % 7 else int(torch.randint(3, (), generator=g))
        t = (torch.randn(numel, generator=g) * 100).to(dtype)
        if numel and torch.rand((), generator=g) < 0.3:
            t[int(torch.randint(numel, (), generator=g))] = torch.finfo(dtype).max  # finite: must not be flagged
        if numel and torch.rand((), generator=g) < 0.4:
            where = [0, numel - 1, int(torch.randint(numel, (), generator=g))][int(torch.randint(3, (), generator=g))]
            t[where] = [float("nan"), float("inf"), float("-inf")][int(torch.randint(3, (), generator=g))]
            planted.append(i)
        t = t.to(device)
        if numel >= 4 and numel % 2 == 0 and torch.rand((), generator=g) < 0.3:
            t = t.view(2, numel // 2).t()  # non-contiguous view of the same elements
        tensors.append(t)
    return tensors, planted
