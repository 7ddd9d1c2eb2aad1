"""The bitwise megatron-core GPTModel (`fp8_align.megatron_ext.bitwise`) on CPU, real megatron-core
0.19.2: its log-probs, hidden states and gradients against `BitwiseForward` on the same HF weights
(the HF bitwise trainer, proven equal to the engine on GPUs; benchmarks/RESULTS.md). On CPU every
engine op runs its pure-torch reference on both sides, so these tests check the plumbing: the spec's
slots, the fused-QKV permutation, RoPE inside core attention, THD packing, the output layer, the
gradient path and megatron-core's own modules around them. Engine equality is the GPU's
(tests/test_gpu_megatron_bitwise.py, benchmarks/results/megatron_bitwise.json).
"""

from __future__ import annotations

import re

import pytest
import torch

from fp8_align.config import FP8Config
from fp8_align.hf_training import BitwiseForward, UnsupportedModelError
from fp8_align.vllm_plugin.kv.scales import KVScaleError
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES, completion_logprobs_from_logits, packed_rows

pytest.importorskip("megatron.core")

from fp8_align.megatron_ext import bitwise as megatron_bitwise  # noqa: E402
from fp8_align.megatron_ext.bitwise import build_bitwise_gpt, packed_seq_params, set_kv_scales, token_logprobs  # noqa: E402
from fp8_align.megatron_ext.hf_bridge import build_megatron_gpt, hf_state_dict_from_megatron, megatron_state_dict_from_hf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: FP8 KV-cache scales of the 2-layer test models (FP32 amax / 448 of K/V of order 1).
KV_SCALES = {layer: {"k_scale": 0.004 + 0.001 * layer, "v_scale": 0.003} for layer in range(2)}
FP8 = FP8Config(on_policy="bitwise", precision="fp8")


def _packed_logits(model: torch.nn.Module, sequences: list[list[int]]) -> torch.Tensor:
    """FP32 logits [T, V] of a plain THD forward of the packed `sequences`."""
    ids = torch.tensor([[t for s in sequences for t in s]])
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    return model(ids, positions, None, packed_seq_params=packed_seq_params([len(s) for s in sequences], "cpu"))[0]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_log_probs_and_logits_are_bitwise_forwards(kind: str, precision: str) -> None:
    cfg = FP8Config(on_policy="bitwise", precision=precision)
    hf = tiny_hf_model(kind)
    reference = BitwiseForward(hf, cfg)
    model = build_bitwise_gpt(hf, cfg)
    with torch.no_grad():
        expected = torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS))
        assert torch.equal(torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS)), expected)
        logits = _packed_logits(model, SEQUENCES)
        assert logits.dtype == torch.float32
        assert torch.equal(completion_logprobs_from_logits(logits, SEQUENCES, PROMPT_LENS, packed_rows(SEQUENCES)), expected)
        hidden = model(torch.tensor([[t for s in SEQUENCES for t in s]]), None, None, packed_seq_params=packed_seq_params([len(s) for s in SEQUENCES], "cpu"),
                       output_processor=lambda hidden_states, **_: hidden_states[:, 0])  # fmt: skip
        assert torch.equal(hidden, reference.hidden_states(SEQUENCES))
        at_temperature = torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS, temperature=0.6))
        assert torch.equal(at_temperature, torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS, temperature=0.6)))
        assert not torch.equal(at_temperature, expected)


def test_alone_padded_thd_and_sbhd_give_the_packed_bits() -> None:
    """A sequence scored alone, THD with pad rows between the sequences (`cu_seqlens_q_padded`)
    and sbhd rows (no packed_seq_params, each row one sequence) give the packed forward's bits."""
    model = build_bitwise_gpt(tiny_hf_model("qwen3"), FP8)
    with torch.no_grad():
        packed = _packed_logits(model, SEQUENCES)
        rows = packed_rows(SEQUENCES)
        alone = _packed_logits(model, [SEQUENCES[1]])
        assert torch.equal(alone, packed[rows[1]])
        starts = [i * 48 for i in range(len(SEQUENCES))]
        ids = torch.zeros(1, 48 * len(SEQUENCES), dtype=torch.long)
        for start, seq in zip(starts, SEQUENCES):
            ids[0, start : start + len(seq)] = torch.tensor(seq)
        params = packed_seq_params([len(s) for s in SEQUENCES], "cpu")
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = torch.tensor([*starts, 48 * len(SEQUENCES)], dtype=torch.int32)
        padded = model(ids, None, None, packed_seq_params=params)[0]
        for start, seq, row in zip(starts, SEQUENCES, rows):
            assert torch.equal(padded[start : start + len(seq)], packed[row])
        twelve = [s[:12] for s in SEQUENCES if len(s) >= 12]
        sbhd = model(torch.tensor(twelve), None, None)
        for i, seq in enumerate(twelve):
            assert torch.equal(sbhd[i], _packed_logits(model, [seq]))


def _hf_named(grads: dict[str, torch.Tensor], hf_config: object) -> dict[str, torch.Tensor]:
    return hf_state_dict_from_megatron(grads, hf_config, fused_norms=False)


