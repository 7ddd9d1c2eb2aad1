"""verl 0.9.1's own log-prob code on a converted model (CPU): with `patch_stack_logprobs("verl")` its
log-probs are the engine's bits, at T = 1 and T = 0.6; without the patch they are not.

verl's code runs through `benchmarks/verl_scorer.VerlActorScorer`, from `.cache/verl_site`
(scripts/setup_cpu_env.sh). That is its compute_log_prob unit: `left_right_2_no_padding`, then
`FSDPEngineWithLMHead.forward_step`'s three steps (remove-padding packing, the forward under
verl's BF16 autocast, the temperature division with `logprobs_from_logits` and entropy), then
`no_padding_2_padding`. Its docstring says what is not verl's own: the engine object's
construction, and on CPU the call of `forward_step` itself.

The reference is `BitwiseForward.token_logprobs(..., temperature=T)`: the engine's log-probs, with
the pure-torch kernels on CPU. On CUDA those are vLLM's batch-invariant kernels (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import copy
import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fp8_align import FP8Config
from fp8_align.hf_training import BitwiseForward, make_bitwise, patch_stack_logprobs, unpatch_stack_logprobs
from fp8_align.hf_training.stack_patches import STACK_PATCHES, verl_logprobs_from_logits
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES

VERL_SITE = Path(__file__).resolve().parents[1] / ".cache" / "verl_site"
if VERL_SITE.is_dir() and str(VERL_SITE) not in sys.path:
    sys.path.append(str(VERL_SITE))  # after this repository's paths: its `tests` stays ours
verl_impl = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="scripts/setup_cpu_env.sh installs verl 0.9.1 into .cache/verl_site")

from benchmarks.verl_scorer import VerlActorScorer  # noqa: E402

CFG = FP8Config(on_policy="bitwise", precision="fp8")


@pytest.fixture
def unpatched() -> Iterator[None]:
    """Every test starts and ends with verl's own function in place."""
    unpatch_stack_logprobs("verl")
    yield
    unpatch_stack_logprobs("verl")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_verl_log_probs_of_a_converted_model_are_the_engines(temperature: float, unpatched: None) -> None:
    base = tiny_hf_model("qwen3")
    converted = copy.deepcopy(base)
    make_bitwise(converted, CFG)
    with torch.no_grad():
        engine = BitwiseForward(base, CFG).token_logprobs(SEQUENCES, PROMPT_LENS, temperature=temperature)
    verl = VerlActorScorer(converted)
    own = verl.token_logprobs(SEQUENCES, PROMPT_LENS, temperature)
    gap = max((a - b).abs().max().item() for a, b in zip(own, engine))
    assert gap > 0, "verl's own logprobs_from_logits gave the engine's bits: this comparison cannot fail"
    patch_stack_logprobs("verl")
    for mine, theirs in zip(verl.token_logprobs(SEQUENCES, PROMPT_LENS, temperature), engine):
        assert mine.dtype == torch.float32 and torch.equal(mine, theirs)
    print(f"\nT={temperature}: verl's own log-softmax off the engine's by up to {gap:.3g} nats; patched: 0")


def test_the_patch_applies_once_is_undone_and_refuses_what_it_cannot_do(unpatched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    original = verl_impl.logprobs_from_logits
    assert patch_stack_logprobs("verl") is patch_stack_logprobs("verl") is STACK_PATCHES["verl"]
    assert verl_impl.logprobs_from_logits is verl_logprobs_from_logits
    unpatch_stack_logprobs("verl")
    assert verl_impl.logprobs_from_logits is original
    with pytest.raises(ValueError, match="no log-prob patch for 'trl'"):
        patch_stack_logprobs("trl")
    monkeypatch.setattr(importlib.metadata, "version", lambda distribution: "0.10.0")
    with pytest.raises(ValueError, match=r"verl 0\.10\.0: patch_stack_logprobs\('verl'\) is read from verl 0\.9\.1 only"):
        patch_stack_logprobs("verl")
    assert verl_impl.logprobs_from_logits is original
    with pytest.raises(ValueError, match="converted model's FP32 logits"):
        verl_logprobs_from_logits(torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.long))


def test_the_engines_log_probs_carry_the_standard_gradient() -> None:
    """verl's update_policy differentiates the same call: the gradient is autograd's of
    log_softmax + gather (on CPU the same op, so bit for bit)."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(1))
    mine = logits.clone().requires_grad_()
    verl_logprobs_from_logits(mine, labels).sum().backward()
    theirs = logits.clone().requires_grad_()
    torch.log_softmax(theirs, dim=-1).gather(1, labels[:, None]).sum().backward()
    assert torch.equal(mine.grad, theirs.grad)
