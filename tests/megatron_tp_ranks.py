"""The two Megatron ranks of the tensor-parallel bitwise tests (tests/test_megatron_bitwise_tp.py on
CPU, tests/test_gpu_megatron_bitwise_tp.py on two GPUs): what one rank computes and saves, and the
check of both ranks against `BitwiseForward(tensor_parallel_size=2)`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from fp8_align.config import FP8Config
from fp8_align.hf_training import BitwiseForward
from fp8_align.megatron_ext.bitwise import build_bitwise_gpt, token_logprobs
from fp8_align.megatron_ext.hf_bridge import megatron_state_dict_from_hf, tensor_parallel_shard
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES

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
