"""Token log-probs and policy steps as verl 0.9.1's actor computes them, for a model that
`make_bitwise` converted.

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

`VerlActorScorer.policy_step(...)` is verl's update_policy on one rollout batch: the same batch
with the old log-probs and advantages, in micro-batches, each through `forward_step` with verl's
`ppo_loss` (vanilla PPO clip, token-mean over the whole batch's tokens, as `forward_backward_batch`
normalizes it), backward, then gradient clipping and the optimizer step.

verl must be importable: on the CPU venv from `.cache/verl_site` (scripts/setup_cpu_env.sh).
Used by benchmarks/on_policy_bitwise.py (`--scorer verl`), benchmarks/stack_bitwise.py and
tests/test_stack_logprobs.py.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import verl.utils.torch_functional as verl_F
from verl.utils import tensordict_utils as tu
from verl.utils.model import compute_position_id_with_mask
from verl.workers.config import FSDPActorConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from benchmarks.rollout_batch import clip_and_step, left_right_padded

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
    engine.get_data_parallel_group = lambda: None  # one rank: ppo_loss receives it and does not use it
    return engine


def actor_config(micro_batch_size: int) -> FSDPActorConfig:
    """verl's actor config with its defaults (vanilla PPO clip 0.2, token-mean, no entropy or KL
    term, gradient clip 1.0), one rollout per prompt."""
    return FSDPActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=micro_batch_size, ppo_mini_batch_size=micro_batch_size, rollout_n=1)


def rollout_batch(
    sequences: list[list[int]], prompt_lens: list[int], temperature: float, device: torch.device,
    old_logprobs: list[torch.Tensor] | None = None, advantages: list[float] | None = None,
) -> Any:  # fmt: skip
    """`sequences` (prompt + completion token ids) as verl's trainer hands them to its actor:
    prompts left-padded and responses right-padded (`PAD_ID`), position ids from the attention
    mask, through `left_right_2_no_padding`, with the flags `_compute_old_log_prob` and
    `infer_batch` set. With `old_logprobs` (per sequence, FP32 [completion length]) and
    `advantages` (one per sequence, on every completion token, as GRPO's outcome advantage is) the
    batch is a training batch instead: `compute_loss` set, no entropy."""
    padded = left_right_padded(sequences, prompt_lens, device, PAD_ID)
    prompt_ids, response_ids, response_mask = padded["prompt_ids"], padded["response_ids"], padded["response_mask"]
    width_r = response_ids.shape[1]
    attention_mask = torch.cat([padded["prompt_mask"], response_mask], dim=1)
    batch = tu.get_tensordict({
        "prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask, "response_mask": response_mask, "position_ids": compute_position_id_with_mask(attention_mask),
    })  # fmt: skip
    training = old_logprobs is not None
    if training:
        if advantages is None or len(advantages) != len(sequences) or len(old_logprobs) != len(sequences):
            raise ValueError("a training batch needs old_logprobs and advantages for every sequence")
        batch["old_log_probs"] = torch.stack([torch.nn.functional.pad(lp.to(device, torch.float32), (0, width_r - len(lp))) for lp in old_logprobs])
        batch["advantages"] = torch.tensor(advantages, dtype=torch.float32, device=device)[:, None] * response_mask
    batch = left_right_2_no_padding(batch)
    tu.assign_non_tensor(
        batch, calculate_entropy=not training, compute_loss=training, temperature=temperature, use_remove_padding=True, use_fused_kernels=False
    )
    return batch


class VerlActorScorer:
    """verl 0.9.1's compute_log_prob over `model` (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.engine = verl_engine(model)
        self.device = next(model.parameters()).device

    def _forward(self, batch: Any, loss_function: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """`forward_step` of one micro-batch: (loss or None, model output)."""
        if self.device.type == "cuda":
            loss, output = self.engine.forward_step(batch, loss_function=loss_function, forward_only=loss_function is None)
            return (loss if loss_function is not None else None), output["model_output"]
        model_inputs, output_args = self.engine.prepare_model_inputs(micro_batch=batch)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):  # forward_step's default
            raw = self.engine.module(**model_inputs, use_cache=False)
            model_output = self.engine.prepare_model_outputs(
                output=raw, output_args=output_args, micro_batch=batch, logits_processor_func=loss_function
            )
            if loss_function is None:
                return None, model_output
            loss, _ = loss_function(model_output=model_output, data=batch, dp_group=None)
        return loss, model_output

    def policy_step(
        self, sequences: list[list[int]], prompt_lens: list[int], temperature: float, old_logprobs: list[torch.Tensor],
        advantages: list[float], optimizer: torch.optim.Optimizer, micro_batch_size: int = 8,
    ) -> dict[str, float]:  # fmt: skip
        """One PPO update over the whole batch (verl's update_policy with one mini-batch): verl's
        `ppo_loss` per micro-batch of `micro_batch_size` sequences, normalized by the batch's
        completion tokens, backward, `clip_grad_norm_` to the config's `grad_clip`, the optimizer
        step. Returns {"loss": summed loss, "grad_norm": norm before clipping}."""
        config = actor_config(micro_batch_size)
        batch_tokens = sum(len(seq) - p for seq, p in zip(sequences, prompt_lens, strict=True))
        optimizer.zero_grad()
        total = 0.0
        for start in range(0, len(sequences), micro_batch_size):
            part = slice(start, start + micro_batch_size)
            batch = rollout_batch(sequences[part], prompt_lens[part], temperature, self.device, old_logprobs[part], advantages[part])
            tu.assign_non_tensor(batch, dp_size=1, batch_num_tokens=batch_tokens, global_batch_size=len(sequences))
            loss, _ = self._forward(batch, partial(ppo_loss, config))
            assert loss is not None
            loss.backward()
            total += loss.item()
        grad_norm = clip_and_step(self.engine.module.parameters(), optimizer, config.grad_clip)
        return {"loss": total, "grad_norm": grad_norm}

    def token_logprobs(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per sequence, FP32 [len - prompt_len] log-probs of its completion tokens, as verl's actor
        returns its old log-probs (no gradient)."""
        batch = rollout_batch(sequences, prompt_lens, temperature, self.device)
        with torch.no_grad():
            log_probs = self._forward(batch, None)[1]["log_probs"]
        padded = no_padding_2_padding(log_probs, batch)
        return [row[: len(seq) - p] for row, seq, p in zip(padded, sequences, prompt_lens, strict=True)]
