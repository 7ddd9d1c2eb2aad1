"""The RL stacks' own weight sync on an fp8_align engine: the model's `load_weights` re-quantizes.

RL stacks push new weights with vLLM's model API, not with `refit_weights`: OpenRLHF's
`WorkerWrap.update_weight` calls `model_runner.model.load_weights(weights=[(name, tensor)])` once
per tensor, verl's rollout calls `model.load_weights(bucket)` per bucket, NeMo RL's refit ends in
the same call. On an fp8_align engine that call works as on a BF16 engine and leaves every FP8
layer it touched holding `fp8_align.quant` of the new weight:

- Each FP8 layer's codes Parameter carries a `weight_loader`
  (`linear.method.requantizing_weight_loader`). The model's own `load_weights` maps Hugging Face
  names onto modules, picks the shard (q/k/v, gate/up) and calls it; it runs the layer's own BF16 loader into a staging tensor of the
  layer's BF16 shape (which cuts this rank's tensor-parallel slice exactly as at engine start)
  and quantizes the shard it wrote into the existing codes and scale rows, so data pointers (and
  captured CUDA graphs) stay valid. Each shard has its own 128x128 grid, so a shard is final as
  soon as it arrives: q, k and v may come in separate calls.
- FP8 routed experts get the same treatment from `moe.experts.requantizing_expert_loader`: the
  model's expert mapping calls it per expert and shard (gate w1, up w3, down w2); transformers-5
  fused expert tensors are split per expert before validation (`refit.experts`), and MLA
  attention modules whose `kv_b_proj` was written rebuild their absorbed weights.
- `install_weight_sync(model, model_config)` (run by the `weight_sync_on_loaded_models` patch
  once vLLM processed a freshly loaded fp8_align model) replaces that model instance's
  `load_weights` with one that first validates the whole call (every name a tensor of the
  checkpoint the engine was started from, its shape, a bf16/fp16/fp32 dtype, finite values) and
  raises `RefitError` naming the tensor before anything is written (under tensor parallelism
  on every rank: the ranks agree over vLLM's TP group first, so a tensor that is bad on one rank
  only is refused by all and no rank writes); then runs the model's own
  `load_weights`; then rebuilds the CPU kernel copies (packed BF16 weights) of the modules it
  wrote into.
- Attention scales in the call, under vLLM's names (`model.layers.N.self_attn.k_scale`, ...; NeMo
  RL appends them to its refit for an FP8 KV cache), are taken out of the batch, validated with it
  (one finite positive value, an attention layer of the model) and written into the attention
  layers in place after the weights, as `push_kv_scales` would (`kv.scales.split_kv_scale_entries`).
- While vLLM reloads the model itself (its layerwise `reload_weights`, the weight-transfer API),
  the call passes through unchanged: vLLM rebuilds each layer in checkpoint format and
  fp8_align's `process_weights_after_loading` quantizes it, into the same storage.

`refit_weights` (refit/push.py) stays the fast path for callers that can use it: it validates and
quantizes all FP8 shards of an update in one grouped kernel launch and reports phase timings.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from fp8_align.checks import start_nonfinite_check
from fp8_align.quant import FP8_DTYPE
from fp8_align.vllm_plugin.checkpoint import (
    SYNC_DTYPES,
    RefitError,
    check_tensor,
    checkpoint_layout,
    modules_named,
)
from fp8_align.vllm_plugin.kv.scales import KVScales, split_kv_scale_entries, streamed_scale_layers, write_streamed_scales
from fp8_align.vllm_plugin.layer_state import fp8_align_layers, is_fp8_align_layer
from fp8_align.vllm_plugin.linear.method import Fp8AlignBf16LinearMethod
from fp8_align.vllm_plugin.refit.mla import check_mla_weights_kept, refresh_mla_absorbed_weights
from fp8_align.vllm_plugin.refit.experts import (
    prepacked_bf16_expert_prefixes,
    refuse_prepacked_experts,
    unfuse_expert_tensors,
)

logger = logging.getLogger("vllm.fp8_align")

#: vLLM methods whose modules keep a CPU kernel copy derived from their weight (rebuilt after a
#: write), besides fp8_align's `Fp8AlignBf16LinearMethod`.
_VLLM_PACKED_ON_CPU = ("UnquantizedEmbeddingMethod",)


@dataclass
class _SyncState:
    """What `install_weight_sync` changed on one model (undone by `uninstall_weight_sync`)."""

    model_config: Any
    fp8_layers: list[torch.nn.Module]
    managed_layers: list[torch.nn.Module]
    packed_modules: list[torch.nn.Module]
    wrapped_loaders: list[tuple[torch.nn.Parameter, Callable[..., Any] | None]]
    #: checkpoint-name prefixes of BF16 experts that vLLM prepacked on CPU (not loadable later)
    prepacked_experts: tuple[str, ...] = ()
    dirty: set[int] = field(default_factory=set)


_installed: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_STATE = "_fp8_align_sync"


def install_weight_sync(model: torch.nn.Module, model_config: Any) -> bool:
    """Make `model.load_weights` validate and re-quantize (see the module docstring), on this
    instance only. Returns False (and changes nothing) for a model with no fp8_align layers;
    raises WeightSyncError where vLLM released an FP8 layer's weight (`mla.check_mla_weights_kept`).
    Idempotent. `model_config` is vLLM's ModelConfig: its `.model` names the checkpoint that
    synced tensors are validated against.
    """
    if _STATE in model.__dict__:
        return True
    modules = list(model.modules())
    fp8_layers = fp8_align_layers(model)
    bf16_layers = [m for m in modules if isinstance(getattr(m, "quant_method", None), Fp8AlignBf16LinearMethod)]
    managed = fp8_layers + bf16_layers
    if not managed:
        return False
    check_mla_weights_kept(model)
    packed = [m for m in modules if _packed_on_cpu(getattr(m, "quant_method", None)) and m.weight.device.type == "cpu"]
    state = _SyncState(model_config, fp8_layers, managed, packed, [], prepacked_bf16_expert_prefixes(modules))
    for param in {id(m.weight): m.weight for m in packed}.values():
        original = getattr(param, "weight_loader", None)
        param.weight_loader = _marking_loader(original or default_weight_loader, state.dirty, id(param))
        state.wrapped_loaders.append((param, original))
    model.__dict__[_STATE] = state
    model.__dict__["load_weights"] = functools.partial(_synced_load_weights, weakref.ref(model), type(model).load_weights)
    _installed.add(model)
    logger.info(
        "fp8_align: %s.load_weights re-quantizes %d FP8 layers (the RL stacks' weight sync)", type(model).__name__, len(fp8_layers)
    )
    return True


def _packed_on_cpu(method: Any) -> bool:
    """True for the quant methods whose CPU modules keep a packed kernel copy of their weight."""
    return isinstance(method, Fp8AlignBf16LinearMethod) or type(method).__name__ in _VLLM_PACKED_ON_CPU


def uninstall_weight_sync(model: torch.nn.Module) -> None:
    """Undo `install_weight_sync` on `model` (a no-op when it is not installed)."""
    state: _SyncState | None = model.__dict__.pop(_STATE, None)
    if state is None:
        return
    model.__dict__.pop("load_weights", None)
    for param, original in state.wrapped_loaders:
        if original is None:
            del param.weight_loader
        else:
            param.weight_loader = original
    _installed.discard(model)


def uninstall_all() -> None:
    """`uninstall_weight_sync` on every model it was installed on in this process."""
    for model in list(_installed):
        uninstall_weight_sync(model)


def _marking_loader(original: Callable[..., Any], dirty: set[int], key: int) -> Callable[..., Any]:
    @functools.wraps(original)
    def marking_loader(*args: Any, **kwargs: Any) -> Any:
        dirty.add(key)
        return original(*args, **kwargs)

    return marking_loader


def _synced_load_weights(
    model_ref: weakref.ref[torch.nn.Module], class_load_weights: Callable[..., Any], weights: Iterable[tuple[str, torch.Tensor]]
) -> Any:
    model = model_ref()
    assert model is not None
    state: _SyncState = model.__dict__[_STATE]
    if _vllm_is_reloading(state):
        return class_load_weights(model, weights)
    batch, scales, scale_layers = _agreed_batch(model, weights, state)
    state.dirty.clear()
    with torch.no_grad(), _requantized_load_warnings_dropped():
        loaded = class_load_weights(model, batch)
        write_streamed_scales(scale_layers, scales)
        for module in state.packed_modules:
            if id(module.weight) in state.dirty:
                module.quant_method.process_weights_after_loading(module)
        refresh_mla_absorbed_weights(model, modules_named(model, [name for name, _ in batch]), state.model_config.dtype)
    state.dirty.clear()
    return loaded


def _agreed_batch(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], state: _SyncState
) -> tuple[list[tuple[str, torch.Tensor]], KVScales, dict[int, torch.nn.Module]]:
    """(validated weights, streamed KV-scale entries, their attention layers) of this call, once every
    tensor-parallel rank validated its own.

    Each rank is sent the full HF tensors and validates what it got; a sync whose tensors differ
    between ranks (a trainer bug, a corrupted receive on one rank) could pass on one rank and not
    on another. So the ranks agree over vLLM's TP group (its gloo CPU group, one all-reduce of a
    flag per call) before any rank writes: if one refuses, every rank raises and none writes.
    The refusing rank raises its own error; the others raise `RefitError` quoting it.
    """
    try:
        batch, scales = split_kv_scale_entries(list(weights))
        batch = validate_sync_batch(batch, state.model_config)
        refuse_prepacked_experts([name for name, _ in batch], state.prepacked_experts)
        scale_layers = streamed_scale_layers(model, scales) if scales else {}
    except Exception as error:
        _tp_refusals(str(error))
        raise
    refusals = _tp_refusals(None)
    if refusals:
        rank, message = next(iter(refusals.items()))
        raise RefitError(f"tensor-parallel rank {rank} refused this load_weights call, so no rank wrote anything: {message}")
    return batch, scales, scale_layers


def _tp_refusals(error: str | None) -> dict[int, str]:
    """Agree with the other ranks of vLLM's tensor-parallel group on one `load_weights` call.

    Every rank calls this once per call with its own refusal (None: it accepted). Returns the
    refusals of all ranks by TP rank, {} when all accepted; without tensor parallelism, this
    rank's own. One all-reduce of a flag when all accept; the messages are gathered only when one
    refused."""
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    group = get_tp_group() if model_parallel_is_initialized() else None
    if group is None or group.world_size == 1:
        return {} if error is None else {0: error}
    refused = torch.tensor([error is not None], dtype=torch.int32)
    torch.distributed.all_reduce(refused, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    if not refused.item():
        return {}
    messages: list[str | None] = [None] * group.world_size
    torch.distributed.all_gather_object(messages, error, group=group.cpu_group)
    return {rank: message for rank, message in enumerate(messages) if message is not None}


#: vLLM 0.32's generic loader (`AutoWeightsLoader._load_param`, vllm/model_executor/models/utils.py)
#: warns "Attempted to load weight ... with dtype torch.bfloat16 into parameter with dtype
#: torch.float8_e4m3fn" for every BF16 tensor it hands to an FP8 parameter, before it calls that
#: parameter's loader. On an fp8_align engine that loader is fp8_align's and re-quantizes; nothing
#: is cast, and a stack syncing every step would log one such line per tensor per step.
_VLLM_LOADER_LOGGER = "vllm.model_executor.models.utils"


class _RequantizedLoadWarningFilter(logging.Filter):
    """Drops only that warning, and only for FP8 destination parameters."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("Attempted to load weight") and len(args) == 3 and args[2] == FP8_DTYPE)


