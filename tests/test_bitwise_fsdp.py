"""`make_bitwise` under PyTorch's FSDP2 (`fully_shard`), as FSDP stacks train: two CPU processes
(gloo), each decoder layer and the root sharded over both, BF16 weights all-gathered before each
layer's forward and gradients reduce-scattered after its backward. On every rank the converted
model's log-probs equal the unsharded converted model's bit for bit, and so does every
parameter's gradient (both ranks score the same sequences, so the averaged BF16 gradient is the
unsharded one exactly); inside `frozen_fp8_weights` (two micro-batches, each all-gathered and
resharded) the log-probs are those bits again. Runs the CPU reference ops; the sharding plumbing is
what is checked.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from fp8_align.config import FP8Config
from fp8_align.hf_training import frozen_fp8_weights, make_bitwise
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES, completion_logprobs_from_logits, packed_inputs, packed_rows
from tests.ranks import spawn_ranks

WORLD_SIZE = 2


def _completion_logprobs(model: torch.nn.Module) -> torch.Tensor:
    """The completion tokens' log-probs of SEQUENCES packed into one row, from the model's logits."""
    logits = model(**packed_inputs(SEQUENCES)).logits[0]
    return completion_logprobs_from_logits(logits, SEQUENCES, PROMPT_LENS, packed_rows(SEQUENCES))


def _rank(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        cfg = FP8Config(on_policy="bitwise", precision="fp8")
        model = tiny_hf_model("qwen3")
        reference = copy.deepcopy(model)
        make_bitwise(model, cfg)
        make_bitwise(reference, cfg)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        sharded = _completion_logprobs(model)
        sharded.sum().backward()
        unsharded = _completion_logprobs(reference)
        unsharded.sum().backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        want = {name: p.grad for name, p in reference.named_parameters()}
        with frozen_fp8_weights(model):  # micro-batches between two optimizer steps: all-gathered, resharded
            frozen = [_completion_logprobs(model) for _ in range(2)]
            for logprobs in frozen:
                logprobs.sum().backward()
        torch.save({
            "logprobs_equal": torch.equal(sharded.detach(), unsharded.detach()),
            "frozen_logprobs_equal": all(torch.equal(logprobs.detach(), unsharded.detach()) for logprobs in frozen),
            "unequal_grads": sorted(name for name in want if not torch.equal(grads[name], want[name])),
            "names_equal": grads.keys() == want.keys(),
        }, out / f"rank{rank}.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_model_gives_the_unsharded_bits_and_gradients(tmp_path: Path) -> None:
    for rank, result in enumerate(spawn_ranks(_rank, WORLD_SIZE, tmp_path)):
        assert result["logprobs_equal"], rank
        assert result["frozen_logprobs_equal"], rank
        assert result["names_equal"], rank
        assert result["unequal_grads"] == [], (rank, result["unequal_grads"])
