"""verl 0.9.1's and OpenRLHF 0.11.2's own log-prob code on a converted model (CPU): with
`patch_stack_logprobs(stack)` their log-probs are the engine's bits (verl at T = 1 and T = 0.6,
OpenRLHF at T = 1); without the patch they are not.

verl's code runs through `benchmarks/verl_scorer.VerlActorScorer`, from `.cache/verl_site`
(scripts/setup_cpu_env.sh). That is its compute_log_prob unit: `left_right_2_no_padding`, then
`FSDPEngineWithLMHead.forward_step`'s three steps (remove-padding packing, the forward under
verl's BF16 autocast, the temperature division with `logprobs_from_logits` and entropy), then
`no_padding_2_padding`. Its docstring says what is not verl's own: the engine object's
construction, and on CPU the call of `forward_step` itself.

OpenRLHF's code is its `Actor` (openrlhf/models/actor.py) built from a checkpoint with
`packing_samples=True`, its forward on a left/right-padded batch with an action mask: its own
unpadding into one packed row (flash-attn's `bert_padding`, from `.cache/openrlhf_site`), the
converted model, its `log_probs_from_logits`, its re-padding. flash-attn's compiled kernels and its
Triton cross-entropy are not installed (scripts/setup_cpu_env.sh says why), so unpatched OpenRLHF
takes its own torch fallback here; the Actor is built with `attn_implementation="sdpa"`, which
`make_bitwise` then replaces like any other.

The reference is `BitwiseForward.token_logprobs(..., temperature=T)`: the engine's log-probs, with
the pure-torch kernels on CPU. On CUDA those are vLLM's batch-invariant kernels (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8_align import FP8Config
from fp8_align.hf_training import BitwiseForward, make_bitwise, patch_stack_logprobs, unpatch_stack_logprobs
from fp8_align.hf_training.stack_patches import STACK_PATCHES, verl_logprobs_from_logits
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES
from tests.policy_steps import assert_policy_steps_keep_the_engines_bits

CACHE = Path(__file__).resolve().parents[1] / ".cache"
for site in (CACHE / "verl_site", CACHE / "openrlhf_site"):
    if site.is_dir() and str(site) not in sys.path:
        sys.path.append(str(site))  # after this repository's paths: verl's `tests` does not shadow ours
verl_impl = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="scripts/setup_cpu_env.sh installs verl 0.9.1 into .cache/verl_site")

from benchmarks.verl_scorer import VerlActorScorer  # noqa: E402

CFG = FP8Config(on_policy="bitwise", precision="fp8")


@pytest.fixture
def unpatched() -> Iterator[None]:
    """Every test starts and ends with the stacks' own functions in place."""
    for stack in STACK_PATCHES:
        unpatch_stack_logprobs(stack)
    yield
    for stack in STACK_PATCHES:
        unpatch_stack_logprobs(stack)


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
    with pytest.raises(ValueError, match="no log-prob patch for 'sglang'"):
        patch_stack_logprobs("sglang")
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