@contextlib.contextmanager
def _requantized_load_warnings_dropped() -> Iterator[None]:
    logger, dropper = logging.getLogger(_VLLM_LOADER_LOGGER), _RequantizedLoadWarningFilter()
    logger.addFilter(dropper)
    try:
        yield
    finally:
        logger.removeFilter(dropper)


def _vllm_is_reloading(state: _SyncState) -> bool:
    """True while vLLM's layerwise reload has the layers back in checkpoint format (meta BF16)."""
    return any(_codes(layer).is_meta for layer in state.managed_layers) or any(
        _codes(layer).dtype != FP8_DTYPE for layer in state.fp8_layers
    )


def _codes(layer: torch.nn.Module) -> torch.Tensor:
    """The weight of a managed layer: the FP8 codes of an fp8_align routed-experts layer
    (`w13_weight`) or linear (`weight`), the BF16 weight of an fp8_align BF16 linear."""
    return layer.w13_weight if is_fp8_align_layer(layer, "experts") else layer.weight


def validate_sync_batch(batch: list[tuple[str, torch.Tensor]], model_config: Any) -> list[tuple[str, torch.Tensor]]:
    """Check one `load_weights` call before anything is written; raise RefitError naming the
    first bad tensor. Each entry must be (name, tensor) with a name of the engine's checkpoint
    (`lm_head.weight` also when the model ties it to the embeddings; transformers-5 fused expert
    tensors are first split per expert), that tensor's shape, a dtype in SYNC_DTYPES, no name
    twice, and only finite values. Returns the batch to load (fused experts split)."""
    layout = checkpoint_layout(model_config.model)
    if getattr(model_config.hf_text_config, "tie_word_embeddings", False) and "lm_head.weight" not in layout:
        embeddings = next((spec for name, spec in layout.items() if name.endswith("embed_tokens.weight")), None)
        layout = {**layout, "lm_head.weight": embeddings} if embeddings else layout
    for entry in batch:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.Tensor)):
            raise RefitError(f"load_weights takes (name, tensor) pairs; got {type(entry).__name__} {str(entry)[:80]}")
    batch = unfuse_expert_tensors(batch, layout)
    seen: set[str] = set()
    for name, tensor in batch:
        if name in seen:
            raise RefitError(f"{name}: sent twice in one load_weights call")
        seen.add(name)
        check_tensor(name, tensor, layout, SYNC_DTYPES)
    bad = start_nonfinite_check([tensor for _, tensor in batch])()
    if bad:
        raise RefitError(f"{batch[bad[0]][0]}: holds NaN or Inf")
    return batch
