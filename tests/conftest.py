"""Shared pytest setup: `gpu` tests run only where CUDA with FP8 (sm89+) is present, the
`vllm_runner` fixture that starts in-process vLLM engines (tests/engines.py), and the
session-scoped checkpoints and fresh reference engines that several engine modules compare with.

A reference engine is started once per session, by the first module that asks, and only read
afterwards (its generation and layers, saved to a file), so every module that asks gets what a
fresh engine of exactly that checkpoint and configuration gives; each engine start costs
40-60 s on the 2-core CI machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.register_assert_rewrite("tests.engines", "tests.gpu_models")  # their asserts report as the tests' own

from fp8_align.error_bench.generate import GenerationJob, start_generation  # noqa: E402
from tests.engines import MAX_TOKENS, PROMPTS, EngineRunner, start_fresh_engine, sync_checkpoints  # noqa: E402
from tests.gpu_models import refit_checkpoints  # noqa: E402
from tests.model_factory import make_tiny_qwen3_moe  # noqa: E402
from tests.tp_slices import TP_ENGINE, TP_ENV, TP_FP8_FIELDS, make_tp_llama  # noqa: E402


def _has_fp8_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


#: The longest test files on the 2-core CI machine (CI's --durations), started first.
LONGEST_FILES = ("test_vllm_serve.py", "test_trl.py", "test_vllm_plugin.py", "test_stack_sync_tp.py", "test_vllm_plugin_tp.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests without an FP8 GPU, and order the files LONGEST_FILES first, then those with
    `slow` tests, then the rest (each file's tests in their order), so that the two xdist workers of
    scripts/test.sh (`--dist loadfile`) finish together."""
    if not _has_fp8_cuda():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with FP8 (sm89+); run `pytest -m gpu` on the GPU box")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    first_index: dict[Path, int] = {}
    for index, item in enumerate(items):
        first_index.setdefault(item.path, index)

    def key(item: pytest.Item) -> tuple[int, bool, int]:
        name = item.path.name
        rank = LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)
        return rank, item.path not in slow_files, first_index[item.path]

    items.sort(key=key)  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def vllm_runner() -> type[EngineRunner]:
    """`with vllm_runner(model, fp8_config, env=..., **llm_kwargs) as runner:` one in-process
    engine (`runner.llm`), shut down and its environment restored at the end of the block. As
    vLLM's own fixture of that name; session-scoped, so module-scoped engine fixtures can use it."""
    return EngineRunner


@pytest.fixture(scope="session")
def sync_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """W1 and W2 of the tiny tied-embedding Llama (`sync_checkpoints`) of the weight-sync modules
    (tests/test_stack_sync.py, tests/test_nemo_rl_refit.py). Read only."""
    return sync_checkpoints(tmp_path_factory.mktemp("sync_models"))


@pytest.fixture(scope="session")
def sync_fresh_w2(sync_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenerationJob]:
    """A fresh fp8_align engine from `sync_models["w2"]` (`start_fresh_engine`: a subprocess, its
    layers inspected), started when first asked for; `.wait()` returns its output, any number of
    times. Killed at the end of the session if still running."""
    job = start_fresh_engine(sync_models["w2"], tmp_path_factory.mktemp("sync_refs") / "w2.pt")
    yield job
    job.kill()


@pytest.fixture(scope="session")
def tp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """W1 and W2 (`make_tp_llama`, seeds 0 and 1) of the TP=2 modules (tests/test_stack_sync_tp.py,
    tests/test_vllm_plugin_tp.py). Read only."""
    root = tmp_path_factory.mktemp("tp_models")
    return {name: make_tp_llama(root / name, seed=seed) for name, seed in (("w1", 0), ("w2", 1))}


@pytest.fixture(scope="session")
def tp_fresh_w2(tp_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenerationJob]:
    """A fresh fp8_align TP=2 engine from `tp_models["w2"]` in a subprocess (TP_FP8_FIELDS, TP_ENGINE,
    TP_ENV, greedy PROMPTS, each rank's layers inspected), started when first asked for; `.wait()`
    returns its output, any number of times. Killed at the end of the session if still running."""
    spec = {"model": str(tp_models["w2"]), "fp8_config": TP_FP8_FIELDS, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "inspect": True, "llm_kwargs": TP_ENGINE, "env": TP_ENV}  # fmt: skip
    job = start_generation(spec, tmp_path_factory.mktemp("tp_refs") / "w2.pt")
    yield job
    job.kill()


@pytest.fixture(scope="session")
def refit_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """W1 and W2 of tests/gpu_models.py's SMALL Qwen3 shape: the GPU refit and stack-sync engines
    start from W1 and are synced to W2 (tests/test_gpu_refit.py, test_gpu_stack_sync.py, test_gpu_stack_sync_tp.py)."""
    return refit_checkpoints(tmp_path_factory)


@pytest.fixture(scope="session")
def qwen3_moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """W1 (seed 0) and W2 (seed 1) of the tiny Qwen3-MoE (tests/model_factory.py), for the MoE
    engines that start from W1 and are refit to W2 (tests/test_gpu_moe.py, test_vllm_plugin_ep.py)."""
    root = tmp_path_factory.mktemp("qwen3_moe_models")
    return {name: make_tiny_qwen3_moe(root / name, seed=seed) for name, seed in (("w1", 0), ("w2", 1))}
