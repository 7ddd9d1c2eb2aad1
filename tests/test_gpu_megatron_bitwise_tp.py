"""The bitwise megatron-core GPTModel under Megatron tensor parallel size 2 on two GPUs (gpu marker;
NCCL, megatron-core required): tests/test_megatron_bitwise_tp.py's checks (tests/megatron_tp_ranks.py)
with the engine's kernels on both sides, so each rank's log-probs equal `BitwiseForward(tensor_parallel_size=2)`'s
(which computes what each rank of a TP=2 bitwise engine computes) and its gradients equal that
reference's shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ranks import spawn_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
pytest.importorskip("megatron.core")

from tests.megatron_tp_ranks import WORLD_SIZE, check_ranks_against_bitwise_forward, run_rank  # noqa: E402


def _cuda_rank(rank: int, port: int, out: Path) -> None:
    run_rank(rank, port, out, "cuda")


def test_each_rank_gives_the_tp2_engines_bits_on_cuda(tmp_path: Path) -> None:
    ranks = spawn_ranks(_cuda_rank, WORLD_SIZE, tmp_path)
    for kind in ("llama", "qwen3"):
        check_ranks_against_bitwise_forward(ranks, kind, torch.device("cuda", 0))
