"""Shared pytest setup: `gpu` tests run only where CUDA with FP8 (sm89+) is present."""

from __future__ import annotations

import pytest
import torch


def _has_fp8_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_fp8_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with FP8 (sm89+); run `pytest -m gpu` on the GPU box")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
