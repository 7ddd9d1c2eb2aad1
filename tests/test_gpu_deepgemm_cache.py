"""`prepare_deepgemm_cache` on the GPU box (SM90, vLLM's bundled DeepGEMM): it fills the JIT cache
the engine's warm-ups read (fp8_align's linears, vLLM's grouped MoE GEMM), so a second pass over
the same calls loads instead of compiling."""

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

    from fp8_align.vllm_plugin.kernels.deepgemm.cache import prepare_deepgemm_cache
    from fp8_align.vllm_plugin.kernels.deepgemm.inventory import LinearShape, is_prepared
    from fp8_align.vllm_plugin.kernels.deepgemm.warmup import deepgemm_cache_setup, deepgemm_warmup_m_values

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


def test_prepared_grouped_kernels_turn_compiles_into_loads(tmp_path: Path) -> None:
    """The routed experts' grouped GEMM (8 experts, w13 [256, 512] and w2 [512, 128], top-2) at
    every M of vLLM's warm-up up to 512 tokens, in 4 processes: every call is made once, and the
    same calls again (fresh processes, same cache) take under a third of the first pass's summed
    seconds: what vLLM's own warm-up then loads instead of compiling."""
    from fp8_align.vllm_plugin.kernels.deepgemm.cache import prepare_deepgemm_cache
    from fp8_align.vllm_plugin.kernels.deepgemm.inventory import ExpertShape, grouped_m_values

    experts = [ExpertShape("w13", 8, 256, 512, 2), ExpertShape("w2", 8, 512, 128, 2)]
    cache = tmp_path / "dg"
    cold = prepare_deepgemm_cache([], max_tokens=512, jobs=4, cache_dir=cache, experts=experts)
    assert cold["kernels"] == sum(len(grouped_m_values(e, 512)) for e in experts)
    assert [e["m_values"] for e in cold["experts"]] == [len(grouped_m_values(e, 512)) for e in experts]
    warm = prepare_deepgemm_cache([], max_tokens=512, jobs=4, cache_dir=cache, experts=experts)
    print(f"grouped: cold {cold['compile_s_sum']} s summed ({cold['wall_s']} s wall), warm {warm['compile_s_sum']} s summed")
    assert warm["compile_s_sum"] < cold["compile_s_sum"] / 3
