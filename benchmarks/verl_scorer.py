"""Token log-probs as verl 0.9.1's actor computes them, for a model that `make_bitwise` converted.

`VerlActorScorer(model).token_logprobs(sequences, prompt_lens, temperature)` has the signature of
`BitwiseForward.token_logprobs`. It runs verl's own compute_log_prob unit:
- `left_right_2_no_padding` on the rollout batch (prompts left-padded, responses right-padded),
  as `RayPPOTrainer._compute_old_log_prob` does;
- one micro-batch of `FSDPEngineWithLMHead.forward_step`: remove-padding packing, the forward
  under verl's BF16 autocast, the temperature division, `logprobs_from_logits`, entropy;
- `no_padding_2_padding`.
On CUDA `forward_step` itself runs. On CPU its three steps run as it runs them, because it first
moves the batch to verl's accelerator and verl has no CPU platform.

The engine object is not built by `FSDPEngine.__init__`, which wraps the model in FSDP and builds
the optimizer, neither of which touches how log-probs are computed. `verl_engine` sets the
attributes `forward_step` reads, to `__init__`'s defaults.

verl must be importable: on the CPU venv from `.cache/verl_site` (scripts/setup_cpu_env.sh).
Used by benchmarks/on_policy_bitwise.py (`--scorer verl`) and tests/test_stack_logprobs.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import verl.utils.torch_functional as verl_F
from verl.utils import tensordict_utils as tu
from verl.utils.model import compute_position_id_with_mask
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

#: verl's pad token in the rollout batch here; padding never reaches the model (remove-padding).
PAD_ID = 0


def verl_engine(model: torch.nn.Module) -> FSDPEngineWithLMHead:
    """An `FSDPEngineWithLMHead` holding `model`, with the attributes `forward_step` reads set to
    `FSDPEngine.__init__`'s defaults: no Ulysses sequence parallelism, no static padding, entropy
    without chunking or checkpointing, BF16 autocast."""
    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.module = model
    engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = False, 1
    engine.pad_to_length, engine.pad_to_length_bucket = False, None
    engine.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    return engine


def rollout_batch(sequences: list[list[int]], prompt_lens: list[int], temperature: float, device: torch.device) -> Any:
    """`sequences` (prompt + completion token ids) as verl's trainer hands them to its actor:
    prompts left-padded and responses right-padded (`PAD_ID`), position ids from the attention
    mask, through `left_right_2_no_padding`, with the flags `_compute_old_log_prob` and
    `infer_batch` set."""
    prompts = [seq[:p] for seq, p in zip(sequences, prompt_lens, strict=True)]
    responses = [seq[p:] for seq, p in zip(sequences, prompt_lens, strict=True)]
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.tensor([[PAD_ID] * (width_p - len(p)) + p for p in prompts], device=device)
    response_ids = torch.tensor([r + [PAD_ID] * (width_r - len(r)) for r in responses], device=device)
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts], device=device)
    response_mask = torch.tensor([[1] * len(r) + [0] * (width_r - len(r)) for r in responses], device=device)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    batch = tu.get_tensordict({
        "prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask, "response_mask": response_mask, "position_ids": compute_position_id_with_mask(attention_mask),
    })  # fmt: skip
    batch = left_right_2_no_padding(batch)
    tu.assign_non_tensor(batch, calculate_entropy=True, compute_loss=False, temperature=temperature, use_remove_padding=True, use_fused_kernels=False)
    return batch


class VerlActorScorer:
    """verl 0.9.1's compute_log_prob over `model` (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.engine = verl_engine(model)
        self.device = next(model.parameters()).device

    def token_logprobs(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per sequence, FP32 [len - prompt_len] log-probs of its completion tokens, as verl's actor
        returns its old log-probs (no gradient)."""
        batch = rollout_batch(sequences, prompt_lens, temperature, self.device)
        with torch.no_grad():
            if self.device.type == "cuda":
                _, output = self.engine.forward_step(batch, loss_function=None, forward_only=True)
                log_probs = output["model_output"]["log_probs"]
            else:
                model_inputs, output_args = self.engine.prepare_model_inputs(micro_batch=batch)
                with torch.autocast(device_type="cpu", dtype=torch.bfloat16):  # forward_step's default
                    raw = self.engine.module(**model_inputs, use_cache=False)
                    log_probs = self.engine.prepare_model_outputs(
                        output=raw, output_args=output_args, micro_batch=batch, logits_processor_func=None
                    )["log_probs"]
        padded = no_padding_2_padding(log_probs, batch)
        return [row[: len(seq) - p] for row, seq, p in zip(padded, sequences, prompt_lens, strict=True)]
