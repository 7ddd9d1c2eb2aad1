"""The benchmark's "training side": teacher-forced log-probs of generated tokens, and the comparison.

Given prompts and the completions a generator produced, `completion_logprobs` runs an HF model
forward over prompt + completion (right-padded micro-batches) and returns, for every completion
token, log p(token | everything before it), with log_softmax taken in FP32. Rows are aligned at
the first completion token so position t is the t-th generated token of every sequence, the
layout `fp8_align.metrics` expects. `score_generation` and `pair_records` apply this to one
engine's output and summarize each (generation, training side, sampling) pair with
`fp8_align.metrics`; `layer_attribution` measures the error of FP8 in one decoder layer at a time.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fp8_align.config import FP8Config
from fp8_align.hf_emulation import apply_fp8_emulation
from fp8_align.hf_training import BitwiseForward, apply_fp8_training
from fp8_align.metrics import mismatch_metrics, per_position_mult_prob_error, token_mult_prob_error

#: Upper bound on (sequences x padded length) per forward; bounds the FP32 logits memory.
DEFAULT_MAX_TOKENS_PER_FORWARD = 8192
#: Completion positions pooled per point of the error-by-position plot (single positions are noisy).
POSITION_BUCKET = 8


def pad_logprobs(rows: Sequence[Sequence[float]]) -> tuple[Tensor, Tensor]:
    """Per-sequence lists of log-probs (nats) -> (values [B, T] float32, mask [B, T] bool).

    T is the longest row; padded positions hold 0.0 and are False in the mask.
    """
    width = max((len(row) for row in rows), default=0)
    values = torch.zeros(len(rows), width, dtype=torch.float32)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        values[b, : len(row)] = torch.tensor(list(row), dtype=torch.float32)
        mask[b, : len(row)] = True
    return values, mask


def completion_logprobs(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    max_tokens_per_forward: int = DEFAULT_MAX_TOKENS_PER_FORWARD,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each completion token under `model` (an HF causal LM), teacher-forced.

    Args:
        model: returns `.logits` [B, L, V] (its own dtype; upcast to FP32 before log_softmax) for
            `input_ids` / `attention_mask` [B, L].
        prompts, completions: token ids, one prompt (>= 1 token) and one completion per sequence.
        max_tokens_per_forward: sequences are grouped, longest first, so that a forward holds at
            most this many padded tokens (a single longer sequence still runs alone).
    Returns:
        (logprobs [B, T] float32 on CPU, mask [B, T] bool) with T the longest completion:
        row b, position t is log p(completions[b][t] | prompts[b] + completions[b][:t]) in nats;
        the mask is True exactly at completion tokens (prompt and padding are never scored).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    for b, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {b} is empty; the first completion token needs a context to be scored")
    width = max((len(c) for c in completions), default=0)
    logprobs = torch.zeros(len(prompts), width, dtype=torch.float32)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    device = next(model.parameters()).device
    for batch in micro_batches([len(p) + len(c) for p, c in zip(prompts, completions)], max_tokens_per_forward):
        sequences = [list(prompts[b]) + list(completions[b]) for b in batch]
        length = max(len(s) for s in sequences)
        input_ids = torch.zeros(len(batch), length, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), length, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
            attention_mask[row, : len(sequence)] = 1
        with torch.inference_mode():
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            for row, b in enumerate(batch):
                start, count = len(prompts[b]), len(completions[b])
                if count == 0:
                    continue
                # logits at position p predict token p + 1
                step_logits = logits[row, start - 1 : start - 1 + count].float()
                targets = input_ids[row, start : start + count].to(device)
                token_logprobs = torch.log_softmax(step_logits, dim=-1).gather(-1, targets[:, None])[:, 0]
                logprobs[b, :count] = token_logprobs.cpu()
                mask[b, :count] = True
    return logprobs, mask


def bitwise_completion_logprobs(
    forward: BitwiseForward,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    max_tokens_per_forward: int = DEFAULT_MAX_TOKENS_PER_FORWARD,
) -> tuple[Tensor, Tensor]:
    """`completion_logprobs`'s contract computed by `BitwiseForward` (sequences packed, unpadded):
    (logprobs [B, T] float32 on CPU, mask [B, T] bool)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    width = max((len(c) for c in completions), default=0)
    logprobs = torch.zeros(len(prompts), width, dtype=torch.float32)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for batch in micro_batches([len(p) + len(c) for p, c in zip(prompts, completions)], max_tokens_per_forward):
        batch = [b for b in batch if completions[b]]
        if not batch:
            continue
        with torch.inference_mode():
            values = forward.token_logprobs([list(prompts[b]) + list(completions[b]) for b in batch], [len(prompts[b]) for b in batch])
        for b, row in zip(batch, values):
            logprobs[b, : row.numel()] = row.cpu()
            mask[b, : row.numel()] = True
    return logprobs, mask


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Sequence indices grouped longest first so that len(group) * max(length in group) <= max_tokens.

    Every index appears once; a sequence longer than max_tokens forms a group of its own.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_forward must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


