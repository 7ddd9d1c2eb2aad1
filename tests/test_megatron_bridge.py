"""HF Llama-family / Qwen3 model -> megatron-core GPTModel (`fp8_align.megatron_ext.hf_bridge`), on CPU.

Real megatron-core 0.19.2 with its own (local-spec) layers, real SmolLM2-135M-Instruct weights.
megatron-core's forward assumes CUDA in three places that have nothing to do with the weight
mapping under test; `megatron_on_cpu` replaces exactly those (the RoPE frequency table's device,
the default causal mask's device and the dropout RNG tracker's CUDA state; dropout is 0). The TE
layers and the FP8 forward run on the GPU box (tests/test_gpu_megatron_te.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from fp8_align import FP8Config

pytest.importorskip("megatron.core")

from fp8_align.megatron_ext.hf_bridge import (  # noqa: E402
    MegatronBridgeError,
    MegatronCausalLM,
    build_megatron_gpt,
    check_llama_family,
    megatron_config_kwargs,
    megatron_state_dict_from_hf,
    qkv_blocks_align,
)
from tests.model_factory import tiny_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def megatron_on_cpu():
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tensor_parallel

    class NoCudaRng:
        def fork(self, *_: object, **__: object) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    patches = [
        (torch.cuda, "current_device", lambda: "cpu"),
        (fused_softmax, "get_default_causal_mask", lambda sq: torch.ones(sq, sq).triu(1).bool()),
        (tensor_parallel, "get_cuda_rng_tracker", lambda: NoCudaRng()),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    yield
    for obj, name, value in saved:
        setattr(obj, name, value)


def _tiny_llama(head_dim: int = 64, tied: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, rope_theta=10000.0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float(), dim=-1)


def test_qkv_is_interleaved_per_query_group() -> None:
    """linear_qkv rows: [g0 q heads, g0 k, g0 v, g1 q heads, ...], every HF row exactly once."""
    hf = _tiny_llama()
    cfg = hf.config
    mapped = megatron_state_dict_from_hf(hf.state_dict(), cfg, fused_norms=True)
    qkv = mapped["decoder.layers.1.self_attention.linear_qkv.weight"]
    q, k, v = (hf.state_dict()[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    d = 64
    assert qkv.shape == (4 * d + 2 * 2 * d, 256)
    group1 = qkv[4 * d :]  # group 0 holds 2 q heads + k + v = 4 heads of rows
    assert torch.equal(group1[: 2 * d], q[2 * d :])
    assert torch.equal(group1[2 * d : 3 * d], k[d:])
    assert torch.equal(group1[3 * d :], v[d:])
    assert torch.equal(mapped["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"], hf.state_dict()["model.layers.0.post_attention_layernorm.weight"])
    assert "output_layer.weight" not in mapped
    assert "output_layer.weight" in megatron_state_dict_from_hf(_tiny_llama(tied=False).state_dict(), _tiny_llama(tied=False).config, True)


@pytest.mark.parametrize("tied", [True, False])
def test_local_megatron_model_reproduces_the_hf_logits(megatron_on_cpu, tied: bool) -> None:
    """Same weights, same math: BF16 log-probs agree to BF16 rounding (a mis-mapped head or norm is O(1) off)."""
    hf = _tiny_llama(tied=tied)
    gpt = MegatronCausalLM(build_megatron_gpt(hf, None, spec="local"), hf.config)
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(1))
    ref, got = _logprobs(hf, ids), _logprobs(gpt, ids)
    assert got.shape == ref.shape
    # Random-init logits are tiny (|logit| < 1); BF16 rounding of activations in two different
    # operation orders moves log-probs by ~1e-2 at most, a mapping error by ~1.
    assert (got - ref).abs().max() < 0.03
    _assert_top1_agrees_where_decided(got, ref)


def test_local_megatron_qwen3_reproduces_the_hf_logits(megatron_on_cpu) -> None:
    """Qwen3's per-head q/k norms map onto megatron-core's `qk_layernorm` (before RoPE, as Qwen3):
    the same agreement as the Llama case (a norm left out or misplaced is O(1) off)."""
    hf = tiny_hf_model("qwen3")
    weights = megatron_state_dict_from_hf(hf.state_dict(), hf.config, fused_norms=False)
    assert torch.equal(weights["decoder.layers.1.self_attention.k_layernorm.weight"], hf.state_dict()["model.layers.1.self_attn.k_norm.weight"])
    gpt = MegatronCausalLM(build_megatron_gpt(hf, None, spec="local"), hf.config)
    ids = torch.randint(0, 1000, (2, 37), generator=torch.Generator().manual_seed(1))
    ref, got = _logprobs(hf.eval(), ids), _logprobs(gpt, ids)
    assert (got - ref).abs().max() < 0.03
    _assert_top1_agrees_where_decided(got, ref)


@pytest.mark.slow
def test_smollm2_in_megatron_scores_like_hf(megatron_on_cpu) -> None:
    """The real trained model: Megatron (local layers) and HF agree on next-token log-probs of text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp8_align.error_bench.default_model import smollm2_checkpoint

    path = smollm2_checkpoint()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is", return_tensors="pt").input_ids
    gpt = MegatronCausalLM(build_megatron_gpt(hf, None, spec="local"), hf.config)
    ref, got = _logprobs(hf, ids), _logprobs(gpt, ids)
    targets = ids[0, 1:]
    ref_tok = ref[0, :-1].gather(-1, targets[:, None])[:, 0]
    got_tok = got[0, :-1].gather(-1, targets[:, None])[:, 0]
    # BF16 on both sides (30 layers): per-token log-prob differences of a few 1e-2 nats are BF16
    # rounding; the BF16/BF16 token error of two engines on this model is ~1.02-1.04.
    assert (got_tok - ref_tok).abs().max() < 0.15
    # The top-1 token may flip where the top two are within that noise (on an AMX CPU, oneDNN's AMX
    # BF16 matmuls flipped one of the 19 positions, 2026-11-26): compared where it cannot.
    _assert_top1_agrees_where_decided(got, ref)


