"""The bitwise megatron-core GPTModel under Megatron tensor parallel size 2, on CPU: two processes
(gloo), real megatron-core 0.19.2 with its own tensor-parallel layers' communication (the
column-parallel input gradients' all-reduce, the row-parallel partial sums' all-reduce, the
vocabulary-parallel embedding and the output layer's all-gather), each rank building its share
with `build_bitwise_gpt`. Reference: `BitwiseForward(tensor_parallel_size=2)`, which computes what
each of an engine's two ranks computes on one device (the engine side proven on GPUs for the HF
trainer). On CPU every engine op runs its pure-torch reference on both sides, so this checks the
sharding, the collectives and the gradient path; the engine itself is the GPU's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8_align.hf_training import BitwiseForward
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES
from tests.ranks import spawn_ranks

pytest.importorskip("megatron.core")

from fp8_align.megatron_ext.hf_bridge import hf_state_dict_from_megatron, merge_tensor_parallel_shards  # noqa: E402
from tests.megatron_tp_ranks import FP8, TEMPERATURE, WORLD_SIZE, check_ranks_against_bitwise_forward, run_rank  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _cpu_rank(rank: int, port: int, out: Path) -> None:
    run_rank(rank, port, out, "cpu")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Per rank, per model kind: its log-probs at T = 0.6, its parameters and their gradients."""
    return spawn_ranks(_cpu_rank, WORLD_SIZE, tmp_path_factory.mktemp("megatron_tp"))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_each_rank_has_the_engine_ranks_share_and_the_tp2_bits(ranks: list[dict], kind: str) -> None:
    check_ranks_against_bitwise_forward(ranks, kind, torch.device("cpu"))


def test_the_shards_merge_back_to_the_hf_weights(ranks: list[dict]) -> None:
    """`merge_tensor_parallel_shards` of the two ranks' parameters, mapped to HF names, is the HF
    checkpoint the ranks were built from (what a weight sync of a TP=2 model sends)."""
    hf = tiny_hf_model("qwen3")
    merged = merge_tensor_parallel_shards([result["qwen3"]["weights"] for result in ranks], hf.config.vocab_size)
    back = hf_state_dict_from_megatron(merged, hf.config, fused_norms=False)
    state = hf.state_dict()
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_the_tensor_parallel_scorer_gives_the_tp2_bits(tmp_path: Path) -> None:
    """`on_policy_bitwise.py --scorer megatron --tensor-parallel-size 2`'s scorer (one process per
    Megatron rank, the checkpoint loaded from disk): BitwiseForward(tensor_parallel_size=2)'s
    log-probs; a bad request raises with the rank's traceback."""
    from benchmarks.megatron_scorer import MegatronTensorParallelScorer

    hf = tiny_hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    expected = BitwiseForward(hf, FP8, tensor_parallel_size=2).token_logprobs(SEQUENCES, PROMPT_LENS, temperature=TEMPERATURE)
    scorer = MegatronTensorParallelScorer(tmp_path, FP8, None, "cpu")
    try:
        mine = scorer.token_logprobs(SEQUENCES, PROMPT_LENS, temperature=TEMPERATURE)
        assert len(mine) == len(expected) and all(torch.equal(a, b.detach()) for a, b in zip(mine, expected))
        with pytest.raises(RuntimeError, match="Megatron rank [01] failed:(.|\n)*prompt_len 12 is outside"):
            scorer.token_logprobs(SEQUENCES, [len(s) for s in SEQUENCES])
    finally:
        scorer.close()
