"""Shared pytest setup: `gpu` tests run only where CUDA with FP8 (sm89+) is present, and the
`vllm_runner` fixture that starts in-process vLLM engines (tests/engines.py)."""

from __future__ import annotations

import pytest
import torch

pytest.register_assert_rewrite("tests.engines", "tests.gpu_models")  # their asserts report as the tests' own

from tests.engines import EngineRunner  # noqa: E402


def _has_fp8_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_fp8_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with FP8 (sm89+); run `pytest -m gpu` on the GPU box")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def vllm_runner() -> type[EngineRunner]:
    """`with vllm_runner(model, fp8_config, env=..., **llm_kwargs) as runner:` one in-process
    engine (`runner.llm`), shut down and its environment restored at the end of the block. As
    vLLM's own fixture of that name; session-scoped, so module-scoped engine fixtures can use it."""
    return EngineRunner