def _assert_top1_agrees_where_decided(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The top-1 tokens of log-probs `got` and `ref` ([..., V]) agree at every position where the
    reference's top two are more than twice that position's largest |got - ref| apart: there no
    difference that small can swap them (got's top-1 stays above ref's top-1 minus d, every other
    token below ref's runner-up plus d). Elsewhere a flip is rounding, on any CPU. At least half
    of the positions must be decided, or the check would say nothing."""
    moved = (got - ref).abs().amax(-1)
    top2 = ref.topk(2, dim=-1).values
    decided = top2[..., 0] - top2[..., 1] > 2 * moved
    assert decided.float().mean() >= 0.5, f"only {int(decided.sum())} of {decided.numel()} positions are decided"
    assert torch.equal(got.argmax(-1)[decided], ref.argmax(-1)[decided])


def test_unmappable_models_are_refused_with_the_reason() -> None:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    with pytest.raises(MegatronBridgeError, match="model_type 'qwen2'"):
        check_llama_family(Qwen2Config())
    with pytest.raises(MegatronBridgeError, match="sliding-window"):
        check_llama_family(Qwen3Config(use_sliding_window=True, sliding_window=512))
    with pytest.raises(MegatronBridgeError, match="sliding-window"):
        check_llama_family(MistralConfig(sliding_window=512))
    with pytest.raises(MegatronBridgeError, match="biases"):
        check_llama_family(LlamaConfig(attention_bias=True))
    with pytest.raises(MegatronBridgeError, match="rope scaling"):
        check_llama_family(LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))


def test_fp8_needs_te_layers_and_takes_the_shared_config(megatron_on_cpu) -> None:
    hf = _tiny_llama()
    with pytest.raises(MegatronBridgeError, match="TransformerEngine"):
        build_megatron_gpt(hf, FP8Config(), spec="local")
    kwargs = megatron_config_kwargs(hf.config, FP8Config(num_first_layers_in_bf16=1))
    assert kwargs["fp8_recipe"] == "blockwise" and kwargs["num_layers_at_start_in_bf16"] == 1
    assert "fp8" not in megatron_config_kwargs(hf.config, None)


def test_qkv_block_grids_align_only_for_head_dims_of_128() -> None:
    assert not qkv_blocks_align(_tiny_llama(head_dim=64).config)
    assert qkv_blocks_align(_tiny_llama(head_dim=128).config)
