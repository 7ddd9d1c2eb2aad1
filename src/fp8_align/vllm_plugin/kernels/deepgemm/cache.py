"""DeepGEMM's JIT cache, filled ahead of an engine start by compile processes running in parallel.

An engine whose fp8_align layers run on DeepGEMM needs one compiled kernel per ([N, K], M) it
can run (`DeepGemmBlockFp8Kernel.warm_up` at engine start, over the M values vLLM's
VLLM_DEEP_GEMM_WARMUP picks). DeepGEMM compiles them with NVRTC one after another in the worker
(~0.8 s each on an H100; about 1,700 for an 8B model at vLLM's default 16,384 batched tokens)
and keeps each in DG_JIT_CACHE_DIR (vLLM's default: $VLLM_CACHE_ROOT/deep_gemm) under a key of
its generated source and compiler, so a cache that the same calls filled on the same GPU model
with the same vLLM turns the engine's warm-up into loads.

`prepare_deepgemm_cache` makes those calls (`DeepGemmBlockFp8Kernel.run_for_m_values`, the
engine's own) split over `jobs` processes and marks each shape prepared
(`inventory.mark_prepared`), which the engine checks before its warm-up; `fp8-align
prepare-deepgemm` is its command line. The shapes come from `inventory`
(`decoder_linear_shapes`, `parse_shapes`); the engine logs the shapes it warmed up
(`DeepGEMM warm-up N= K=`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

from fp8_align.vllm_plugin.kernels.base import BLOCK
from fp8_align.vllm_plugin.kernels.deepgemm.inventory import (
    DEFAULT_MAX_BATCHED_TOKENS,
    JIT_CACHE_ENV_VAR,
    ExpertShape,
    LinearShape,
    compile_jobs,
    grouped_m_values,
    jit_cache_dir,
    mark_prepared,
)

logger = logging.getLogger("vllm.fp8_align")


def split_work(m_values: Mapping[tuple[int, int], list[int]], jobs: int) -> list[dict[str, list[int]]]:
    """Deal each [N, K]'s M values round-robin to `jobs` workers: worker j gets {"NxK": [M...]}."""
    work: list[dict[str, list[int]]] = [{} for _ in range(jobs)]
    turn = 0
    for (n, k), values in m_values.items():
        for m in values:
            work[turn % jobs].setdefault(f"{n}x{k}", []).append(m)
            turn += 1
    return [w for w in work if w]


def split_grouped_work(m_values: Mapping[str, list[int]], jobs: int) -> list[dict[str, list[int]]]:
    """Cut each grouped weight's M values ({"g<E>x<N>x<K>": [M...]}, ascending) into `jobs`
    contiguous runs, worker j getting run j of each: DeepGEMM's grouped kernels change with M
    only in steps, so a worker compiles the few its run spans instead of all of them."""
    work: list[dict[str, list[int]]] = [{} for _ in range(jobs)]
    for key, values in m_values.items():
        size = -(-len(values) // jobs)
        for j in range(jobs):
            if run := values[j * size : (j + 1) * size]:
                work[j][key] = run
    return [w for w in work if w]


#: A compile process's output line for each kernel: "compiled <work key> <M> <seconds>".
COMPILED_PREFIX = "compiled "


@dataclass
class WorkerRun:
    """One compile process's end: exit code, output other than its "compiled" lines, the seconds
    those lines report, and the (work key, M) calls they name."""

    code: int
    output: str
    seconds: float
    done: set[tuple[str, int]]


def run_compile_workers(
    parts: Sequence[dict[str, list[int]]], argv: Callable[[dict[str, list[int]]], list[str]],
    env: Mapping[str, str], on_kernel: Callable[[int], Any],
) -> list[WorkerRun]:  # fmt: skip
    """Start one process per part (`argv(part)`, environment `env`) at once, call `on_kernel(1)`
    for each "compiled <key> <M> <seconds>" line it prints, and wait for all of them."""
    procs = [subprocess.Popen(argv(part), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(env))
             for part in parts]  # fmt: skip
    runs = [WorkerRun(0, "", 0.0, set()) for _ in parts]
    lock = threading.Lock()

    def follow(index: int) -> None:
        run, lines = runs[index], []
        for line in procs[index].stdout:
            if line.startswith(COMPILED_PREFIX):
                key, m, seconds = line.split()[1:4]
                run.seconds += float(seconds)
                run.done.add((key, int(m)))
                with lock:
                    on_kernel(1)
            else:
                lines.append(line)
        run.output = "".join(lines)

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(len(procs))]
    for thread in threads:
        thread.start()
    for run, proc, thread in zip(runs, procs, threads):
        run.code = proc.wait()
        thread.join()
    return runs


def remaining_work(part: Mapping[str, list[int]], done: set[tuple[str, int]]) -> dict[str, list[int]]:
    """The calls of `part` ({key: [M...]}) not in `done`, keys left without any dropped."""
    left = {key: [m for m in values if (key, m) not in done] for key, values in part.items()}
    return {key: values for key, values in left.items() if values}