@dataclass
class VariantScores:
    """One engine's output, scored. Keys are sampling settings; tensors are [B, T] (T = longest completion).

    gen_logprobs: float32 log-probs vLLM returned; mask: bool, True at generated tokens;
    train_logprobs: training side name -> setting -> float32 teacher-forced log-probs.
    """

    gen_logprobs: dict[str, Tensor] = field(default_factory=dict)
    mask: dict[str, Tensor] = field(default_factory=dict)
    train_logprobs: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # train side -> sampling -> [B, T]


def score_generation(
    outputs_by_sampling: dict[str, list[dict[str, Any]]], models: dict[str, nn.Module | BitwiseForward]
) -> VariantScores:
    """Score one engine's completions with each training-side model (one batched pass per model).

    Args: outputs_by_sampling: setting -> per prompt {"prompt_ids", "token_ids", "logprobs"} (as
    `fp8_align.error_bench.generate` returns); models: training side name -> HF causal LM or a
    `BitwiseForward` over one.
    Every setting's sequences go through a model together; rows are split back by setting.
    Raises RuntimeError if the scored tokens do not line up with the generated ones.
    """
    settings = list(outputs_by_sampling)
    rows = [o for s in settings for o in outputs_by_sampling[s]]
    prompts = [o["prompt_ids"] for o in rows]
    completions = [o["token_ids"] for o in rows]
    scores = VariantScores()
    bounds = _row_bounds([len(outputs_by_sampling[s]) for s in settings])
    for setting, (lo, hi) in zip(settings, bounds):
        gen, mask = pad_logprobs([o["logprobs"] for o in rows[lo:hi]])
        scores.gen_logprobs[setting], scores.mask[setting] = gen, mask
    for side, model in models.items():
        score = bitwise_completion_logprobs if isinstance(model, BitwiseForward) else completion_logprobs
        train, train_mask = score(model, prompts, completions)
        scores.train_logprobs[side] = {}
        for setting, (lo, hi) in zip(settings, bounds):
            width = scores.mask[setting].shape[1]
            if not torch.equal(train_mask[lo:hi, :width], scores.mask[setting]):
                raise RuntimeError(f"training-side mask differs from the generated tokens of '{setting}'")
            scores.train_logprobs[side][setting] = train[lo:hi, :width]
    return scores


