"""The RL stacks' own log-prob functions in the trainer process, replaced by the engine's.

A converted model (`make_bitwise`) returns the engine's FP32 logits. The stack then divides them
by the temperature and takes the labels' log-probs in its own code. Where that code is not the
engine's log-softmax (docs/on_policy.md, "What the stacks do"), `patch_stack_logprobs(stack)`
replaces the function the stack calls with one of the same contract that computes
`engine_ops.label_logprobs`: vLLM's batch-invariant log-softmax on CUDA (the engine sampler's),
the pure-torch one elsewhere, with autograd's gradient.

Each patch names the module attribute it replaces and the release it was read from; another
installed release is refused. A patch applies only when asked, and applies once however often it is
asked. `unpatch_stack_logprobs(stack)` puts the original back.

- verl 0.9.1: `verl.workers.engine.fsdp.transformer_impl.logprobs_from_logits(logits, labels,
  inplace_backward)`. This is what `FSDPEngineWithLMHead.prepare_model_outputs` calls, its
  compute_log_prob and update_policy path, after it divides the logits by the temperature. For a
  converted model's FP32 logits that division is a true division by an FP32 tensor, as vLLM's
  sampler divides.
- OpenRLHF 0.11.2: `openrlhf.models.actor.log_probs_from_logits(logits, labels, temperature)`, which
  `Actor.forward` calls on its (packed) FP32 logits. Bitwise at temperature 1 only: at T != 1 the
  Actor first divides the logits in place by a Python float, which CUDA computes as a multiply by
  1/T, not as vLLM's sampler divides; the replacement refuses its own `temperature` argument
  other than 1.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8_align.hf_training.engine_ops import kernels_for, label_logprobs


@dataclass(frozen=True)
class StackPatch:
    """One stack's log-prob function: where it lives, the releases it was read from, its replacement."""

    module: str
    attribute: str
    distribution: str
    versions: tuple[str, ...]
    replacement: Callable[..., torch.Tensor]


def engine_label_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """FP32 log-probs [...] of `labels` [...] under a converted model's FP32 `logits` [..., V], as
    the engine takes them (`label_logprobs`, with autograd's gradient). Raises ValueError for logits
    that are not FP32, since those are not a converted model's."""
    if logits.dtype != torch.float32:
        raise ValueError(
            f"fp8_align's engine log-probs take a converted model's FP32 logits (make_bitwise); these are {logits.dtype}"
        )
    return label_logprobs(logits, labels, kernels_for(logits.device))


def verl_logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """verl 0.9.1's `logprobs_from_logits` contract, computed by `engine_label_logprobs`.
    `inplace_backward`, a memory option of flash-attn's kernel, changes nothing here."""
    return engine_label_logprobs(logits, labels)


def openrlhf_log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """OpenRLHF 0.11.2's `log_probs_from_logits` contract, computed by `engine_label_logprobs`.
    Raises ValueError for `temperature` other than 1 (OpenRLHF would divide in place by a Python
    float, which is not the engine's division)."""
    if temperature != 1.0:
        raise ValueError(f"fp8_align's OpenRLHF patch is bitwise at temperature 1 only; got temperature={temperature}")
    return engine_label_logprobs(logits, labels)


#: The stacks whose log-prob function `patch_stack_logprobs` replaces.
STACK_PATCHES: dict[str, StackPatch] = {
    "verl": StackPatch("verl.workers.engine.fsdp.transformer_impl", "logprobs_from_logits", "verl", ("0.9.1",), verl_logprobs_from_logits),
    "openrlhf": StackPatch("openrlhf.models.actor", "log_probs_from_logits", "openrlhf", ("0.11.2",), openrlhf_log_probs_from_logits),
}
_originals: dict[str, Callable[..., torch.Tensor]] = {}


def patch_stack_logprobs(stack: str) -> StackPatch:
    """Replace `stack`'s log-prob function in this process with the engine's (module docstring);
    returns the patch. Imports the stack's module; a second call changes nothing. Raises
    ValueError for a stack without a patch (the keys of `STACK_PATCHES`) or an installed release
    the patch was not read from."""
    patch = _patch(stack)
    version = importlib.metadata.version(patch.distribution)
    if version not in patch.versions:
        raise ValueError(f"{patch.distribution} {version}: patch_stack_logprobs({stack!r}) is read from {patch.distribution} {', '.join(patch.versions)} only")
    module = importlib.import_module(patch.module)
    if stack not in _originals:
        _originals[stack] = getattr(module, patch.attribute)
        setattr(module, patch.attribute, patch.replacement)
    return patch


def unpatch_stack_logprobs(stack: str) -> None:
    """Put `stack`'s own log-prob function back; nothing happens when it is not patched."""
    patch = _patch(stack)
    if stack in _originals:
        setattr(importlib.import_module(patch.module), patch.attribute, _originals.pop(stack))


def _patch(stack: str) -> StackPatch:
    if stack not in STACK_PATCHES:
        raise ValueError(f"no log-prob patch for {stack!r}; patched stacks: {sorted(STACK_PATCHES)}")
    return STACK_PATCHES[stack]
