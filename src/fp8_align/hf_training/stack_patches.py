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
- TRL 1.16.0's GRPOTrainer: `trl.trainer.grpo_trainer.add_fused_lm_head`, which the trainer calls on
  its policy (and reference model) at construction. TRL's own fused head multiplies the LM head's
  BF16 product by 1/T in its chunked kernel, and its batch is left-padded with no `position_ids`.
  The replacement installs, on a converted model, a `fused_lm_head=True` forward of the same
  contract: positions from the attention mask (each sequence from 0, as the engine numbers it),
  the converted model's FP32 logits, the engine's division by T and its log-softmax (the engine's
  `processed_logprobs`, which TRL asks vLLM for). It refuses a model `make_bitwise` did not convert,
  `cast_lm_head_to_fp32`, pre-shifted labels (context parallel) and outputs other than log-probs
  and entropy.

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

from fp8_align.hf_training.convert import CONTEXT_ATTRIBUTE
from fp8_align.hf_training.engine_ops import divided_by_temperature, kernels_for, label_logprobs, row_logprobs

#: TRL's `add_fused_lm_head` outputs the TRL patch computes (log-probs always; entropy on request).
TRL_OUTPUTS = ("log_probs", "entropy")
#: Rows of logits the TRL patch materializes at once (FP32 [rows, V]).
TRL_CHUNK_ROWS = 2048


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


def trl_add_fused_lm_head(
    model: torch.nn.Module, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False, outputs: tuple[str, ...] = ("log_probs",)
) -> None:
    """TRL 1.16.0's `add_fused_lm_head` contract for a model converted by `make_bitwise`: afterwards
    `model(input_ids=[B, S], attention_mask=[B, S], labels=[B, S] (-100: not scored),
    fused_lm_head=True)` returns TRL's `FusedCausalLMOutput` whose `log_probs` [B, S - 1] (FP32, 0
    where not scored) are the engine's processed log-probs at `temperature` of the next tokens, with
    autograd's gradient; `entropy` [B, S - 1] of the same distribution when asked; without
    `fused_lm_head` the forward is the model's own. Positions come from the attention mask (TRL's
    prompts are left-padded). Raises ValueError for a model not converted, `cast_lm_head_to_fp32`,
    or outputs other than `TRL_OUTPUTS`."""
    if not hasattr(model, CONTEXT_ATTRIBUTE):
        raise ValueError(
            f"fp8_align's TRL patch scores with the engine's kernels: convert {type(model).__name__} with make_bitwise(model, cfg) before "
            "the trainer is built (the reference model too when beta > 0)"
        )
    if cast_lm_head_to_fp32:
        raise ValueError("cast_lm_head_to_fp32=True would feed the LM head FP32 activations; the engine multiplies BF16 (leave it False)")
    unknown = sorted(set(outputs) - set(TRL_OUTPUTS))
    if unknown:
        raise ValueError(f"fp8_align's TRL patch computes {', '.join(TRL_OUTPUTS)}; asked for {', '.join(unknown)} too")
    own_forward = model.forward
    output_class = importlib.import_module("trl.trainer.utils").FusedCausalLMOutput

    @functools.wraps(type(model).forward)
    def engine_fused_forward(
        self: torch.nn.Module, *args: Any, fused_lm_head: bool = False, labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None, num_items_in_batch: torch.Tensor | int | None = None, **kwargs: Any,
    ) -> Any:  # fmt: skip
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return own_forward(*args, **kwargs, **{key: value for key, value in extra.items() if value is not None})
        if shift_labels is not None or labels is None:
            raise NotImplementedError("fp8_align's TRL patch takes `labels` (no pre-shifted labels: context parallelism is not bitwise)")
        mask_2d = kwargs.get("attention_mask")
        if kwargs.get("position_ids") is None and mask_2d is not None:
            kwargs["position_ids"] = (mask_2d.long().cumsum(-1) - 1).clamp(min=0)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        targets = labels[:, 1:].to(hidden.device)
        mask = targets != -100
        head, rows, picked = self.get_output_embeddings(), hidden[mask], targets[mask]
        names = TRL_OUTPUTS if "entropy" in outputs else ("log_probs",)
        per_token: dict[str, list[torch.Tensor]] = {name: [rows[:0, 0].float()] for name in names}  # connected even when empty
        for start in range(0, rows.shape[0], TRL_CHUNK_ROWS):
            logprobs = row_logprobs(divided_by_temperature(head(rows[start : start + TRL_CHUNK_ROWS]), temperature), kernels_for(rows.device))
            per_token["log_probs"].append(logprobs.gather(1, picked[start : start + TRL_CHUNK_ROWS, None])[:, 0])
            if "entropy" in names:
                per_token["entropy"].append(-(logprobs.exp() * logprobs).sum(-1))
        # masked_scatter keeps an all-masked micro-batch connected to the graph, as TRL does
        scattered = {name: mask.new_zeros(mask.shape, dtype=torch.float32).masked_scatter(mask, torch.cat(parts)) for name, parts in per_token.items()}
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return output_class(
            loss=-scattered["log_probs"].sum() / count, log_probs=scattered["log_probs"], entropy=scattered.get("entropy"),
            log_sum_sq_probs=None, mean_logits=None, is_top1=None, label_mask=mask, aux_loss=None,
        )  # fmt: skip

    model.forward = engine_fused_forward.__get__(model)


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
    "trl": StackPatch("trl.trainer.grpo_trainer", (("add_fused_lm_head", trl_add_fused_lm_head),), ("1.16.0",), _distribution_version("trl")),
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


def is_patched(stack: str) -> bool:
    """Whether `patch_stack_logprobs(stack)` is in effect in this process. Raises ValueError for a
    stack without a patch."""
    _patch(stack)
    return stack in _originals


def unpatch_stack_logprobs(stack: str) -> None:
    """Put `stack`'s own log-prob code back; nothing happens when it is not patched."""
    _patch(stack)
    for owner, attribute, original in _originals.pop(stack, []):
        setattr(owner, attribute, original)


def _patch(stack: str) -> StackPatch:
    if stack not in STACK_PATCHES:
        raise ValueError(f"no log-prob patch for {stack!r}; patched stacks: {sorted(STACK_PATCHES)}")
    return STACK_PATCHES[stack]
