"""fp8_align's calls into every vLLM worker: all replies read, a worker's exception raised here.

vLLM's executors (0.22 to 0.32, multiprocessing and Ray workers alike) stop reading replies at the
first worker whose call raised and leave the other workers' replies queued, so every later
`collective_rpc` of that engine would return a stale reply from those workers
(vllm-project/vllm#49972). `call_workers` runs the worker function so that its exception comes
back as the worker's reply (`WorkerError`); once every worker has replied, the first worker's
exception is raised in the caller, with its own type and message.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerError:
    """A worker function's exception, returned as that worker's reply."""

    error: Exception


def call_workers(llm: Any, function: Callable[..., Any], args: Sequence[Any] = ()) -> list[Any]:
    """`function(worker, *args)` in every worker of `llm` (a `vllm.LLM`; needs
    VLLM_ALLOW_INSECURE_SERIALIZATION=1); returns one reply per worker, in rank order.

    Raises the exception of the first worker that raised (its type and message; notes name the
    workers that raised and carry that worker's traceback) after every worker's reply was read,
    so the engine's next all-worker call reads fresh replies.
    """
    replies = llm.collective_rpc(_reply_or_error, args=(function, *args))
    failed = [rank for rank, reply in enumerate(replies) if isinstance(reply, WorkerError)]
    if failed:
        error = replies[failed[0]].error
        error.add_note(f"raised in worker(s) {failed} of {len(replies)}")
        raise error
    return replies


def _reply_or_error(worker: Any, function: Callable[..., Any], *args: Any) -> Any:
    """Worker side: `function(worker, *args)`, or its exception as a `WorkerError` (one that cannot
    be pickled back becomes a RuntimeError with its type, message and traceback)."""
    try:
        return function(worker, *args)
    except Exception as error:
        trace = traceback.format_exc()
        try:
            pickle.dumps(error)
        except Exception:
            return WorkerError(RuntimeError(f"{type(error).__name__}: {error}\n{trace}"))
        error.add_note(f"worker traceback:\n{trace}")
        return WorkerError(error)