def _row_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def pair_records(generation: str, scores: VariantScores, fp8_sides: set[str]) -> list[dict[str, Any]]:
    """One record per (training side, sampling setting) of one generation variant.

    `fp8_sides` names the training sides that run the variant's block-FP8 recipe; it is empty for
    a BF16 generation variant. Each record holds `fp8_align.metrics.mismatch_metrics` of all scored
    tokens, the error at each completion position and pooled over `POSITION_BUCKET` positions.
    `alignment` is "reference" (BF16 generation), "misaligned" (FP8 generation, BF16 training
    side) or "aligned" (FP8 generation, FP8 training side).
    """
    records = []
    generation_is_fp8 = bool(fp8_sides)
    for side, by_setting in scores.train_logprobs.items():
        if not generation_is_fp8:
            alignment = "reference"
        else:
            alignment = "aligned" if side in fp8_sides else "misaligned"
        for setting, train in by_setting.items():
            gen, mask = scores.gen_logprobs[setting], scores.mask[setting]
            metrics = mismatch_metrics(train, gen, mask)
            by_position = per_position_mult_prob_error(train, gen, mask)
            starts = range(0, mask.shape[1], POSITION_BUCKET)
            records.append(
                {
                    "pair": f"{generation} gen / {side} train",
                    "generation": generation,
                    "training": side,
                    "alignment": alignment,
                    "sampling": setting,
                    "metrics": dataclasses.asdict(metrics),
                    "per_position": {
                        "mult_prob_error": [float(v) for v in by_position.error],
                        "num_tokens": [int(v) for v in by_position.num_tokens],
                    },
                    "per_position_bucket": {
                        "bucket_size": POSITION_BUCKET,
                        "start": list(starts),
                        "mult_prob_error": [
                            float(token_mult_prob_error(*(t[:, a : a + POSITION_BUCKET] for t in (train, gen, mask))))
                            for a in starts
                        ],
                        "num_tokens": [int(mask[:, a : a + POSITION_BUCKET].sum()) for a in starts],
                    },
                }
            )
    return records


def fp8_model(bf16_model: nn.Module, cfg: FP8Config, forward_kernel: str | None = None) -> nn.Module:
    """A copy of `bf16_model` whose recipe linears run block FP8: fp8_align's emulation (default), or
    with forward_kernel="engine" the vLLM plugin's GPU kernels (`hf_training.apply_fp8_training`)."""
    model = copy.deepcopy(bf16_model)
    if forward_kernel is None:
        apply_fp8_emulation(model, cfg)
    else:
        apply_fp8_training(model, cfg, forward_kernel=forward_kernel)
    return model


def layer_attribution(
    bf16_model: nn.Module,
    cfg: FP8Config,
    variant: str,
    outputs: Sequence[dict[str, Any]],
    progress: Callable[[Iterator[int], int], Iterator[int]],
) -> dict[str, Any]:
    """Token error caused by each decoder layer alone: HF forward with FP8 only in layer i vs all BF16.

    Scores `outputs` (completions generated by `variant`, whose recipe is `cfg`) with the HF model
    in BF16 and, for each layer `cfg` runs in FP8, with block FP8 in that layer only (`cfg`'s scale
    settings). Returns {"variant", "num_sequences", "num_tokens", "reference", "layers": [{"layer",
    "mult_prob_error", "max_abs_log_ratio"}], "all_layers": {...}}; error 1.0: no change.
    """
    depth = int(bf16_model.config.num_hidden_layers)
    prompts = [o["prompt_ids"] for o in outputs]
    completions = [o["token_ids"] for o in outputs]
    reference, mask = completion_logprobs(bf16_model, prompts, completions)

    def summary(model: nn.Module) -> dict[str, float]:
        logprobs, _ = completion_logprobs(model, prompts, completions)
        metrics = mismatch_metrics(logprobs, reference, mask)
        return {"mult_prob_error": metrics.mult_prob_error, "max_abs_log_ratio": metrics.max_abs_log_ratio}

    fp8_layers = [i for i in range(depth) if i not in cfg.bf16_layer_indices(depth)]
    layers = []
    for i in progress(iter(fp8_layers), len(fp8_layers)):
        only_i = FP8Config.from_kwargs(
            **{**cfg.model_dump(), "num_first_layers_in_bf16": i, "num_last_layers_in_bf16": depth - 1 - i}
        )
        layers.append({"layer": i, **summary(fp8_model(bf16_model, only_i))})
    return {
        "variant": variant,
        "num_sequences": len(outputs),
        "num_tokens": int(mask.sum()),
        "reference": "HF forward in BF16 on the same tokens",
        "layers": layers,
        "all_layers": summary(fp8_model(bf16_model, cfg)),
    }
