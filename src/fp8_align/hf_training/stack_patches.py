"""The RL stacks' own log-prob functions in the trainer process, replaced by the engine's.

A converted model (`make_bitwise`) returns the engine's FP32 logits. The stack then divides them
by the temperature and takes the labels' log-probs in its own code. Where that code is not the
engine's log-softmax (docs/on_policy.md, "What the stacks do"), `patch_stack_logprobs(stack)`
replaces the functions the stack calls with ones of the same contract that compute
`engine_ops.label_logprobs`: vLLM's batch-invariant log-softmax on CUDA (the engine sampler's),
the pure-torch one elsewhere, with autograd's gradient.

Each patch names the module attributes it replaces and the release it was read from; another
installed release is refused. A patch applies only when asked, and applies once however often it is
asked. `unpatch_stack_logprobs(stack)` puts the originals back.

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
- NeMo RL 0.6.0 (read at commit 7ea279a; `nemo_rl.__version__`, since its PyPI name is a
  placeholder), its DTensor policy's log-prob unit `nemo_rl.models.automodel.train`:
  `apply_temperature_scaling(logits, sampling_params)` (an in-place division by a Python float) by
  the engine's division, `LogprobsPostProcessor._compute_local_logprobs(self, logits, input_ids)`
  (torch's log-softmax and gather) by the engine's log-softmax, and
  `get_logprobs_from_vocab_parallel_logits` (its tensor- and context-parallel path) by a refusal:
  a converted model is bitwise at tensor and context parallel size 1.
- NeMo RL 0.6.0's Megatron policy log-prob unit (`nemo_rl.models.megatron.train`, the same commit),
  on a bitwise megatron-core GPTModel (`fp8_align.megatron_ext.bitwise`): `apply_temperature_scaling`
  (an in-place division by a Python float, whose result its caller drops) by the engine's division,
  in place; `nemo_rl.distributed.model_utils.DistributedLogprob` (its own composed log-softmax, with
  a hand-written backward) by the engine's log-softmax; its chunked and top-k/top-p variants by
  refusals. Each holds at tensor and context parallel size 1.

Each replacement is a dotted path inside the patch's module, or `other.module:path` in another one.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fp8_align.hf_training.engine_ops import divided_by_temperature, kernels_for, label_logprobs


@dataclass(frozen=True)
class StackPatch:
    """One stack's log-prob code: the module, its attributes replaced (dotted paths inside it, with
    their replacements), the releases it was read from and how to ask for the installed one."""

    module: str
    replacements: tuple[tuple[str, Callable[..., Any]], ...]
    versions: tuple[str, ...]
    installed_version: Callable[[], str]


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


def nemo_rl_apply_temperature_scaling(logits: torch.Tensor, sampling_params: Any) -> torch.Tensor:
    """NeMo RL's `apply_temperature_scaling` contract: `logits` [B, S, V] divided by
    `sampling_params.temperature` (none given, or 1: unchanged), as the engine divides
    (`divided_by_temperature`, out of place). Raises ValueError for logits that are not FP32."""
    if sampling_params is None or sampling_params.temperature == 1.0:
        return logits
    if logits.dtype != torch.float32:
        raise ValueError(f"fp8_align's NeMo RL patch takes a converted model's FP32 logits (make_bitwise); these are {logits.dtype}")
    return divided_by_temperature(logits, sampling_params.temperature)


def nemo_rl_compute_local_logprobs(self: Any, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """NeMo RL's `LogprobsPostProcessor._compute_local_logprobs` contract: FP32 [B, S - 1]
    log-probs of `input_ids[:, 1:]` [B, S] under `logits` [B, >= S - 1, V], by
    `engine_label_logprobs` (rows are independent, so NeMo RL's `logprob_chunk_size` changes no
    bit). Raises ValueError where NeMo RL would filter by top-k or top-p first."""
    params = self.sampling_params
    if params is not None and ((params.top_k is not None and params.top_k > 0) or (params.top_p is not None and params.top_p != 1.0)):
        raise ValueError("fp8_align's NeMo RL patch takes no top-k/top-p filtering of the logits (the engine's processed log-probs are compared unfiltered)")
    next_tokens = input_ids[:, 1:].to(logits.device)
    return engine_label_logprobs(logits[:, : next_tokens.shape[1]], next_tokens)


def nemo_rl_parallel_logprobs_refused(*args: Any, **kwargs: Any) -> torch.Tensor:
    """NeMo RL's vocab-parallel log-prob path (tensor or context parallel size > 1): refused."""
    raise NotImplementedError("fp8_align's NeMo RL patch is bitwise at tensor and context parallel size 1 only: its DTensor policy took the vocab-parallel log-prob path")


def nemo_rl_megatron_apply_temperature_scaling(logits: torch.Tensor, sampling_params: Any) -> torch.Tensor:
    """NeMo RL's Megatron `apply_temperature_scaling` contract: `logits` [..., V] divided in place by
    `sampling_params.temperature` (none given, or 1: unchanged) and returned; the division is the
    engine's (by an FP32 tensor, a true division on CUDA). In place because NeMo RL's caller keeps its
    own reference and drops the result. Raises ValueError for logits that are not FP32."""
    if sampling_params is None or sampling_params.temperature == 1.0:
        return logits
    if logits.dtype != torch.float32:
        raise ValueError(f"fp8_align's NeMo RL Megatron patch takes a bitwise GPTModel's FP32 logits; these are {logits.dtype}")
    return logits.div_(torch.full((*logits.shape[:-1], 1), sampling_params.temperature, dtype=torch.float32, device=logits.device))


