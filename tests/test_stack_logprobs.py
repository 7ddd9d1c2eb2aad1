"""verl 0.9.1's own log-prob code on a converted model (CPU): with `patch_stack_logprobs("verl")` its
log-probs are the engine's bits, at T = 1 and T = 0.6; without the patch they are not.

What runs is verl's code, from `.cache/verl_site` (scripts/setup_cpu_env.sh). The trainer's padding
removal is `left_right_2_no_padding`, as `RayPPOTrainer._compute_old_log_prob` calls it. Then
comes one micro-batch of `FSDPEngineWithLMHead.forward_step`:
- `prepare_model_inputs`: remove-padding packing, position ids, rolled labels, per-token
  temperature;
- the model's forward under verl's BF16 autocast;
- `prepare_model_outputs`: the temperature division, `logprobs_from_logits`, entropy;
- then `no_padding_2_padding`, the response-aligned old log-probs.
`forward_step` itself is not called, only its three steps: it first moves the batch to verl's
accelerator, and verl has no CPU platform. The engine object is not built by `FSDPEngine.__init__`,
which wraps the model in FSDP and builds the optimizer, neither of which touches how log-probs are
computed. `_verl_engine` sets the attributes those steps read, with verl's defaults.

The reference is `BitwiseForward.token_logprobs(..., temperature=T)`: the engine's log-probs, with
the pure-torch kernels on CPU. On CUDA those are vLLM's batch-invariant kernels (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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

import verl.utils.torch_functional as verl_F  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

CFG = FP8Config(on_policy="bitwise", precision="fp8")


@pytest.fixture
def unpatched() -> Any:
    """Every test starts and ends with verl's own function in place."""
    unpatch_stack_logprobs("verl")
    yield
    unpatch_stack_logprobs("verl")


def _verl_engine(model: torch.nn.Module) -> Any:
    """An `FSDPEngineWithLMHead` holding `model`, with the attributes `prepare_model_inputs` and
    `prepare_model_outputs` read set as `FSDPEngine.__init__` sets them by default: no Ulysses
    sequence parallelism, no static padding, entropy without chunking or checkpointing."""
    engine = verl_impl.FSDPEngineWithLMHead.__new__(verl_impl.FSDPEngineWithLMHead)
    engine.module = model
    engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = False, 1
    engine.pad_to_length, engine.pad_to_length_bucket = False, None
    engine.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    return engine


def _rollout_batch(temperature: float) -> Any:
    """`SEQUENCES` as a rollout batch: prompts left-padded, responses right-padded (pad id 0), through
    verl's `left_right_2_no_padding`, with what `_compute_old_log_prob` and `infer_batch` add."""
    prompts = [seq[:p] for seq, p in zip(SEQUENCES, PROMPT_LENS)]
    responses = [seq[p:] for seq, p in zip(SEQUENCES, PROMPT_LENS)]
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.tensor([[0] * (width_p - len(p)) + p for p in prompts])
    response_ids = torch.tensor([r + [0] * (width_r - len(r)) for r in responses])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width_r - len(r)) for r in responses])
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    batch = tu.get_tensordict({
        "prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask, "response_mask": response_mask, "position_ids": compute_position_id_with_mask(attention_mask),
    })  # fmt: skip
    batch = left_right_2_no_padding(batch)
    tu.assign_non_tensor(batch, calculate_entropy=True, compute_loss=False, temperature=temperature, use_remove_padding=True, use_fused_kernels=False)
    return batch


def _verl_old_log_probs(model: torch.nn.Module, temperature: float) -> list[torch.Tensor]:
    """Per sequence, the response tokens' log-probs as verl's actor computes its old log-probs."""
    engine, batch = _verl_engine(model), _rollout_batch(temperature)
    model_inputs, output_args = engine.prepare_model_inputs(micro_batch=batch)
    with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16):  # forward_step's default autocast
        output = engine.module(**model_inputs, use_cache=False)
        model_output = engine.prepare_model_outputs(output=output, output_args=output_args, micro_batch=batch, logits_processor_func=None)
    padded = no_padding_2_padding(model_output["log_probs"], batch)
    return [row[: len(seq) - p] for row, seq, p in zip(padded, SEQUENCES, PROMPT_LENS)]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_verl_log_probs_of_a_converted_model_are_the_engines(temperature: float, unpatched: None) -> None:
    base = tiny_hf_model("qwen3")
    converted = copy.deepcopy(base)
    make_bitwise(converted, CFG)
    with torch.no_grad():
        engine = BitwiseForward(base, CFG).token_logprobs(SEQUENCES, PROMPT_LENS, temperature=temperature)
    own = _verl_old_log_probs(converted, temperature)
    gap = max((a - b).abs().max().item() for a, b in zip(own, engine))
    assert gap > 0, "verl's own logprobs_from_logits gave the engine's bits: this comparison cannot fail"
    patch_stack_logprobs("verl")
    for mine, theirs in zip(_verl_old_log_probs(converted, temperature), engine):
        assert torch.equal(mine, theirs)
    print(f"\nT={temperature}: verl's own log-softmax off the engine's by up to {gap:.3g} nats; patched: 0")


def test_the_patch_applies_once_is_undone_and_refuses_what_it_cannot_do(unpatched: None) -> None:
    original = verl_impl.logprobs_from_logits
    assert patch_stack_logprobs("verl") is patch_stack_logprobs("verl") is STACK_PATCHES["verl"]
    assert verl_impl.logprobs_from_logits is verl_logprobs_from_logits
    unpatch_stack_logprobs("verl")
    assert verl_impl.logprobs_from_logits is original
    with pytest.raises(ValueError, match="no log-prob patch for 'trl'"):
        patch_stack_logprobs("trl")
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
