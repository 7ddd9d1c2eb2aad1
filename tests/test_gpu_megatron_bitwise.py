"""The bitwise megatron-core GPTModel on CUDA (gpu marker; megatron-core required): the engine's
kernels on both sides, so its log-probs and gradients against `BitwiseForward` (proven equal to the
engine's log-probs, benchmarks/RESULTS.md) are the bits the engine gives; megatron-core's selective
and full recompute change no bit; one step of megatron-core's own DDP and optimizer keeps the model
equal to BitwiseForward on the synced weights. The engine itself: benchmarks/on_policy_bitwise.py
--scorer megatron and benchmarks/stack_bitwise.py --stack megatron.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8_align.config import FP8Config
from fp8_align.hf_training import BitwiseForward
from tests.model_factory import tiny_hf_model, tiny_qwen3_moe_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("megatron.core")

from fp8_align.megatron_ext.bitwise import build_bitwise_gpt, token_logprobs  # noqa: E402
from fp8_align.megatron_ext.hf_bridge import hf_state_dict_from_megatron  # noqa: E402

FP8_POW2 = FP8Config(on_policy="bitwise", precision="fp8", use_weight_pow2_scale=True, use_activation_pow2_scale=True)


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
@pytest.mark.parametrize(
    "cfg", [FP8Config(on_policy="bitwise", precision="fp8"), FP8_POW2, FP8_POW2.model_copy(update={"bitwise_linear_backward": "fp8"})],
    ids=["fp8", "fp8_pow2", "fp8_pow2_fp8_backward"],
)  # fmt: skip
def test_log_probs_and_gradients_are_bitwise_forwards_on_cuda(cfg: FP8Config, recompute: str | None) -> None:
    hf = tiny_hf_model("qwen3").cuda()
    reference = BitwiseForward(hf, cfg)
    overrides = {} if recompute is None else {"recompute_granularity": recompute}
    if recompute == "full":
        overrides.update(recompute_method="uniform", recompute_num_layers=1)
    model = build_bitwise_gpt(hf, cfg, **overrides)
    model.train()
    mine = torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS, temperature=0.6))
    theirs = torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS, temperature=0.6))
    assert torch.equal(mine, theirs)
    mine.sum().backward()
    theirs.sum().backward()
    grads = hf_state_dict_from_megatron({n: p.grad for n, p in model.named_parameters()}, hf.config, fused_norms=False)
    for name, param in hf.named_parameters():
        assert torch.equal(grads[name], param.grad), name


@pytest.mark.parametrize("cfg", [FP8Config(on_policy="bitwise", precision="fp8"), FP8_POW2], ids=["fp8", "fp8_pow2"])
def test_moe_log_probs_and_gradients_are_bitwise_forwards_on_cuda(cfg: FP8Config) -> None:
    """Qwen3-MoE (`EngineMoE` in the sparse layers' MLP slot, layer 1 dense): log-probs and every
    gradient equal BitwiseForward's on CUDA, the routing and grouped block-FP8 kernels included."""
    hf = tiny_qwen3_moe_model(num_hidden_layers=3, mlp_only_layers=[1], vocab_size=1000).cuda()
    reference = BitwiseForward(hf, cfg)
    model = build_bitwise_gpt(hf, cfg)
    model.train()
    mine = torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS))
    theirs = torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS))
    assert torch.equal(mine, theirs)
    mine.sum().backward()
    theirs.sum().backward()
    grads = hf_state_dict_from_megatron({n: p.grad for n, p in model.named_parameters()}, hf.config, fused_norms=False)
    for name, param in hf.named_parameters():
        assert torch.equal(grads[name], param.grad), name


def test_megatron_optimizer_step_keeps_the_bits(tmp_path: Path) -> None:
    from benchmarks.megatron_scorer import MegatronBitwiseActor

    cfg = FP8Config(on_policy="bitwise", precision="fp8")
    tiny_hf_model("llama").save_pretrained(tmp_path)
    actor = MegatronBitwiseActor(tmp_path, cfg, None, "cuda", lr=1e-2)
    old = actor.token_logprobs(SEQUENCES, PROMPT_LENS, 1.0)
    stats = actor.policy_step(SEQUENCES, PROMPT_LENS, 1.0, old, [1.0, -1.0, 0.5], micro_batch_size=2)
    assert stats["grad_norm"] > 0
    synced = tiny_hf_model("llama").cuda()
    synced.load_state_dict({k: v.detach().clone() for k, v in actor.hf_state().items()})
    new = actor.token_logprobs(SEQUENCES, PROMPT_LENS, 1.0)
    assert not torch.equal(torch.cat(new), torch.cat(old))
    assert torch.equal(torch.cat(new), torch.cat(BitwiseForward(synced, cfg).token_logprobs(SEQUENCES, PROMPT_LENS)))