def test_verl_policy_steps_keep_the_converted_model_on_the_engines_bits(unpatched: None) -> None:
    """Three of verl's PPO updates (`VerlActorScorer.policy_step`: its `ppo_loss` through the
    forward-step unit, micro-batches of 2) keep its patched compute_log_prob on the engine's bits
    (tests/policy_steps.py)."""
    base = tiny_hf_model("qwen3")
    converted = copy.deepcopy(base)
    make_bitwise(converted, CFG)
    patch_stack_logprobs("verl")
    assert_policy_steps_keep_the_engines_bits(VerlActorScorer(converted), base, converted, CFG, temperature=0.6, micro_batch_size=2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperatures", "0"], "samples greedily"),
        (["--temperatures", "-1"], "--temperatures"),
        (["--variants", "fp4"], "unknown variants"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--stack", "openrlhf"], "--temperatures 1.0 only"),
        (["--stack", "trl", "--kv-cache-dtype", "auto"], "--stack trl: one temperature"),
        (["--stack", "trl", "--temperatures", "1.0"], "--kv-cache-dtype auto"),
        (["--stack", "trl", "--temperatures", "1.0", "--kv-cache-dtype", "auto", "--model", "qwen3-moe-tiny"], "--stack trl: a dense model"),
        (["--model", "qwen3-moe"], "--model: invalid choice"),
    ],
)
def test_stack_bitwise_refuses_settings_it_cannot_run(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/stack_bitwise.py (the GPU proof) names a bad setting before any engine starts."""
    from benchmarks import stack_bitwise

    with pytest.raises(SystemExit):
        stack_bitwise.main(["--out", str(tmp_path / "out.json"), "--work", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_stack_bitwise_advantages_are_batch_normalized() -> None:
    from benchmarks.stack_bitwise import advantages_of

    advantages = advantages_of([[2, 4, 6], [1, 3, 5], [2, 3, 5, 7]])
    assert advantages[0] > advantages[2] > advantages[1]
    assert abs(sum(advantages)) < 1e-6 and abs(sum(a * a for a in advantages) / 3 - 1) < 1e-4


def test_stack_bitwise_collect_keeps_each_runs_rows_and_refuses_failed_or_doubled_ones(tmp_path: Path) -> None:
    """`stack_bitwise.py --collect` writes the summary of several runs' reports (the GPU proof's
    results/stack_bitwise.json): their summary rows, each with its report, date and the step-0
    unpatched gap; a report with failures, or a second row for one (stack, vllm, variant, model), raises."""
    from benchmarks import stack_bitwise

    def report(name: str, stack: str, failures: list[dict[str, Any]] | None = None) -> Path:
        rows = [{"variant": "fp8", "step": step, "unpatched_max_abs_dlogp": 2e-6 * (step == 0)} for step in range(2)]
        rows[1].pop("unpatched_max_abs_dlogp")
        summary = [{"stack": stack, "vllm": "0.25.1", "variant": "fp8", "model": "qwen3-8b-4l", "tokens": 8, "max_abs_dlogp": 0.0}]
        path = tmp_path / name
        path.write_text(json.dumps({"date_utc": "2026-11-29", "summary": summary, "rows": rows, "failures": failures or []}))
        return path

    out = tmp_path / "summary.json"
    assert stack_bitwise.main(["--out", str(out), "--collect", str(report("a.json", "verl")), str(report("b.json", "nemo_rl"))]) == 0
    rows = json.loads(out.read_text())["summary"]
    assert [(r["stack"], r["unpatched_max_abs_dlogp"], Path(r["report"]).name) for r in rows] == [("verl", 2e-6, "a.json"), ("nemo_rl", 2e-6, "b.json")]
    with pytest.raises(ValueError, match="a second row"):
        stack_bitwise.collect([report("a.json", "verl"), report("c.json", "verl")])
    with pytest.raises(ValueError, match="1 failed variants"):
        stack_bitwise.collect([report("d.json", "verl", failures=[{"variant": "fp8"}])])


@pytest.fixture
def openrlhf_actor(unpatched: None, tmp_path: Path) -> tuple[torch.nn.Module, Any]:
    """(the tiny Qwen3 as saved, OpenRLHF's Actor over its converted copy, patched)."""
    pytest.importorskip("openrlhf.models.actor", reason="scripts/setup_cpu_env.sh installs what OpenRLHF's Actor imports")
    from benchmarks.openrlhf_scorer import OpenRLHFActorScorer

    base = tiny_hf_model("qwen3")
    base.save_pretrained(tmp_path / "model")
    return base, OpenRLHFActorScorer(tmp_path / "model", CFG)


def test_openrlhf_actor_log_probs_of_a_converted_model_are_the_engines(openrlhf_actor: tuple[torch.nn.Module, Any]) -> None:
    import openrlhf.models.actor as actor_module

    base, actor = openrlhf_actor
    with torch.no_grad():
        engine = BitwiseForward(base, CFG).token_logprobs(SEQUENCES, PROMPT_LENS)
    patched = actor_module.log_probs_from_logits
    unpatch_stack_logprobs("openrlhf")
    assert actor_module.log_probs_from_logits is not patched
    gap = max((a - b).abs().max().item() for a, b in zip(actor.token_logprobs(SEQUENCES, PROMPT_LENS), engine))
    assert gap > 0, "OpenRLHF's own log_probs_from_logits gave the engine's bits: this comparison cannot fail"
    patch_stack_logprobs("openrlhf")
    assert actor_module.log_probs_from_logits is patched
    for mine, theirs in zip(actor.token_logprobs(SEQUENCES, PROMPT_LENS), engine):
        assert mine.dtype == torch.float32 and torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="temperature 1 only"):
        actor_module.log_probs_from_logits(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), temperature=0.6)
    with pytest.raises(ValueError, match="temperature 1 only"):
        actor.token_logprobs(SEQUENCES, PROMPT_LENS, temperature=0.6)
    print(f"\nOpenRLHF's own log-softmax off the engine's by up to {gap:.3g} nats; patched: 0")


def test_openrlhf_policy_steps_keep_the_converted_model_on_the_engines_bits(openrlhf_actor: tuple[torch.nn.Module, Any]) -> None:
    """Three of OpenRLHF's PPO updates (`OpenRLHFActorScorer.policy_step`: its Actor forward and
    `PolicyLoss`, micro-batches of 2) keep the Actor's log-probs on the engine's bits
    (tests/policy_steps.py)."""
    base, actor = openrlhf_actor
    assert_policy_steps_keep_the_engines_bits(actor, base, actor.model, CFG, temperature=1.0, micro_batch_size=2)


def test_stack_bitwise_rows_name_where_engine_and_stack_part() -> None:
    """`first_mismatches` lists the completion tokens whose engine and stack log-probs differ, in
    sequence order, with the token id read after the prompt, and stops at its limit."""
    from benchmarks.stack_bitwise import first_mismatches

    sequences, prompt_lens = [[5, 6, 7, 8], [1, 2, 3]], [2, 1]
    engine = [[-0.5, -1.0], [-2.0, -3.0]]
    assert first_mismatches(sequences, prompt_lens, engine, [torch.tensor(e) for e in engine]) == []
    stack = [torch.tensor([-0.5, -1.25]), torch.tensor([-2.5, -3.5])]
    found = first_mismatches(sequences, prompt_lens, engine, stack)
    assert [(m["sequence"], m["position"], m["token"], m["engine"], m["stack"]) for m in found] == [
        (0, 1, 8, -1.0, -1.25), (1, 0, 2, -2.0, -2.5), (1, 1, 3, -3.0, -3.5)]  # fmt: skip
    assert len(first_mismatches(sequences, prompt_lens, engine, stack, limit=2)) == 2
