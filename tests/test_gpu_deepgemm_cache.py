"""`prepare_deepgemm_cache` on the GPU box (SM90, vLLM 0.22's DeepGEMM): it fills the JIT cache the
engine's warm-up reads, so a second pass over the same calls loads instead of compiling."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_prepared_cache_turns_compiles_into_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two [N, K] shapes at every warm-up M up to 512 tokens, in 4 processes: every M is run once,
    kernels land in the given directory with a mark per shape (what an engine's warm-up checks),
    and the same calls again (fresh processes, same cache) take under a third of the first pass's
    summed seconds (a compile is ~0.8 s, a load ~ms)."""
    import torch

    from fp8_align.vllm_plugin.kernels.deepgemm_cache import prepare_deepgemm_cache
    from fp8_align.vllm_plugin.kernels.deepgemm_inventory import LinearShape, is_prepared
    from fp8_align.vllm_plugin.kernels.gpu import deepgemm_cache_setup, deepgemm_warmup_m_values

    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "relax")
    shapes = [LinearShape("a", 768, 512, (512, 128, 128)), LinearShape("b", 512, 512, (512,)), LinearShape("odd", 200, 512, (200,))]
    cache = tmp_path / "dg"
    cold = prepare_deepgemm_cache(shapes, max_tokens=512, jobs=4, cache_dir=cache)
    expected = sum(len(deepgemm_warmup_m_values(n, 512, torch.device("cuda"))) for n in (768, 512))
    assert cold["kernels"] == expected and cold["skipped_shapes"] == ["odd"]
    assert cold["cache_dir"] == str(cache.resolve()) and any(cache.iterdir())
    setup = deepgemm_cache_setup(torch.device("cuda"))
    assert is_prepared(cache.resolve(), setup, 768, 512, 512) and is_prepared(cache.resolve(), setup, 512, 512, 256)
    assert not is_prepared(cache.resolve(), setup, 200, 512, 512) and not is_prepared(cache.resolve(), setup, 768, 512, 1024)
    warm = prepare_deepgemm_cache(shapes, max_tokens=512, jobs=4, cache_dir=cache)
    print(f"cold {cold['compile_s_sum']} s summed ({cold['wall_s']} s wall), warm {warm['compile_s_sum']} s summed")
    assert warm["compile_s_sum"] < cold["compile_s_sum"] / 3
