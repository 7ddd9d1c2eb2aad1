"""Filling a cold DeepGEMM JIT cache at engine start, in parallel compile processes.

An engine's DeepGEMM warm-up (`kernels.gpu.DeepGemmBlockFp8Kernel.warm_up`) compiles the kernels
its cache lacks one after another, ~0.8 s each on an H100 (about 1,700 for an 8B model: over 20
minutes). When the cache is not marked prepared for this engine, the first warm-up instead runs
`fp8-align prepare-deepgemm` for every cold shape of the model as a child process (the command
splits the M values over `inventory.compile_jobs` processes on the engine's GPU and marks each shape), and
the warm-ups then load what it compiled. Tensor-parallel ranks of one machine share the cache
directory: `fill_lock` lets one rank fill while the others wait and then find the marks.
The command runs as a child process: its compile processes get CUDA contexts of their own, and
it loads `kernels.gpu`, which loads this module.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fp8_align.vllm_plugin.kernels.deepgemm.inventory import MARKS_DIR, LinearShape, decoder_linear_shapes, is_prepared


def model_deepgemm_shapes(config: Mapping[str, Any], tensor_parallel_size: int) -> list[LinearShape]:
    """The shapes of `decoder_linear_shapes(config)` that run on DeepGEMM; [] for a model it does not describe."""
    try:
        return [s for s in decoder_linear_shapes(config, tensor_parallel_size) if s.runs_on_deepgemm]
    except (ValueError, KeyError):
        return []


def cold_shapes(config: Mapping[str, Any], tensor_parallel_size: int, cache: Path, setup: str, max_tokens: int, n: int, k: int) -> list[LinearShape]:
    """The DeepGEMM shapes of the engine's model (`model_deepgemm_shapes`) not marked prepared in
    `cache`; for a model it does not describe, [n, k] alone (the layer warming up)."""
    shapes = model_deepgemm_shapes(config, tensor_parallel_size)
    if (n, k) not in {(s.n, s.k) for s in shapes}:
        shapes.append(LinearShape(f"{n}x{k}", n, k, (n,)))
    return [s for s in shapes if not is_prepared(cache, setup, s.n, s.k, max_tokens)]


@contextmanager
def fill_lock(cache: Path) -> Iterator[None]:
    """Hold an exclusive lock on `cache`'s marks directory (created) until the block ends."""
    marks = cache / MARKS_DIR
    marks.mkdir(parents=True, exist_ok=True)
    with open(marks / ".fill.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fill_command(shapes: list[LinearShape], cache: Path, max_tokens: int, jobs: int, device_index: int) -> list[str]:
    """The `fp8-align prepare-deepgemm` command line that compiles `shapes` into `cache`."""
    return [
        sys.executable, "-m", "fp8_align.cli", "prepare-deepgemm", "--shapes", ",".join(f"{s.n}x{s.k}" for s in shapes),
        "--cache-dir", str(cache), "--max-num-batched-tokens", str(max_tokens), "--jobs", str(jobs), "--device", str(device_index),
    ]  # fmt: skip


def run_fill(command: list[str]) -> str | None:
    """Run `fill_command`'s command with its progress bar passed through to this process's
    stderr; None when it succeeded, else why not (exit status and the end of its error output)."""
    try:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    except OSError as exc:
        return f"could not start it: {exc}"
    assert proc.stderr is not None
    tail = ""
    while chunk := os.read(proc.stderr.fileno(), 4096):
        text = chunk.decode(errors="replace")
        sys.stderr.write(text)
        sys.stderr.flush()
        tail = (tail + text)[-1500:]
    if proc.wait() != 0:
        return f"it exited with {proc.returncode}: {tail.strip()}"
    return None
