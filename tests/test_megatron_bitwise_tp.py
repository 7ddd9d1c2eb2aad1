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
import torch.distributed as dist

from fp8_align.config import FP8Config
from fp8_align.hf_training import BitwiseForward
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES
from tests.ranks import spawn_ranks

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402

from fp8_align.megatron_ext.bitwise import build_bitwise_gpt, token_logprobs  # noqa: E402
from fp8_align.megatron_ext.hf_bridge import (  # noqa: E402
    hf_state_dict_from_megatron, megatron_state_dict_from_hf, merge_tensor_parallel_shards, tensor_parallel_shard,
)  # fmt: skip

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORLD_SIZE = 2
FP8 = FP8Config(on_policy="bitwise", precision="fp8")
#: The tiny models' vocabulary (1000) padded to a multiple of 64, as the engine and the TP=2 build pad it.
PADDED_VOCAB = 1024
TEMPERATURE = 0.6
QK_NORMS = ("q_layernorm.weight", "k_layernorm.weight")


def run_rank(rank: int, port: int, out: Path, device_type: str) -> None:
    """One Megatron rank of tensor parallel size 2 (gloo on CPU, NCCL on GPU `rank`): per model kind
    its bitwise GPTModel's log-probs at T = 0.6 and, after their sum's backward, its parameters and
    gradients, saved on the host to `out / f"rank{rank}.pt"`."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        parallel_state.initialize_model_parallel(WORLD_SIZE, 1)
        result = {}
        for kind in ("llama", "qwen3"):
            model = build_bitwise_gpt(tiny_hf_model(kind).to(device), FP8)
            model.train()
            logprobs = torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS, temperature=TEMPERATURE))
            logprobs.sum().backward()
            result[kind] = {
                "logprobs": logprobs.detach().cpu(),
                "weights": {name: p.detach().cpu() for name, p in model.named_parameters()},
                "grads": {name: p.grad.cpu() for name, p in model.named_parameters()},
            }
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _cpu_rank(rank: int, port: int, out: Path) -> None:
    run_rank(rank, port, out, "cpu")


def check_ranks_against_bitwise_forward(ranks: list[dict], kind: str, device: torch.device) -> None:
    """Each rank holds the engine rank's share of the weights (`tensor_parallel_shard` of the whole
    model), both ranks' log-probs are BitwiseForward's at tensor_parallel_size=2 on `device`, and so
    is every local gradient (its HF gradients, mapped and sharded the same way) but Qwen3's q/k-norm
    weights', whose two ranks' partial gradients sum to it within BF16 rounding."""
    hf = tiny_hf_model(kind).to(device)
    reference = BitwiseForward(hf, FP8, tensor_parallel_size=2)
    expected = torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS, temperature=TEMPERATURE))
    expected.sum().backward()
    whole_weights = megatron_state_dict_from_hf({n: t.cpu() for n, t in hf.state_dict().items()}, hf.config, fused_norms=False)
    whole_grads = megatron_state_dict_from_hf({name: p.grad.cpu() for name, p in hf.named_parameters()}, hf.config, fused_norms=False)
    for rank, result in enumerate(ranks):
        mine = result[kind]
        assert torch.equal(mine["logprobs"], expected.detach().cpu()), rank
        weights = tensor_parallel_shard(whole_weights, rank, WORLD_SIZE, PADDED_VOCAB)
        grads = tensor_parallel_shard(whole_grads, rank, WORLD_SIZE, PADDED_VOCAB)
        assert mine["weights"].keys() == weights.keys()
        for name, weight in weights.items():
            assert torch.equal(mine["weights"][name], weight), (rank, name)
            if not name.endswith(QK_NORMS):
                assert torch.equal(mine["grads"][name], grads[name]), (rank, name)
    for name in (n for n in whole_grads if n.endswith(QK_NORMS)):
        partials = [result[kind]["grads"][name] for result in ranks]
        assert not torch.equal(partials[0], whole_grads[name]), name
        # Each rank's q/k-norm gradient covers its own heads; megatron-core's finalize_model_grads
        # sums the ranks' (qk_layernorm under TP). Two BF16-rounded partial sums added against one
        # BF16 sum: measured at most 1 BF16 ulp of the largest entry (0.0039 of 0.59); bound 4 ulps.
        bound = 2**-6 * whole_grads[name].float().abs().max().item()
        torch.testing.assert_close(partials[0] + partials[1], whole_grads[name], rtol=0, atol=bound, msg=name)


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
