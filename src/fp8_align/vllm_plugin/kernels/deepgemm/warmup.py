"""The warm-up of the `deepgemm` GEMM backend at engine start: the M values each [N, K] is run
with (vLLM's own choice), and what happens with a JIT cache not marked prepared for the engine:
filled first in parallel processes (`fill`), or, where that fails, compiled one kernel after
another with a warning naming `fp8-align prepare-deepgemm`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from vllm import envs
from vllm.config import VllmConfig, get_current_vllm_config_or_none

from fp8_align.versions import installed_vllm_version
from fp8_align.vllm_plugin.kernels.deepgemm.fill import cold_shapes, fill_command, fill_lock, model_deepgemm_shapes, run_fill
from fp8_align.vllm_plugin.kernels.deepgemm.inventory import (
    JIT_CACHE_ENV_VAR,
    Warmup,
    cache_setup,
    compile_jobs,
    is_prepared,
    jit_cache_dir,
    mark_prepared,
    note_warmup,
    was_warmed_up,
)

logger = logging.getLogger("vllm.fp8_align")

#: A DeepGEMM warm-up slower than this (seconds per [N, K]) compiled rather than loaded its kernels.
DEEPGEMM_COLD_WARMUP_S = 20.0
#: Seconds DeepGEMM takes to compile one kernel on an H100 (what a cold warm-up costs per M value).
DEEPGEMM_COMPILE_S = 0.8


def deepgemm_warmup_m_values(n: int, max_tokens: int, device: torch.device) -> list[int]:
    """The M values (token counts) an [N, K] DeepGEMM layer is warmed up with: vLLM's own choice
    per VLLM_DEEP_GEMM_WARMUP ("relax": every M where DeepGEMM's tiling or wave count changes, up
    to `max_tokens`; "full": 1..max_tokens). A set for a smaller `max_tokens` is a subset."""
    from vllm.model_executor.warmup.deep_gemm_warmup import _generate_optimal_warmup_m_values

    if envs.VLLM_DEEP_GEMM_WARMUP == "relax":
        return _generate_optimal_warmup_m_values(max_tokens, n, device)
    return list(range(1, max_tokens + 1))


def deepgemm_cache_setup(device: torch.device) -> str:
    """`inventory.cache_setup` of this GPU model, vLLM release and VLLM_DEEP_GEMM_WARMUP."""
    return cache_setup(torch.cuda.get_device_name(device), installed_vllm_version(), envs.VLLM_DEEP_GEMM_WARMUP)


#: (cache directory, model, max_num_batched_tokens) a cold-cache warning was logged for in this process.
_COLD_CACHES_WARNED: set[tuple[str, str, int]] = set()


def warn_cold_cache(vllm_config: VllmConfig, cache: Path, setup: str, n: int, k: int, kernels: int, device: torch.device) -> None:
    """Warn, once per engine setting and process, that the engine's warm-up is about to compile
    DeepGEMM kernels one after another, how many (every [N, K] not marked prepared of a model
    `decoder_linear_shapes` describes, else this shape's), and the `fp8-align prepare-deepgemm` command that avoids it."""
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    tp = vllm_config.parallel_config.tensor_parallel_size
    model = str(vllm_config.model_config.model)
    if (str(cache), model, max_tokens) in _COLD_CACHES_WARNED:
        return
    _COLD_CACHES_WARNED.add((str(cache), model, max_tokens))
    shapes = model_deepgemm_shapes(vllm_config.model_config.hf_text_config.to_dict(), tp)  # []: only this shape is known
    cold = [s for s in shapes if not is_prepared(cache, setup, s.n, s.k, max_tokens)]
    if cold:
        kernels = sum(len(deepgemm_warmup_m_values(s.n, max_tokens, device)) for s in cold)
        what = f"{len(cold)} layer shapes: {', '.join(f'N={s.n} K={s.k}' for s in cold)}"
        shapes_arg = ",".join(f"{s.n}x{s.k}" for s in cold)
    else:
        what = f"N={n} K={k}, and as many again for each other shape of this model not prepared"
        shapes_arg = f"{n}x{k},... (each `DeepGEMM warm-up N= K=` this engine logs)"
    source = f"--model {model}" if Path(model).is_dir() else f"--shapes {shapes_arg}"
    logger.warning(
        "fp8_align: DeepGEMM's JIT cache %s is not marked prepared for this engine (%s, up to %d batched tokens): "
        "this start compiles up to %d DeepGEMM kernels one after another (~%.1f s each on an H100, ~%.0f min) before "
        "the engine serves. DeepGEMM stays the GEMM. Next time, fill the cache ahead in parallel (once per GPU model and "
        "vLLM version): `fp8-align prepare-deepgemm %s --cache-dir %s --max-num-batched-tokens %d%s` and start the "
        "engine with %s=%s",
        cache, what, max_tokens, kernels, DEEPGEMM_COMPILE_S, kernels * DEEPGEMM_COMPILE_S / 60, source, cache,
        max_tokens, f" --tensor-parallel-size {tp}" if tp > 1 else "", JIT_CACHE_ENV_VAR, cache,
    )  # fmt: skip


#: (cache directory, model, max_num_batched_tokens) whose parallel fill failed in this process.
_FILLS_FAILED: set[tuple[str, str, int]] = set()
#: (cache directory, N, K) of the shapes cold at this start and filled by a fill this process ran or waited for.
_FILLED_AT_START: set[tuple[str, int, int]] = set()


def fill_cold_cache(vllm_config: VllmConfig, cache: Path, setup: str, n: int, k: int, device: torch.device) -> bool:
    """Compile every cold DeepGEMM shape of the engine's model ahead of the warm-ups, in parallel
    processes (`fill`: `fp8-align prepare-deepgemm` as a child process, under the cache's
    lock so that one tensor-parallel rank fills and the others wait); True when [n, k] is marked
    prepared afterwards. A failed fill is warned about with its reason, once per engine setting
    and process, and returns False: the warm-ups then compile one kernel after another."""
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    tp = vllm_config.parallel_config.tensor_parallel_size
    key = (str(cache), str(vllm_config.model_config.model), max_tokens)
    if key in _FILLS_FAILED:
        return False
    config = vllm_config.model_config.hf_text_config.to_dict()
    cold_at_start = cold_shapes(config, tp, cache, setup, max_tokens, n, k)
    with fill_lock(cache):
        cold = cold_shapes(config, tp, cache, setup, max_tokens, n, k)
        if cold:  # else another rank filled them while this one waited
            index = device.index if device.index is not None else torch.cuda.current_device()
            jobs = compile_jobs(cold, max_tokens, torch.cuda.mem_get_info(index)[0], os.cpu_count() or 1)
            command = fill_command(cold, cache, max_tokens, jobs, index)
            logger.warning(
                "fp8_align: DeepGEMM's JIT cache %s is not marked prepared for this engine (%s, up to %d batched tokens): "
                "compiling their %d kernels in %d parallel processes before the engine serves (`%s`). DeepGEMM stays the "
                "GEMM. Next time start with the cache filled ahead (the same `fp8-align prepare-deepgemm`, once per GPU "
                "model and vLLM version) and %s=%s",
                cache, ", ".join(f"N={s.n} K={s.k}" for s in cold), max_tokens,
                sum(len(deepgemm_warmup_m_values(s.n, max_tokens, device)) for s in cold), jobs,
                " ".join(["fp8-align", *command[3:]]), JIT_CACHE_ENV_VAR, cache,
            )  # fmt: skip
            reason = run_fill(command)
            if reason is not None:
                _FILLS_FAILED.add(key)
                logger.warning(
                    "fp8_align: filling DeepGEMM's JIT cache %s in parallel failed (%s); the warm-up compiles its kernels "
                    "one after another instead", cache, reason,
                )  # fmt: skip
                return False
    _FILLED_AT_START.update((str(cache), s.n, s.k) for s in cold_at_start if is_prepared(cache, setup, s.n, s.k, max_tokens))
    return is_prepared(cache, setup, n, k, max_tokens)


def warm_up(layer: torch.nn.Module, run_for_m_values: Callable[[torch.nn.Module, list[int]], None]) -> None:
    """JIT-compile DeepGEMM for every M the engine can run `layer`'s [N, K] with, through
    `run_for_m_values(layer, m_values)` (the backend's GEMM once per M).

    DeepGEMM compiles a kernel per (N, K, M-dependent tiling) on first use; vLLM warms its
    own FP8 layers up at start (`deep_gemm_warmup`, M values per VLLM_DEEP_GEMM_WARMUP) but
    not ours, so without this the compiles land inside generate calls. Same M values, our
    call path (FP32 scales, TMA-aligned activation scales), once per [N, K]. Needs the
    engine's config (max_num_batched_tokens): outside an engine (unit tests, weight reload,
    which reuses the compiled kernels) nothing is compiled ahead. Kernels already in
    DeepGEMM's JIT cache (DG_JIT_CACHE_DIR) are loaded, not compiled: `fp8-align
    prepare-deepgemm` fills it ahead, in parallel. A shape the cache is not marked prepared
    for (`inventory.is_prepared`) is filled first, with every other cold shape of
    the model, by that command run at this start (`fill_cold_cache`, a warning naming it);
    where that fails, a warning, and the kernels compile here one after another. Once
    warmed up a shape is marked, so the next engine start with that cache loads it.
    """
    n, k = layer.weight.shape
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or envs.VLLM_DEEP_GEMM_WARMUP == "skip" or was_warmed_up(n, k):
        return
    device = layer.weight.device
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    cache, setup = jit_cache_dir(envs.VLLM_CACHE_ROOT), deepgemm_cache_setup(device)
    ahead = is_prepared(cache, setup, n, k, max_tokens)
    prepared = ahead or fill_cold_cache(vllm_config, cache, setup, n, k, device)
    m_values = deepgemm_warmup_m_values(n, max_tokens, device)
    if not prepared:
        warn_cold_cache(vllm_config, cache, setup, n, k, len(m_values), device)
    start = time.perf_counter()
    run_for_m_values(layer, m_values)
    seconds = time.perf_counter() - start
    if not prepared:
        try:
            mark_prepared(cache, setup, n, k, max_tokens)
        except OSError as exc:  # a read-only cache: the engine runs, the next start warns again
            logger.warning("fp8_align: could not mark N=%d K=%d prepared in DeepGEMM's JIT cache %s: %s", n, k, cache, exc)
    filled = prepared and (not ahead or (str(cache), n, k) in _FILLED_AT_START)
    note_warmup(Warmup(n, k, len(m_values), prepared, seconds, str(cache), filled_at_start=filled))
    logger.info(
        "fp8_align: DeepGEMM warm-up N=%d K=%d: %d M values in %.1f s (%s)",
        n, k, len(m_values), seconds, "JIT cache marked prepared" if prepared else "not marked prepared: compiled where missing",
    )  # fmt: skip
    if prepared and seconds > DEEPGEMM_COLD_WARMUP_S:
        logger.warning(
            "fp8_align: DeepGEMM's JIT cache %s was marked prepared for N=%d K=%d but its warm-up took %.1f s: its "
            "kernels were compiled again (cache files removed, or another DeepGEMM or CUDA build); run "
            "`fp8-align prepare-deepgemm` into it again",
            cache, n, k, seconds,
        )  # fmt: skip
