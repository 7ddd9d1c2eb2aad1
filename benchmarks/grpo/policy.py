"""The training side of the GRPO benchmark: an HF causal LM in BF16 with FP32 master weights.

The model computes in BF16 (as Megatron does with bf16 params); AdamW keeps FP32 master copies,
and after each optimizer step the BF16 parameters are the masters rounded to BF16: exactly the
tensors pushed to the generation engine. With an `FP8Config` the recipe's linears run the
aligned block-FP8 forward (`fp8_align.hf_training`, BF16 backward); with one whose `on_policy` is
"bitwise" the whole log-prob path runs the engine's kernels (`hf_training.BitwiseForward`), so
the trainer's log-probs of the sampled tokens are the engine's bits.

Batches are right-padded prompt + completion sequences; log-probs are taken in FP32 at the
completion tokens, rows aligned at the first completion token (the `fp8_align.metrics` layout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from fp8_align.error_bench.scoring import micro_batches
from fp8_align.config import FP8Config
from fp8_align.hf_training import BitwiseForward, apply_fp8_training, frozen_fp8_weights
from fp8_align.hf_training.attention import host_to_device
from fp8_align.is_correction import importance_weighted_loss
from fp8_align.megatron_ext.calibration import KVScaleCalibrator


@dataclass(frozen=True)
class PackedSequences:
    """Right-padded sequences. input_ids, attention_mask: [B, L] int64 (CPU). prompt_lengths,
    completion_lengths: [B] int64. targets: [B, T] int64 completion tokens (0-padded), mask [B, T]
    bool, T the longest completion."""

    input_ids: Tensor
    attention_mask: Tensor
    prompt_lengths: Tensor
    completion_lengths: Tensor
    targets: Tensor
    mask: Tensor

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def sequence(self, row: int) -> list[int]:
        """Prompt + completion token ids of sequence `row`, without padding."""
        return self.input_ids[row, : int(self.prompt_lengths[row] + self.completion_lengths[row])].tolist()


def pack_sequences(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> PackedSequences:
    """Pack prompt + completion token ids (each prompt >= 1 token, completion >= 1 token)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if any(len(p) == 0 for p in prompts) or any(len(c) == 0 for c in completions):
        raise ValueError("every prompt and every completion needs at least one token")
    length = max(len(p) + len(c) for p, c in zip(prompts, completions))
    width = max(len(c) for c in completions)
    input_ids = torch.zeros(len(prompts), length, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), length, dtype=torch.long)
    targets = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        sequence = list(prompt) + list(completion)
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention_mask[row, : len(sequence)] = 1
        targets[row, : len(completion)] = torch.tensor(list(completion))
        mask[row, : len(completion)] = True
    return PackedSequences(
        input_ids, attention_mask, torch.tensor([len(p) for p in prompts]), torch.tensor([len(c) for c in completions]),
        targets, mask,
    )  # fmt: skip


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: rewards [B] (B = prompts x group_size, groups contiguous) minus their
    group's mean, divided by the group's standard deviation (unbiased) + eps. Float32 [B]; 0 for
    a group whose rewards are all equal."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} is not a flat batch of groups of {group_size}")
    grouped = rewards.float().reshape(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
    return (centered / (std + eps)).reshape(-1)


def clipped_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_eps: float) -> tuple[Tensor, Tensor]:
    """PPO/GRPO clipped surrogate per token: -min(ratio * A, clip(ratio, 1 +- eps) * A), with
    ratio = exp(logprobs - old_logprobs). logprobs/old_logprobs [B, T], advantages [B].
    Returns (loss [B, T], clipped [B, T] bool: tokens where the clipped term was taken)."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None].to(logprobs.dtype)
    unclipped, clipped = ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


class GRPOPolicy:
    """The trainer: BF16 HF model (+ aligned FP8 forward when `fp8` is given, the engine's own
    kernels when `fp8.on_policy` is "bitwise"), FP32 AdamW masters. `fp8_forward_kernel`: the
    aligned FP8 forward's `apply_fp8_training(forward_kernel=...)` ("emulation" or "engine")."""

    def __init__(
        self,
        checkpoint: Path,
        device: str,
        fp8: FP8Config | None,
        lr: float,
        grad_clip: float = 1.0,
        max_tokens_per_forward: int = 8192,
        fp8_forward_kernel: str = "emulation",
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(self.device)
        self.model.eval()  # no dropout; gradients still flow
        self.model.config.use_cache = False
        self.bitwise: BitwiseForward | None = None
        if fp8 is not None and fp8.on_policy == "bitwise":
            self.bitwise = BitwiseForward(self.model, fp8)
            self.fp8_layers = sorted(self.bitwise.fp8_names)
        else:
            self.fp8_layers = apply_fp8_training(self.model, fp8, forward_kernel=fp8_forward_kernel) if fp8 is not None else []
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        self.grad_clip = grad_clip
        self.max_tokens_per_forward = max_tokens_per_forward

    def bf16_weights(self) -> dict[str, Tensor]:
        """The model's parameters by HF name (tied weights once), BF16, on the trainer's device:
        what a stack sends to the generation engine after a step."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def logprobs(self, packed: PackedSequences, rows: Sequence[int]) -> Tensor:
        """Log-probs [len(rows), T] float32 on the trainer's device of the completion tokens of
        `rows`, with autograd when grad is enabled; 0.0 at masked positions."""
        if self.bitwise is not None:
            return self._bitwise_logprobs(self.bitwise, packed, rows)
        index = torch.tensor(list(rows))
        length = int((packed.prompt_lengths[index] + packed.completion_lengths[index]).max())
        ids = host_to_device(packed.input_ids[index, :length], self.device)
        attention_mask = host_to_device(packed.attention_mask[index, :length], self.device)
        # only the positions that predict a completion token go through the LM head (its BF16
        # backward dominates a step on a CPU): the last `keep`, from the shortest prompt's end
        keep = length - int(packed.prompt_lengths[index].min()) + 1
        logits = self.model(input_ids=ids, attention_mask=attention_mask, logits_to_keep=keep).logits  # [b, keep, V]
        width = packed.targets.shape[1]
        # logits at position p predict token p + 1: completion token t sits at prompt_length + t
        positions = (packed.prompt_lengths[index, None] - 1 + torch.arange(width)[None, :]).clamp(max=length - 1) - (length - keep)
        picked = logits[torch.arange(len(index), device=self.device)[:, None], host_to_device(positions, self.device)]  # [b, T, V]
        targets = host_to_device(packed.targets[index], self.device)
        values = torch.log_softmax(picked.float(), dim=-1).gather(-1, targets[:, :, None])[:, :, 0]
        return torch.where(host_to_device(packed.mask[index], self.device), values, 0.0)

    def _bitwise_logprobs(self, bitwise: BitwiseForward, packed: PackedSequences, rows: Sequence[int]) -> Tensor:
        """`logprobs` through BitwiseForward: the rows' sequences packed without padding."""
        prompts = [int(packed.prompt_lengths[r]) for r in rows]
        sequences = [packed.sequence(r) for r in rows]
        padded = pad_sequence(bitwise.token_logprobs(sequences, prompts), batch_first=True)  # 0.0 past each completion
        return F.pad(padded, (0, packed.targets.shape[1] - padded.shape[1]))

    def frozen_weights(self) -> contextlib.AbstractContextManager[None]:
        """A block between two optimizer steps: the FP8 trainers quantize each FP8 weight once in it
        (`frozen_fp8_weights`: the bitwise one's stacked layers, the aligned one's linears); BF16 has none."""
        if self.bitwise is not None:
            return self.bitwise.frozen_weights()
        return frozen_fp8_weights(self.model) if self.fp8_layers else contextlib.nullcontext()

    def micro_batch_rows(self, rows: Sequence[int], packed: PackedSequences) -> list[list[int]]:
        """`rows` split into the trainer's micro-batches (at most `max_tokens_per_forward` tokens each, in order)."""
        lengths = (packed.prompt_lengths + packed.completion_lengths).tolist()
        return [[rows[i] for i in group] for group in micro_batches([lengths[r] for r in rows], self.max_tokens_per_forward)]

    @torch.no_grad()
    def all_logprobs(self, packed: PackedSequences, progress: tqdm | None = None) -> Tensor:
        """Log-probs [B, T] float32 (trainer's device) of every sequence at the current weights;
        `progress` (a tqdm bar) is advanced once per micro-batch."""
        out = torch.zeros(packed.targets.shape, dtype=torch.float32, device=self.device)
        groups = self.micro_batch_rows(list(range(packed.num_sequences)), packed)
        _reset(progress, len(groups))
        with self.frozen_weights():
            for group in groups:
                out[host_to_device(torch.tensor(group), self.device)] = self.logprobs(packed, group)
                _advance(progress)
        return out

    @torch.no_grad()
    def kv_scales(self, packed: PackedSequences, rows: Sequence[int]) -> dict[int, dict[str, float]]:
        """FP8 KV-cache scales {layer: {k_scale, v_scale, q_scale}} (amax / 448 of post-RoPE K, V,
        Q) observed by the trainer's forward over `rows`, as NeMo RL computes them each step."""
        with KVScaleCalibrator(self.model) as calibrator:
            for group in self.micro_batch_rows(list(rows), packed):
                self.logprobs(packed, group)
        return calibrator.scales()

    def update(
        self,
        packed: PackedSequences,
        advantages: Tensor,
        old_logprobs: Tensor,
        is_weights: Tensor,
        clip_eps: float,
        num_minibatches: int,
        progress: tqdm | None = None,
    ) -> dict[str, float]:
        """One GRPO step: the batch in `num_minibatches` consecutive slices, one optimizer step
        each, loss = token-mean over the slice of IS weight x clipped surrogate.
        advantages [B]; old_logprobs, is_weights [B, T] (trainer's device); `progress` (a tqdm
        bar) is advanced once per micro-batch. Returns mean loss, mean pre-clip gradient norm, the
        fraction of tokens where PPO clipping was active, and `on_policy_max_abs_dlogp`: max |log-prob
        - old_logprobs| over the tokens trained before the first optimizer step, at the weights the
        batch was sampled at (0.0 where the old log-probs are this trainer's own bits)."""
        rows = list(range(packed.num_sequences))
        slices = [rows[i::num_minibatches] for i in range(num_minibatches)]
        groups = [self.micro_batch_rows(minibatch, packed) for minibatch in slices]
        _reset(progress, sum(map(len, groups)))
        mask = packed.mask.to(self.device)
        advantages = advantages.to(self.device)
        # the loss and clip counts stay on the device until the end: a host sync per micro-batch
        # would stall the GPU between micro-batches
        losses, norms = [], []
        clipped_tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        on_policy_gap = torch.zeros((), dtype=torch.float32, device=self.device)
        for minibatch, minibatch_groups in zip(slices, groups):
            tokens = int(packed.mask[minibatch].sum())
            if tokens == 0:
                continue
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            with self.frozen_weights():  # the weights change only at the optimizer step below
                for group in minibatch_groups:
                    index = host_to_device(torch.tensor(group), self.device)
                    logprobs = self.logprobs(packed, group)
                    if not norms:  # no optimizer step yet: the weights the batch was sampled at
                        gap = torch.where(mask[index], (logprobs.detach() - old_logprobs[index]).abs(), 0.0)
                        on_policy_gap = torch.maximum(on_policy_gap, gap.amax())
                    per_token, clipped = clipped_policy_loss(logprobs, old_logprobs[index], advantages[index], clip_eps)
                    loss = importance_weighted_loss(per_token, is_weights[index], mask[index], "token-mean", normalizer=tokens)
                    loss.backward()
                    total += loss.detach().float()
                    clipped_tokens += (clipped & mask[index]).sum()
                    _advance(progress)
            norms.append(self._optimizer_step())
            losses.append(total)
        valid = int(packed.mask.sum())
        return {
            "loss": float(torch.stack(losses).mean()) if losses else 0.0,
            "grad_norm": sum(norms) / max(len(norms), 1),
            "ppo_clip_fraction": int(clipped_tokens) / max(valid, 1),
            "on_policy_max_abs_dlogp": float(on_policy_gap),
        }

    def _optimizer_step(self) -> float:
        for param, master in zip(self.params, self.masters):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None
        norm = float(torch.nn.utils.clip_grad_norm_(self.masters, self.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                param.copy_(master)
        return norm


def _reset(progress: tqdm | None, total: int) -> None:
    if progress is not None:
        progress.reset(total=total)


def _advance(progress: tqdm | None) -> None:
    if progress is not None:
        progress.update(1)
