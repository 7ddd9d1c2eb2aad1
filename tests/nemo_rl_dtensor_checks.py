"""NeMo RL's DTensor-policy log-prob and train units on a converted model (CPU), run by
tests/test_nemo_rl_logprobs.py in a process of its own with NeMo RL's pins first on the path
(`.cache/nemo_rl_site`: NeMo RL 0.6.0 at commit 7ea279a refuses transformers >= 5.12).

NeMo RL's code runs through `benchmarks/nemo_rl_scorer.NemoRLPolicyScorer`; its docstring says
what is not NeMo RL's own (the Ray worker around the units, the one-rank all-reduces, the logger
module). The reference is `BitwiseForward.token_logprobs(..., temperature=T)`: the engine's
log-probs, with the pure-torch kernels on CPU.

On CPU NeMo RL's own log-softmax and division are the same torch ops as the engine's references,
so the patch changes no bit here; what the checks can fail on is NeMo RL's packing, micro-batching,
unpacking and re-ordering around the converted model, and whether the patched functions are the
ones its units call. On CUDA the patch is what makes the bits equal (benchmarks/stack_bitwise.py).

Stood in for on CPU, and nothing else: `torch.Tensor.cuda` returns the tensor itself (NeMo RL's
`process_microbatch` and its next-token log-prob helper move their inputs with `.cuda()`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from benchmarks.nemo_rl_scorer import NemoRLPolicyScorer  # first: it puts NeMo RL's logger stand-in in place

import nemo_rl.package_info  # noqa: E402, I001
from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams  # noqa: E402
from nemo_rl.models.automodel import train  # noqa: E402

from fp8_align import FP8Config
from fp8_align.hf_training import BitwiseForward, make_bitwise, patch_stack_logprobs, stack_patches, unpatch_stack_logprobs
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES
from tests.policy_steps import assert_policy_steps_keep_the_engines_bits

CFG = FP8Config(on_policy="bitwise", precision="fp8")
#: NeMo RL packs micro-batches of `max_total_sequence_length * micro batch size` tokens: with one
#: longest sequence per budget the 3 sequences take 2 micro-batches, one of them two sequences packed.
MICRO_BATCH = 1
MAX_LEN = max(len(s) for s in SEQUENCES)


@pytest.fixture(autouse=True)
def cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The module docstring's one stand-in, and NeMo RL's own functions back after each check."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    yield
    unpatch_stack_logprobs("nemo_rl")


@pytest.fixture
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the tiny Qwen3, its converted copy)."""
    base = tiny_hf_model("qwen3")
    converted = copy.deepcopy(base)
    make_bitwise(converted, CFG)
    return base, converted


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_nemo_rl_log_probs_of_a_converted_model_are_the_engines(
    temperature: float, models: tuple[torch.nn.Module, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, converted = models
    calls = []
    engine_label_logprobs = stack_patches.engine_label_logprobs
    monkeypatch.setattr(stack_patches, "engine_label_logprobs", lambda *args: calls.append(1) or engine_label_logprobs(*args))
    scorer = NemoRLPolicyScorer(converted, eos_token_id=0, max_total_sequence_length=MAX_LEN, micro_batch_size=MICRO_BATCH)
    shard, _ = scorer.packed(scorer.batch(SEQUENCES), "logprob_mb_tokens")
    micro_batches, _ = shard.get_microbatch_iterator_for_packable_sequences_len()
    assert micro_batches >= 2, "the packer gave one micro-batch: nothing is re-ordered"
    with torch.no_grad():
        engine = BitwiseForward(base, CFG).token_logprobs(SEQUENCES, PROMPT_LENS, temperature=temperature)
    for mine, theirs in zip(scorer.token_logprobs(SEQUENCES, PROMPT_LENS, temperature), engine, strict=True):
        assert mine.dtype == torch.float32 and torch.equal(mine, theirs)
    assert len(calls) == micro_batches, "NeMo RL's log-prob unit did not call the engine's log-softmax once per micro-batch"


def test_nemo_rl_policy_steps_keep_the_converted_model_on_the_engines_bits(models: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """Three of NeMo RL's GRPO updates (`NemoRLPolicyScorer.policy_step`: packed micro-batches,
    `automodel_forward_backward` with its `ClippedPGLossFn`) at T = 0.6 keep its log-probs on the
    engine's bits (tests/policy_steps.py); a micro-batch size other than the packing budget's is refused."""
    base, converted = models
    scorer = NemoRLPolicyScorer(converted, eos_token_id=0, max_total_sequence_length=MAX_LEN, micro_batch_size=MICRO_BATCH)
    assert_policy_steps_keep_the_engines_bits(scorer, base, converted, CFG, temperature=0.6, micro_batch_size=MICRO_BATCH)
    optimizer = torch.optim.AdamW(converted.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="micro_batch_size 4"):
        scorer.policy_step(SEQUENCES, PROMPT_LENS, 0.6, [], [], optimizer, micro_batch_size=4)


def test_the_nemo_rl_patch_applies_once_is_undone_and_refuses_what_it_cannot_do(monkeypatch: pytest.MonkeyPatch) -> None:
    originals = (train.apply_temperature_scaling, train.LogprobsPostProcessor._compute_local_logprobs, train.get_logprobs_from_vocab_parallel_logits)
    assert patch_stack_logprobs("nemo_rl") is patch_stack_logprobs("nemo_rl")
    patched = (train.apply_temperature_scaling, train.LogprobsPostProcessor._compute_local_logprobs, train.get_logprobs_from_vocab_parallel_logits)
    assert not set(map(id, patched)) & set(map(id, originals))
    with pytest.raises(NotImplementedError, match="tensor and context parallel size 1"):
        train.get_logprobs_from_vocab_parallel_logits(torch.zeros(1, 2, 8), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="FP32 logits"):
        train.apply_temperature_scaling(torch.zeros(1, 2, 8, dtype=torch.bfloat16), TrainingSamplingParams(temperature=0.6))
    logits = torch.randn(1, 3, 8)
    assert train.apply_temperature_scaling(logits, TrainingSamplingParams(temperature=1.0)) is logits
    for top in ({"top_k": 5}, {"top_p": 0.9}):
        post = train.LogprobsPostProcessor({}, None, None, None, cp_size=1, sampling_params=TrainingSamplingParams(temperature=0.6, **top))
        with pytest.raises(ValueError, match="top-k/top-p"):
            post._compute_local_logprobs(logits, torch.zeros(1, 3, dtype=torch.long))
    unpatch_stack_logprobs("nemo_rl")
    assert (train.apply_temperature_scaling, train.LogprobsPostProcessor._compute_local_logprobs, train.get_logprobs_from_vocab_parallel_logits) == originals
    monkeypatch.setattr(nemo_rl.package_info, "__shortversion__", "0.7.0")
    with pytest.raises(ValueError, match=r"nemo_rl 0\.7\.0: patch_stack_logprobs\('nemo_rl'\) is read from nemo_rl 0\.6\.0 only"):
        patch_stack_logprobs("nemo_rl")
    assert train.apply_temperature_scaling is originals[0]