def out_of_device_memory(output: str) -> bool:
    """Whether a compile process's output ends in torch's CUDA out-of-memory error."""
    return "torch.OutOfMemoryError" in output or "CUDA out of memory" in output


def compile_in_processes(
    work: Sequence[dict[str, list[int]]], argv: Callable[[dict[str, list[int]]], list[str]],
    env: Mapping[str, str], on_kernel: Callable[[int], Any],
) -> float:  # fmt: skip
    """Run `work` in one process per part (`run_compile_workers`); processes that ran out of device
    memory (their peaks can coincide: a grouped-GEMM worker reaches about 8 GiB on an H100, more
    than `compile_jobs` allows for) get their calls not yet made run again once the others have
    ended, in as many processes, with a WARNING. Returns the summed seconds of every call.
    Raises RuntimeError with a failed process's output when one fails otherwise, or again in the
    second round."""
    runs = run_compile_workers(work, argv, env, on_kernel)
    seconds = sum(run.seconds for run in runs)
    failed = [i for i, run in enumerate(runs) if run.code != 0]
    if failed and all(out_of_device_memory(runs[i].output) for i in failed):
        retry = [left for i in failed if (left := remaining_work(work[i], runs[i].done))]
        logger.warning(
            "fp8_align: %d of %d DeepGEMM compile processes ran out of device memory; their %d calls not yet made "
            "run again in %d processes now that the others have ended (--jobs sets fewer processes)",
            len(failed), len(work), sum(len(v) for part in retry for v in part.values()), len(retry),
        )  # fmt: skip
        again = run_compile_workers(retry, argv, env, on_kernel)
        seconds += sum(run.seconds for run in again)
        if failed_again := [run for run in again if run.code != 0]:
            run = failed_again[0]
            raise RuntimeError(f"a DeepGEMM compile process failed again after running out of device memory "
                               f"(pass --jobs with fewer processes), exit {run.code}:\n{run.output[-4000:]}")  # fmt: skip
    elif failed:
        i = failed[0]
        raise RuntimeError(f"DeepGEMM compile worker {i} exited with {runs[i].code}:\n{runs[i].output[-4000:]}")
    return seconds


def prepare_deepgemm_cache(
    shapes: list[LinearShape],
    max_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
    jobs: int | None = None,
    cache_dir: Path | None = None,
    device_index: int = 0,
    experts: Sequence[ExpertShape] = (),
) -> dict[str, Any]:
    """Compile DeepGEMM's kernels for `shapes` at every warm-up M up to `max_tokens`, in `jobs`
    processes (default `compile_jobs`: one per CPU up to 16, within half the free device memory)
    on CUDA device `device_index`, into `cache_dir` (default: DG_JIT_CACHE_DIR, else
    vLLM's $VLLM_CACHE_ROOT/deep_gemm), then mark each shape prepared there for this GPU model,
    vLLM and VLLM_DEEP_GEMM_WARMUP (what an engine with at most `max_tokens` batched tokens checks).
    `experts`: routed-expert weights whose grouped-GEMM kernels vLLM's start-up warm-up compiles
    (`grouped_m_values`; FP32 scales as fp8_align keeps them, VLLM_USE_DEEP_GEMM_E8M0=0 as its
    engines run), compiled in the same processes; vLLM's warm-up then loads them (no mark: vLLM
    does not look for one).

    Returns a report: cache_dir, shapes, kernels (calls made), wall_s, and compile_s_sum (the
    workers' summed per-call seconds: what an engine's serial warm-up spends on a cold cache).
    Raises RuntimeError with a worker's output when one fails (processes that ran out of device
    memory get one more round first: `compile_in_processes`; nothing is marked then),
    ValueError when no shape can run on DeepGEMM or no CUDA GPU is there.
    """
    import torch
    from tqdm.auto import tqdm
    from vllm import envs

    # imported here: kernels.gpu loads vLLM's CUDA kernels (shape parsing runs anywhere)
    from fp8_align.vllm_plugin.kernels.deepgemm.warmup import deepgemm_cache_setup, deepgemm_warmup_m_values

    eligible = [s for s in shapes if s.runs_on_deepgemm]
    grouped = [e for e in experts if e.runs_on_deepgemm]
    if not eligible and not grouped:
        raise ValueError(f"no shape runs on DeepGEMM (K and every shard multiples of {BLOCK}): {shapes} {list(experts)}")
    if not torch.cuda.is_available():
        raise ValueError("DeepGEMM's kernels compile on a CUDA GPU, of the model the engines run on (SM90); this machine has none")
    cache = Path(cache_dir).resolve() if cache_dir is not None else jit_cache_dir(envs.VLLM_CACHE_ROOT)
    cache.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", device_index)
    m_values = {(s.n, s.k): deepgemm_warmup_m_values(s.n, max_tokens, device) for s in eligible}
    grouped_m = {e.work_key: grouped_m_values(e, max_tokens) for e in grouped}
    total = sum(map(len, m_values.values())) + sum(map(len, grouped_m.values()))
    jobs = jobs or compile_jobs(eligible, max_tokens, torch.cuda.mem_get_info(device)[0], os.cpu_count() or 1, grouped)
    dense_work, grouped_work = split_work(m_values, jobs), split_grouped_work(grouped_m, jobs)
    work = [{**dense, **grouped} for dense, grouped in zip_longest(dense_work, grouped_work, fillvalue={})]
    # FP32 expert scales as fp8_align keeps them: vLLM's grouped wrapper casts to UE8M0 unless this is 0
    env = {**os.environ, JIT_CACHE_ENV_VAR: str(cache), **({"VLLM_USE_DEEP_GEMM_E8M0": "0"} if grouped else {})}
    start = time.perf_counter()
    bar = tqdm(total=total, desc=f"DeepGEMM kernels ({len(work)} processes)", unit="kernel")

    def argv(part: dict[str, list[int]]) -> list[str]:
        return [sys.executable, "-m", __name__, "--worker", json.dumps(part), str(device_index)]

    compile_s = compile_in_processes(work, argv, env, bar.update)
    bar.close()
    setup = deepgemm_cache_setup(device)
    for shape in eligible:
        mark_prepared(cache, setup, shape.n, shape.k, max_tokens)
    return {
        "cache_dir": str(cache),
        "shapes": [{"name": s.name, "n": s.n, "k": s.k, "m_values": len(m_values[(s.n, s.k)])} for s in eligible],
        "experts": [{"name": e.name, "experts": e.experts, "n": e.n, "k": e.k, "m_values": len(grouped_m[e.work_key])}
                    for e in grouped],  # fmt: skip
        "skipped_shapes": [s.name for s in shapes if not s.runs_on_deepgemm],
        "max_tokens": max_tokens,
        "jobs": len(work),
        "kernels": total,
        "wall_s": round(time.perf_counter() - start, 2),
        "compile_s_sum": round(compile_s, 2),
        "device": torch.cuda.get_device_name(device),
    }


