"""`make_bitwise`: an HF model's own forward as the bitwise engine's (CPU: every op runs its
pure-torch reference, so these tests check the plumbing; the engine kernels on CUDA are the GPU
tests'). The reference is `ExplicitBitwiseForward` (tests/bitwise_reference.py): the same ops called
one by one in the engine's order without transformers' modeling code, the trainer proven equal to
the engine's log-probs on GPUs before the module swap (benchmarks/RESULTS.md).

Checked: the converted model's hidden states and log-probs (its FP32 logits, then
`torch.log_softmax`) equal the reference's bit for bit for Llama and Qwen3, BF16 and FP8, at
tensor parallel size 1 and 2, with a BF16 and an FP8 KV cache; the same under what stacks do around
the forward (sequences packed into one row with `position_ids` restarting at 0, right- and
left-padded batches with an attention mask, micro-batches, gradient checkpointing); gradients reach
every parameter and equal the reference's; `BitwiseForward` (a converted Parameter-sharing copy)
gives the same bits and leaves its model as it was; Parameters and their names are unchanged;
bad input and unsupported settings raise.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from fp8_align.config import FP8Config
from fp8_align.hf_training import BitwiseForward, UnsupportedModelError, make_bitwise, set_kv_scales
from fp8_align.vllm_plugin.kv.scales import KVScaleError
from tests.bitwise_reference import ExplicitBitwiseForward
from tests.frozen_checks import assert_frozen_block_contract
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES, completion_logprobs_from_logits, packed_inputs, packed_rows

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: FP8 KV-cache scales of the 2-layer test models (FP32 amax / 448 of K/V of order 1).
KV_SCALES = {layer: {"k_scale": 0.004 + 0.001 * layer, "v_scale": 0.003} for layer in range(2)}


def _converted(kind: str, cfg: FP8Config, tensor_parallel_size: int = 1, kv_scales: dict | None = None) -> tuple[torch.nn.Module, ExplicitBitwiseForward]:
    """A converted tiny model and the explicit reference on an untouched copy of it."""
    model = tiny_hf_model(kind)
    reference = ExplicitBitwiseForward(copy.deepcopy(model), cfg, kv_scales=kv_scales, tensor_parallel_size=tensor_parallel_size)
    make_bitwise(model, cfg, kv_scales=kv_scales, tensor_parallel_size=tensor_parallel_size)
    return model, reference


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_packed_forward_is_bitwise_forwards(kind: str, precision: str, tensor_parallel_size: int) -> None:
    model, reference = _converted(kind, FP8Config(on_policy="bitwise", precision=precision), tensor_parallel_size)
    with torch.no_grad():
        hidden = model.model(**packed_inputs(SEQUENCES)).last_hidden_state[0]
        logits = model(**packed_inputs(SEQUENCES)).logits[0]
        assert logits.dtype == torch.float32
        assert torch.equal(hidden, reference.hidden_states(SEQUENCES))
        mine = completion_logprobs_from_logits(logits, SEQUENCES, PROMPT_LENS, packed_rows(SEQUENCES))
        assert torch.equal(mine, torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS)))


def test_fp8_kv_cache_forward_is_bitwise_forwards_and_needs_the_scales() -> None:
    cfg = FP8Config(on_policy="bitwise", kv_cache_dtype="fp8")
    model, reference = _converted("qwen3", cfg, kv_scales=KV_SCALES)
    with torch.no_grad():
        assert torch.equal(model.model(**packed_inputs(SEQUENCES)).last_hidden_state[0], reference.hidden_states(SEQUENCES))
        bf16_cache, _ = _converted("qwen3", FP8Config(on_policy="bitwise"))
        assert not torch.equal(model.model(**packed_inputs(SEQUENCES)).last_hidden_state, bf16_cache.model(**packed_inputs(SEQUENCES)).last_hidden_state)
    unset = tiny_hf_model("qwen3")
    make_bitwise(unset, cfg)
    with pytest.raises(ValueError, match=re.escape("call set_kv_scales(model, engine_kv_scales(llm))")):
        unset(**packed_inputs(SEQUENCES))
    with pytest.raises(KVScaleError, match=re.escape("missing [1]")):
        set_kv_scales(unset, {0: KV_SCALES[0]})
    set_kv_scales(unset, KV_SCALES)
    with torch.no_grad():
        assert torch.equal(unset.model(**packed_inputs(SEQUENCES)).last_hidden_state[0], reference.hidden_states(SEQUENCES))
    with pytest.raises(ValueError, match="K/V scales apply to an FP8 KV cache"):
        set_kv_scales(bf16_cache, KV_SCALES)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batches_give_the_packed_bits(side: str) -> None:
    """A padded batch [3, 33] with an attention mask (left padding with the stacks' position_ids,
    the mask's cumulative sum - 1): every token's log-probs are the packed forward's; padding
    positions do not leak into them."""
    model, reference = _converted("qwen3", FP8Config(on_policy="bitwise", precision="fp8"))
    width = max(len(s) for s in SEQUENCES)
    ids = torch.zeros(len(SEQUENCES), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows = []
    for i, seq in enumerate(SEQUENCES):
        start = 0 if side == "right" else width - len(seq)
        ids[i, start : start + len(seq)] = torch.tensor(seq)
        mask[i, start : start + len(seq)] = 1
        rows.append(list(range(i * width + start, i * width + start + len(seq))))
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits.reshape(-1, 1000)
    mine = completion_logprobs_from_logits(logits, SEQUENCES, PROMPT_LENS, rows)
    assert torch.equal(mine, torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS)))


def test_micro_batches_give_bitwise_forwards_bits_per_micro_batch() -> None:
    model, reference = _converted("llama", FP8Config(on_policy="bitwise", precision="fp8"))
    for chosen in (slice(0, 1), slice(1, 3)):
        part, prompts = SEQUENCES[chosen], PROMPT_LENS[chosen]
        with torch.no_grad():
            logits = model(**packed_inputs(part)).logits[0]
        assert torch.equal(completion_logprobs_from_logits(logits, part, prompts, packed_rows(part)), torch.cat(reference.token_logprobs(part, prompts)))


def _gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_bits_and_gradients() -> None:
    """Training mode with transformers' gradient checkpointing (each decoder layer recomputed in the
    backward, through the cached q|k|v product): the same log-probs and the same gradients, bit for
    bit, as without it; every parameter gets a gradient."""
    model = tiny_hf_model("qwen3")
    make_bitwise(model, FP8Config(on_policy="bitwise", precision="fp8"))
    model.train()

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logprobs = completion_logprobs_from_logits(model(**packed_inputs(SEQUENCES)).logits[0], SEQUENCES, PROMPT_LENS, packed_rows(SEQUENCES))
        return logprobs.detach(), _gradients(model, logprobs.sum())

    plain_logprobs, plain = run()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed_logprobs, checkpointed = run()
    assert torch.equal(plain_logprobs, checkpointed_logprobs)
    assert plain.keys() == checkpointed.keys() == {name for name, _ in model.named_parameters()}
    for name, grad in plain.items():
        assert torch.equal(grad, checkpointed[name]), name


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_autocast_around_the_forward_changes_no_bit(precision: str) -> None:
    """verl runs its forward under `torch.autocast(dtype=bfloat16)`: the converted model's ops run
    with autocast off, so the logits and gradients are the same bits as without it (before this
    guard, the logits moved by up to 0.078 on CPU)."""
    model = tiny_hf_model("qwen3")
    make_bitwise(model, FP8Config(on_policy="bitwise", precision=precision))

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = model(**packed_inputs(SEQUENCES)).logits
        return logits.detach(), _gradients(model, logits.logsumexp(-1).sum())

    plain_logits, plain = run()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        autocast_logits, autocast = run()
    assert autocast_logits.dtype == torch.float32 and torch.equal(plain_logits, autocast_logits)
    for name, grad in plain.items():
        assert torch.equal(grad, autocast[name]), name


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gradients_are_bitwise_forwards(precision: str, tensor_parallel_size: int) -> None:
    """The converted model's backward against the explicit reference's on the same loss: both are the
    standard BF16 gradient of the same ops, and at tensor parallel size 1 every parameter's
    gradient is the same bits (HF's separate residual add and norm have the fused op's gradient).
    At size 2 the reference norms each rank's q/k heads in a call of their own, so the q_norm /
    k_norm weight gradients sum the same terms in another order: those within 1% (relative
    Frobenius norm; measured 0.3%). lm_head's weight gradient sums over the tokens, every position
    in HF's forward and the completion positions alone in the reference (the others add exact
    zeros), so the CPU's BLAS may block that sum differently: within one BF16 ulp of each element
    (measured: 1 of 256,000 elements differs, by one ulp, at size 2 in BF16). Every other parameter
    the same bits."""
    cfg = FP8Config(on_policy="bitwise", precision=precision)
    model = tiny_hf_model("qwen3")
    reference_model = copy.deepcopy(model)
    reference = ExplicitBitwiseForward(reference_model, cfg, tensor_parallel_size=tensor_parallel_size)
    make_bitwise(model, cfg, tensor_parallel_size=tensor_parallel_size)
    mine = _gradients(model, completion_logprobs_from_logits(model(**packed_inputs(SEQUENCES)).logits[0], SEQUENCES, PROMPT_LENS, packed_rows(SEQUENCES)).sum())
    theirs = _gradients(reference_model, torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS)).sum())
    assert mine.keys() == theirs.keys() == {name for name, _ in model.named_parameters()}
    for name, grad in mine.items():
        if tensor_parallel_size > 1 and name.endswith(("q_norm.weight", "k_norm.weight")):
            assert ((grad - theirs[name]).norm() / theirs[name].norm()).item() < 0.01, name
        elif name == "lm_head.weight":
            assert torch.all((grad.float() - theirs[name].float()).abs() <= theirs[name].float().abs() * 2**-7), name
        else:
            assert torch.equal(grad, theirs[name]), name


def test_parameters_and_their_names_are_the_models() -> None:
    model = tiny_hf_model("qwen3")
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    context = make_bitwise(model, FP8Config(on_policy="bitwise", precision="fp8"), tensor_parallel_size=2)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert list(model.state_dict()) == keys
    assert model.fp8_align_bitwise is context and model.config._attn_implementation == "fp8_align_bitwise"


def test_bad_positions_and_settings_are_refused() -> None:
    model = tiny_hf_model("qwen3")
    make_bitwise(model, FP8Config(on_policy="bitwise"))
    ids = torch.tensor([SEQUENCES[0]])
    with pytest.raises(ValueError, match="its first token is at position 3, not 0"):
        model(input_ids=ids, position_ids=torch.arange(3, 3 + ids.shape[1])[None])
    with pytest.raises(ValueError, match="position 6 does not follow the previous token's"):
        model(input_ids=ids, position_ids=torch.cat([torch.arange(5), torch.arange(6, 6 + ids.shape[1] - 5)])[None])
    with pytest.raises(ValueError, match="keys from a generation cache"):
        with torch.no_grad():
            first = model(input_ids=ids[:, :5], use_cache=True)
            model(input_ids=ids[:, 5:6], past_key_values=first.past_key_values, use_cache=True)
    with pytest.raises(ValueError, match="converted already"):
        make_bitwise(model, FP8Config(on_policy="bitwise"))
    dropout = tiny_hf_model("llama")
    for layer in dropout.model.layers:
        layer.self_attn.attention_dropout = 0.1
    make_bitwise(dropout, FP8Config(on_policy="bitwise"))
    dropout.train()
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        dropout(input_ids=ids)


def test_unsupported_models_and_configs_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="set on_policy='bitwise'"):
        make_bitwise(tiny_hf_model("qwen3"), FP8Config())
    with pytest.raises(ValueError, match="engine runs BF16 weights"):
        make_bitwise(tiny_hf_model("qwen3").float(), FP8Config(on_policy="bitwise"))
    with pytest.raises(ValueError, match="tensor_parallel_size must be one of"):
        make_bitwise(tiny_hf_model("qwen3"), FP8Config(on_policy="bitwise"), tensor_parallel_size=4)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100)).to(torch.bfloat16)
    with pytest.raises(UnsupportedModelError, match="this model is 'gpt2'"):
        make_bitwise(gpt2, FP8Config(on_policy="bitwise"))
    from transformers import PreTrainedModel

    model = tiny_hf_model("qwen3")
    modules_before = [type(m) for m in model.modules()]
    monkeypatch.delattr(PreTrainedModel, "set_attn_implementation")  # an older transformers' model
    with pytest.raises(UnsupportedModelError, match="set_attn_implementation"):
        make_bitwise(model, FP8Config(on_policy="bitwise"))
    assert [type(m) for m in model.modules()] == modules_before  # refused before any module was swapped


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_bitwise_forward_is_a_converted_copy_and_leaves_its_model(tensor_parallel_size: int) -> None:
    """`BitwiseForward` scores through a converted copy that shares the model's Parameters: the same
    log-probs and gradients as the explicit reference, and the model itself keeps its own modules,
    forward and attention implementation."""
    cfg = FP8Config(on_policy="bitwise", precision="fp8", kv_cache_dtype="fp8")
    model = tiny_hf_model("qwen3")
    modules_before = [type(m) for m in model.modules()]
    with torch.no_grad():
        hf_logits = model(**packed_inputs(SEQUENCES)).logits
    reference_model = copy.deepcopy(model)
    reference = ExplicitBitwiseForward(reference_model, cfg, kv_scales=KV_SCALES, tensor_parallel_size=tensor_parallel_size)
    forward = BitwiseForward(model, cfg, kv_scales=KV_SCALES, tensor_parallel_size=tensor_parallel_size)
    assert forward.converted is not model and all(a is b for a, b in zip(forward.converted.parameters(), model.parameters()))
    mine = _gradients(model, torch.cat(forward.token_logprobs(SEQUENCES, PROMPT_LENS)).sum())
    theirs = _gradients(reference_model, torch.cat(reference.token_logprobs(SEQUENCES, PROMPT_LENS)).sum())
    for name, grad in mine.items():
        if tensor_parallel_size > 1 and name.endswith(("q_norm.weight", "k_norm.weight")):
            assert ((grad - theirs[name]).norm() / theirs[name].norm()).item() < 0.01, name
        elif name == "lm_head.weight":
            assert torch.all((grad.float() - theirs[name].float()).abs() <= theirs[name].float().abs() * 2**-7), name
        else:
            assert torch.equal(grad, theirs[name]), name
    assert [type(m) for m in model.modules()] == modules_before
    with torch.no_grad():
        assert torch.equal(model(**packed_inputs(SEQUENCES)).logits, hf_logits)


def test_bitwise_forward_packs_its_sequences_without_reading_positions_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """`BitwiseForward` knows its sequences' lengths on the host and hands their layout to the
    attention (`use_packed_layout`): the layout is not rebuilt from the position tensor (on a GPU, a
    device sync per forward), and the log-probs are the ones the rebuilt layout gives."""
    from fp8_align.hf_training import convert

    cfg = FP8Config(on_policy="bitwise", precision="fp8")
    forward = BitwiseForward(tiny_hf_model("qwen3"), cfg)
    with torch.no_grad():
        rebuilt = forward.converted.model(**packed_inputs(SEQUENCES), use_cache=False).last_hidden_state[0]
        monkeypatch.setattr(convert, "_packed_layout", lambda *args: pytest.fail("the layout was rebuilt from the positions"))
        handed = forward.hidden_states(SEQUENCES)
    assert torch.equal(handed, rebuilt)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_frozen_fp8_weights_quantize_once_with_the_same_bits(tensor_parallel_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `frozen_fp8_weights` the FP8 stacked layers are quantized at the block's first forward
    only (counted at `quantize_stacked`), and the log-probs and every gradient are the same bits as
    without the block; a weight changed in place inside the block raises RuntimeError at the next
    forward, and after the block the changed weight is used; a nested block and an unconverted model
    raise ValueError."""
    from fp8_align.hf_training import bitwise_modules, frozen_fp8_weights, stacked

    model = tiny_hf_model("qwen3")
    make_bitwise(model, FP8Config(on_policy="bitwise", precision="fp8"), tensor_parallel_size=tensor_parallel_size)
    quantized: list[int] = []
    quantize_stacked = stacked.quantize_stacked

    def counting(layers: list, *args: object) -> list:
        quantized.append(len(layers))
        return quantize_stacked(layers, *args)

    monkeypatch.setattr(stacked, "quantize_stacked", counting)
    monkeypatch.setattr(bitwise_modules, "quantize_stacked", counting)

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        quantized.clear()
        logprobs = completion_logprobs_from_logits(model(**packed_inputs(SEQUENCES)).logits[0], SEQUENCES, PROMPT_LENS, packed_rows(SEQUENCES))
        return logprobs.detach(), _gradients(model, logprobs.sum()), sum(quantized)

    # q|k|v, o, gate|up, down of each layer
    assert_frozen_block_contract(model, run, 4 * model.config.num_hidden_layers, model.model.layers[0].mlp.down_proj.weight)
    with pytest.raises(ValueError, match="not converted by make_bitwise"):
        with frozen_fp8_weights(tiny_hf_model("qwen3")):
            pass