class EngineDistributedLogprob:
    """NeMo RL's `DistributedLogprob` (an autograd Function) at tensor parallel size 1: `apply(logits
    [..., V], target [...], vocab_start_index, vocab_end_index, group, inference_only=False)` -> FP32
    [...] log-probs of `target`, by `engine_label_logprobs` (autograd's gradient). Raises
    NotImplementedError for a group of more than one rank or a slice of the vocabulary."""

    @staticmethod
    def apply(
        logits: torch.Tensor, target: torch.Tensor, vocab_start_index: int, vocab_end_index: int, group: Any, inference_only: bool = False
    ) -> torch.Tensor:
        ranks = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
        if ranks != 1 or vocab_start_index != 0 or vocab_end_index != logits.shape[-1]:
            raise NotImplementedError(
                f"fp8_align's NeMo RL Megatron patch is bitwise at tensor parallel size 1 only (a group of {ranks} ranks, "
                f"vocabulary rows {vocab_start_index}..{vocab_end_index} of {logits.shape[-1]})"
            )
        return engine_label_logprobs(logits, target)


class RefusedLogprob:
    """A NeMo RL log-prob Function that has no engine counterpart here: `apply` raises NotImplementedError."""

    def __init__(self, name: str, why: str) -> None:
        self.name, self.why = name, why

    def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(f"fp8_align's NeMo RL Megatron patch refuses {self.name}: {self.why}")


def _nemo_rl_version() -> str:
    return importlib.import_module("nemo_rl.package_info").__shortversion__


def _distribution_version(distribution: str) -> Callable[[], str]:
    return lambda: importlib.metadata.version(distribution)


#: The stacks whose log-prob code `patch_stack_logprobs` replaces.
STACK_PATCHES: dict[str, StackPatch] = {
    "verl": StackPatch(
        "verl.workers.engine.fsdp.transformer_impl", (("logprobs_from_logits", verl_logprobs_from_logits),),
        ("0.9.1",), _distribution_version("verl"),
    ),
    "openrlhf": StackPatch(
        "openrlhf.models.actor", (("log_probs_from_logits", openrlhf_log_probs_from_logits),),
        ("0.11.2",), _distribution_version("openrlhf"),
    ),
    "nemo_rl": StackPatch(
        "nemo_rl.models.automodel.train",
        (
            ("apply_temperature_scaling", nemo_rl_apply_temperature_scaling),
            ("LogprobsPostProcessor._compute_local_logprobs", nemo_rl_compute_local_logprobs),
            ("get_logprobs_from_vocab_parallel_logits", nemo_rl_parallel_logprobs_refused),
        ),
        ("0.6.0",), _nemo_rl_version,
    ),
    "nemo_rl_megatron": StackPatch(
        "nemo_rl.models.megatron.train",
        (
            ("apply_temperature_scaling", nemo_rl_megatron_apply_temperature_scaling),
            ("nemo_rl.distributed.model_utils:DistributedLogprob", EngineDistributedLogprob),
            ("nemo_rl.distributed.model_utils:ChunkedDistributedLogprob",
             RefusedLogprob("ChunkedDistributedLogprob", "unset policy.logprob_chunk_size (rows are independent: chunking changes no bit)")),
            ("nemo_rl.distributed.model_utils:DistributedLogprobWithSampling",
             RefusedLogprob("DistributedLogprobWithSampling", "top-k/top-p filtering is not compared (the engine's processed log-probs are unfiltered)")),
            ("nemo_rl.distributed.model_utils:ChunkedDistributedLogprobWithSampling",
             RefusedLogprob("ChunkedDistributedLogprobWithSampling", "top-k/top-p filtering is not compared")),
        ),
        ("0.6.0",), _nemo_rl_version,
    ),
}  # fmt: skip
_originals: dict[str, list[tuple[Any, str, Any]]] = {}


def patch_stack_logprobs(stack: str) -> StackPatch:
    """Replace `stack`'s log-prob code in this process with the engine's (module docstring);
    returns the patch. Imports the stack's module; a second call changes nothing. Raises
    ValueError for a stack without a patch (the keys of `STACK_PATCHES`) or an installed release
    the patch was not read from."""
    patch = _patch(stack)
    version = patch.installed_version()
    if version not in patch.versions:
        raise ValueError(f"{stack} {version}: patch_stack_logprobs({stack!r}) is read from {stack} {', '.join(patch.versions)} only")
    module = importlib.import_module(patch.module)
    if stack not in _originals:
        saved = []
        for path, replacement in patch.replacements:
            where, _, inside = path.rpartition(":")
            *owners, attribute = inside.split(".")
            owner = functools.reduce(getattr, owners, importlib.import_module(where) if where else module)
            saved.append((owner, attribute, getattr(owner, attribute)))
            setattr(owner, attribute, replacement)
        _originals[stack] = saved
    return patch


def unpatch_stack_logprobs(stack: str) -> None:
    """Put `stack`'s own log-prob code back; nothing happens when it is not patched."""
    _patch(stack)
    for owner, attribute, original in _originals.pop(stack, []):
        setattr(owner, attribute, original)


def _patch(stack: str) -> StackPatch:
    if stack not in STACK_PATCHES:
        raise ValueError(f"no log-prob patch for {stack!r}; patched stacks: {sorted(STACK_PATCHES)}")
    return STACK_PATCHES[stack]
