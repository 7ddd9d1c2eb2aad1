"""Bitwise Qwen3-MoE with megatron-core (`build_bitwise_gpt` on a `Qwen3MoeForCausalLM`): its sparse
layers become `EngineMoE` in megatron-core's MLP slot, its dense ones keep the bitwise MLP. On CPU
every op runs its pure-torch reference, so these tests check that the GPTModel computes, bit for bit,
what `BitwiseForward` computes on the same HF model (itself checked against the engine's patched
vLLM block, tests/test_bitwise_moe_model.py), gradients and the weight sync's name mapping included.

The model: tests/model_factory.py's tiny Qwen3-MoE with 3 decoder layers, layer 1 dense
(`mlp_only_layers`), vocabulary 1000 (tests/packed_sequences.py's sequences).
"""

from __future__ import annotations

import pytest
import torch

from fp8_align.config import FP8Config
from fp8_align.hf_training import BitwiseForward, UnsupportedModelError
from tests.model_factory import tiny_qwen3_moe_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES

pytest.importorskip("megatron.core")

from fp8_align.megatron_ext.bitwise import build_bitwise_gpt, token_logprobs  # noqa: E402
from fp8_align.megatron_ext.bitwise.modules import EngineMoE  # noqa: E402
from fp8_align.megatron_ext.hf_bridge import (  # noqa: E402
    MegatronBridgeError, build_megatron_gpt, hf_state_dict_from_megatron, megatron_state_dict_from_hf,
)  # fmt: skip

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BITWISE = FP8Config(on_policy="bitwise")


def _model() -> torch.nn.Module:
    return tiny_qwen3_moe_model(num_hidden_layers=3, mlp_only_layers=[1], vocab_size=1000)


def _hf_named(tensors: dict[str, torch.Tensor], hf_config: object) -> dict[str, torch.Tensor]:
    return hf_state_dict_from_megatron(tensors, hf_config, fused_norms=False)


def test_sparse_layers_are_engine_moe_under_megatron_names_and_round_trip_to_hf() -> None:
    """Layers 0 and 2 hold an `EngineMoE` (router [E, H], one fc1 [2F, H] and fc2 [H, F] per expert,
    megatron-core's grouped-experts names), layer 1 megatron-core's MLP; HF -> Megatron -> HF is the
    identity, the experts' fused tensors included."""
    hf = _model()
    model = build_bitwise_gpt(hf, BITWISE)
    layers = model.decoder.layers
    assert isinstance(layers[0].mlp, EngineMoE) and isinstance(layers[2].mlp, EngineMoE) and not isinstance(layers[1].mlp, EngineMoE)
    params = dict(model.named_parameters())
    assert params["decoder.layers.0.mlp.router.weight"].shape == (8, 256)
    assert params["decoder.layers.2.mlp.experts.linear_fc1.weight7"].shape == (256, 256)
    assert params["decoder.layers.2.mlp.experts.linear_fc2.weight7"].shape == (256, 128)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in params
    assert torch.equal(params["decoder.layers.2.mlp.experts.linear_fc1.weight3"], hf.model.layers[2].mlp.experts.gate_up_proj[3])
    state = hf.state_dict()
    back = _hf_named(megatron_state_dict_from_hf(state, hf.config, fused_norms=False), hf.config)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(MegatronBridgeError, match="model_type .qwen3_moe. .supported: llama, mistral, qwen3."):
        build_megatron_gpt(hf, None, spec="local")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_log_probs_and_gradients_are_bitwise_forwards(temperature: float) -> None:
    """The same loss through both: the log-probs are the same bits, every Megatron parameter gets a
    gradient, and mapped to HF names each is BitwiseForward's bit for bit (the router's and every
    expert's included)."""
    hf = _model()
    reference = BitwiseForward(hf, BITWISE)
    model = build_bitwise_gpt(hf, BITWISE)
    mine = torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS, temperature=temperature))
    theirs = torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS, temperature=temperature))
    assert torch.equal(mine, theirs)
    mine.sum().backward()
    theirs.sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    mapped = _hf_named(grads, hf.config)
    assert mapped.keys() == hf_grads.keys()
    for name, grad in mapped.items():
        assert torch.equal(grad, hf_grads[name]), name
    assert hf_grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0


def test_an_optimizer_step_keeps_the_bits() -> None:
    """After an AdamW step on the Megatron model, its log-probs are BitwiseForward's on the new weights
    mapped back to HF names (what a weight sync sends the engine)."""
    hf = _model()
    model = build_bitwise_gpt(hf, BITWISE)
    router = model.decoder.layers[0].mlp.router.weight
    before = router.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (-torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS)).mean()).backward()
    optimizer.step()
    assert not torch.equal(before, router)
    synced = _model()
    synced.load_state_dict({k: v.detach().clone() for k, v in _hf_named(dict(model.named_parameters()), hf.config).items()})
    with torch.no_grad():
        assert torch.equal(torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS)), torch.cat(BitwiseForward(synced, BITWISE).token_logprobs(SEQUENCES, PROMPT_LENS)))


def test_experts_the_bitwise_path_does_not_run_are_refused() -> None:
    """Experts the recipe keeps BF16 are refused by name, as make_bitwise refuses them."""
    with pytest.raises(UnsupportedModelError, match="layers.0.mlp.experts: the recipe keeps these experts BF16"):
        build_bitwise_gpt(_model(), FP8Config(on_policy="bitwise", num_first_layers_in_bf16=1))
