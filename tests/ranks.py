"""Two-process CPU tests (gloo): spawn the ranks on a free local port and collect what each saved."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def spawn_ranks(rank_fn: Callable[[int, int, Path], None], world_size: int, out: Path) -> list[dict[str, Any]]:
    """Run `rank_fn(rank, port, out)` in `world_size` spawned processes (`port`: a free local TCP
    port for the process group) and return, per rank, the dict it saved to `out / f"rank{rank}.pt"`."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(rank_fn, args=(port, out), nprocs=world_size)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world_size)]