@pytest.mark.parametrize("backward", ["bf16", "fp8"])
def test_gradients_are_bitwise_forwards(backward: str) -> None:
    """The same loss through both: every Megatron parameter gets a gradient, and mapped to HF names
    each is the same bits as BitwiseForward's (the engine-order products scatter their weight
    gradient onto the interleaved QKV rows exactly), with the FP8 linears' backward in BF16 and in
    block FP8. megatron-core's recompute needs CUDA's RNG tracker: tests/test_gpu_megatron_bitwise.py."""
    cfg = FP8Config(on_policy="bitwise", precision="fp8", bitwise_linear_backward=backward)
    hf = tiny_hf_model("qwen3")
    reference = BitwiseForward(hf, cfg)
    model = build_bitwise_gpt(hf, cfg)
    model.train()
    torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS, temperature=0.6)).sum().backward()
    torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS, temperature=0.6)).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    mine = _hf_named(grads, hf.config)
    theirs = {name: p.grad for name, p in hf.named_parameters()}
    assert mine.keys() == theirs.keys()
    for name, grad in mine.items():
        assert torch.equal(grad, theirs[name]), name


def test_an_optimizer_step_keeps_the_bits() -> None:
    """After an AdamW step on the Megatron model's parameters, its log-probs are BitwiseForward's on
    the new weights (mapped back to HF names, as a weight sync sends them)."""
    hf = tiny_hf_model("llama")
    model = build_bitwise_gpt(hf, FP8)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (-torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS)).mean()).backward()
    optimizer.step()
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters())
    synced = tiny_hf_model("llama")
    synced.load_state_dict({k: v.detach().clone() for k, v in _hf_named(dict(model.named_parameters()), hf.config).items()})
    with torch.no_grad():
        assert torch.equal(torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS)), torch.cat(BitwiseForward(synced, FP8).token_logprobs(SEQUENCES, PROMPT_LENS)))


def test_fp8_kv_cache_uses_the_engines_scales() -> None:
    cfg = FP8Config(on_policy="bitwise", precision="fp8", kv_cache_dtype="fp8")
    hf = tiny_hf_model("qwen3")
    model = build_bitwise_gpt(hf, cfg, kv_scales=KV_SCALES)
    with torch.no_grad():
        mine = torch.cat(token_logprobs(model, SEQUENCES, PROMPT_LENS))
        assert torch.equal(mine, torch.cat(BitwiseForward(hf, cfg, kv_scales=KV_SCALES).token_logprobs(SEQUENCES, PROMPT_LENS)))
        assert not torch.equal(mine, torch.cat(BitwiseForward(hf, FP8).token_logprobs(SEQUENCES, PROMPT_LENS)))
    unset = build_bitwise_gpt(hf, cfg)
    with pytest.raises(ValueError, match=re.escape("call set_kv_scales")):
        token_logprobs(unset, SEQUENCES, PROMPT_LENS)
    with pytest.raises(KVScaleError, match=re.escape("missing [1]")):
        set_kv_scales(unset, {0: KV_SCALES[0]})
    with pytest.raises(ValueError, match="K/V scales apply to an FP8 KV cache"):
        set_kv_scales(build_bitwise_gpt(hf, FP8), KV_SCALES)


def test_parameters_are_the_local_specs_and_round_trip_to_hf() -> None:
    """The bitwise model's parameter names and shapes are megatron-core's local spec's (checkpoints,
    weight syncs and converters see the usual model), and HF -> Megatron -> HF is the identity."""
    hf = tiny_hf_model("qwen3")
    local = {name: p.shape for name, p in build_megatron_gpt(hf, None, spec="local").named_parameters()}
    assert {name: p.shape for name, p in build_bitwise_gpt(hf, FP8).named_parameters()} == local
    state = hf.state_dict()
    back = hf_state_dict_from_megatron(megatron_state_dict_from_hf(state, hf.config, fused_norms=False), hf.config, fused_norms=False)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_bad_models_settings_and_megatron_states_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = tiny_hf_model("llama")
    with pytest.raises(ValueError, match="set on_policy='bitwise'"):
        build_bitwise_gpt(hf, FP8Config())
    with pytest.raises(UnsupportedModelError, match="this model is 'qwen2'"):
        build_bitwise_gpt(tiny_hf_model("qwen2"), FP8)
    with pytest.raises(ValueError, match=re.escape("sets ['hidden_dropout'] itself")):
        build_bitwise_gpt(hf, FP8, hidden_dropout=0.1)
    with pytest.raises(ValueError, match="engine runs BF16 weights"):
        build_bitwise_gpt(tiny_hf_model("llama").float(), FP8)
    model = build_bitwise_gpt(hf, FP8)
    with pytest.raises(ValueError, match="prompt"):
        token_logprobs(model, SEQUENCES, [len(s) for s in SEQUENCES])
    monkeypatch.setattr(megatron_bitwise.model, "is_batch_invariant_mode_enabled", lambda: True)
    with pytest.raises(UnsupportedModelError, match="batch-invariant mode is on"):
        token_logprobs(model, SEQUENCES, PROMPT_LENS)
    monkeypatch.undo()
    for getter, size in (("get_tensor_model_parallel_world_size", 4), ("get_pipeline_model_parallel_world_size", 2)):
        monkeypatch.setattr(megatron_bitwise.model.parallel_state, getter, lambda size=size: size)
        with pytest.raises(UnsupportedModelError, match="tensor parallel size 1 or 2 .a bitwise engine's., pipeline and context parallel size 1"):
            build_bitwise_gpt(hf, FP8)
        monkeypatch.undo()
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2; this process's Megatron tensor parallel size is 1"):
        build_bitwise_gpt(hf, FP8, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="cu_seqlens_q covers 50 tokens; the input has 49 rows"):
        ids = torch.tensor([[t for s in SEQUENCES for t in s][:49]])
        model(ids, None, None, packed_seq_params=packed_seq_params([len(s) for s in SEQUENCES], "cpu"))
    with pytest.raises(ValueError, match="not a bitwise GPTModel"):
        token_logprobs(build_megatron_gpt(hf, None, spec="local"), SEQUENCES, PROMPT_LENS)