def _worker(part: dict[str, list[int]], device_index: int) -> None:
    """Run the engine's DeepGEMM warm-up calls for {"NxK": [M...]}; print one line per call."""
    import types

    import torch

    # imported here: kernels.gpu loads vLLM's CUDA kernels (this runs in a GPU compile process)
    from fp8_align.vllm_plugin.kernels.gpu import DeepGemmBlockFp8Kernel

    device = torch.device("cuda", device_index)
    kernel = DeepGemmBlockFp8Kernel()
    for shape, values in part.items():
        if shape.startswith("g"):
            _grouped_worker(shape, values, device)
            continue
        n, k = map(int, shape.split("x"))
        layer = types.SimpleNamespace(
            weight=torch.zeros((n, k), dtype=torch.float8_e4m3fn, device=device),
            weight_scale_inv=torch.ones((n // BLOCK, k // BLOCK), dtype=torch.float32, device=device),
        )
        for m in values:
            start = time.perf_counter()
            kernel.run_for_m_values(layer, [m])
            print(f"{COMPILED_PREFIX}{shape} {m} {time.perf_counter() - start:.4f}", flush=True)


def _grouped_worker(shape: str, m_values: list[int], device: Any) -> None:
    """vLLM's start-up warm-up calls of DeepGEMM's grouped GEMM for "g<E>x<N>x<K>" at each M
    (contiguous layout: rows in blocks of 128, each block one random expert); one line per call."""
    import torch

    # imported here: vLLM's DeepGEMM wrapper loads its CUDA module (this runs in a GPU compile process)
    from vllm.utils.deep_gemm import m_grouped_fp8_gemm_nt_contiguous

    experts, n, k = map(int, shape[1:].split("x"))
    weight = torch.zeros((experts, n, k), dtype=torch.float8_e4m3fn, device=device)
    weight_scale = torch.ones((experts, n // BLOCK, k // BLOCK), dtype=torch.float32, device=device)
    rows = max(m_values)
    x = torch.zeros((rows, k), dtype=torch.float8_e4m3fn, device=device)
    x_scale = torch.ones((rows, k // BLOCK), dtype=torch.float32, device=device)
    out = torch.empty((rows, n), dtype=torch.bfloat16, device=device)
    blocks = torch.randint(0, experts, (rows // BLOCK,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    expert_ids = blocks.repeat_interleave(BLOCK).to(device)
    for m in m_values:
        start = time.perf_counter()
        m_grouped_fp8_gemm_nt_contiguous((x[:m], x_scale[:m]), (weight, weight_scale), out[:m], expert_ids[:m])
        torch.cuda.synchronize(device)
        print(f"{COMPILED_PREFIX}{shape} {m} {time.perf_counter() - start:.4f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit("usage: python -m fp8_align.vllm_plugin.kernels.deepgemm.cache --worker JSON DEVICE (run by prepare_deepgemm_cache)")
