"""Per-layer Q/K/V amax on the training side, turned into the KV-cache scales vLLM accepts.

What is measured — the tensors attention consumes, i.e. what vLLM's FP8 KV cache stores (K and V
after RoPE) and what FP8 attention quantizes (Q after RoPE):

- Megatron Core `SelfAttention` (megatron/core/transformer/attention.py): a forward pre-hook on
  its `core_attention` submodule reads the `query`, `key`, `value` arguments. `Attention.forward`
  applies RoPE (and QK layernorm, when configured) before calling `core_attention`, so these are
  post-RoPE, local to this rank's tensor-parallel heads, [sq, b, heads, head_dim] or packed
  [t, heads, head_dim]. Layer index = `layer_number - 1` (global, pipeline offset included).
- Hugging Face attention modules (LlamaAttention, Qwen3Attention, ... : modules with `q_proj`,
  `k_proj`, `v_proj`, `layer_idx`, `head_dim`): HF applies RoPE inside `forward` with no module to
  hook, so the calibrator keeps the outputs of `q_norm`/`k_norm` when the module has them (Qwen3),
  else of `q_proj`/`k_proj`, and applies the model's own `apply_rotary_pos_emb` (from the module's
  modeling file) with the `position_embeddings` the layer was called with. V is `v_proj`'s output.
  Layer index = `layer_idx`.

Scales follow vLLM's attention-layer convention (`_k_scale`, `_v_scale`, `_q_scale`): one FP32
per-tensor dequantization multiplier, `scale = amax / 448`; a layer whose amax stays 0 gets 1.0.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from fp8_align.quant.scales import scale_from_amax

#: Order of the tensors in every per-layer record.
TENSOR_KINDS = ("k", "v", "q")

_Recorder = Callable[[str, torch.Tensor], None]


class KVScaleCalibrator:
    """Running max of |K|, |V|, |Q| per decoder layer over the forward passes run inside `with`.

    Usage::

        with KVScaleCalibrator(model) as calib:
            for batch in calibration_batches:
                model(**batch)
        scales = calib.scales()  # {layer: {"k_scale": float, "v_scale": float, "q_scale": float}}

    Hooks are registered on entry and removed on exit; the running maxima persist, so entering
    again keeps accumulating. Backward recomputation (activation checkpointing) re-observes the
    same tensors and does not change the maxima.
    """

    def __init__(self, model: nn.Module | Iterable[nn.Module]) -> None:
        """`model`: one module or the model chunks of this rank (virtual pipeline)."""
        self._models = [model] if isinstance(model, nn.Module) else list(model)
        self._amax: dict[int, dict[str, torch.Tensor]] = {}
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> KVScaleCalibrator:
        if self._handles:
            raise RuntimeError("KVScaleCalibrator is already active")
        try:
            for layer_index, module in _attention_modules(self._models).items():
                record = self._recorder(layer_index)
                if _is_megatron_self_attention(module):
                    self._handles.append(_hook_megatron_attention(module, record))
                else:
                    self._handles += _HFAttentionProbe(module, record).register()
        except Exception:
            self._remove_hooks()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._remove_hooks()

    def amaxes(self, group: dist.ProcessGroup | None = None) -> dict[int, dict[str, float]]:
        """{layer: {"k_amax", "v_amax", "q_amax"}}: max |x| seen, in the tensors' units, as floats.

        group: ranks holding the same layers (tensor-, context-, data-parallel peers) whose
        maxima are combined with an all-reduce(MAX); None combines nothing. Every rank of the
        group must have observed the same layer indices.
        """
        layers, table = self._amax_table(group)
        return _per_layer(layers, table, "amax")

    def scales(self, group: dist.ProcessGroup | None = None) -> dict[int, dict[str, float]]:
        """{layer: {"k_scale", "v_scale", "q_scale"}}: FP32 `amax / 448` per tensor (1.0 for amax 0).

        group: as for `amaxes`.
        """
        layers, table = self._amax_table(group)
        return _per_layer(layers, scale_from_amax(table, pow2=False), "scale")

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _amax_table(self, group: dist.ProcessGroup | None) -> tuple[list[int], torch.Tensor]:
        """Sorted layer indices and their [num_layers, 3] FP32 maxima (CPU) in `TENSOR_KINDS` order."""
        if not self._amax:
            raise RuntimeError("no attention forward pass was observed inside `with KVScaleCalibrator(...)`")
        layers = sorted(self._amax)
        table = torch.stack([torch.stack([self._amax[layer][kind] for kind in TENSOR_KINDS]) for layer in layers])
        if group is not None:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        # On CPU, `amax / 448` is a correctly rounded division (CUDA multiplies by 1/448).
        return layers, table.cpu()

    def _recorder(self, layer_index: int) -> _Recorder:
        def record(kind: str, tensor: torch.Tensor) -> None:
            if tensor.numel() == 0:
                return
            amax = tensor.detach().abs().amax().to(torch.float32)
            seen = self._amax.setdefault(layer_index, {})
            seen[kind] = amax if kind not in seen else torch.maximum(seen[kind], amax)

        return record


def _per_layer(layers: list[int], table: torch.Tensor, suffix: str) -> dict[int, dict[str, float]]:
    rows = table.tolist()
    return {
        layer: {f"{kind}_{suffix}": value for kind, value in zip(TENSOR_KINDS, row)} for layer, row in zip(layers, rows)
    }


def _attention_modules(models: list[nn.Module]) -> dict[int, nn.Module]:
    found: dict[int, nn.Module] = {}
    for model in models:
        for module in model.modules():
            if _is_megatron_self_attention(module):
                index = module.layer_number - 1
            elif _is_hf_attention(module):
                index = module.layer_idx
            else:
                continue
            if index in found:
                raise ValueError(
                    f"two attention modules claim decoder layer {index} "
                    f"({type(found[index]).__name__}, {type(module).__name__}); pass only the decoder"
                )
            found[index] = module
    if not found:
        raise ValueError(
            "no supported attention modules found: expected megatron.core SelfAttention or Hugging Face "
            "attention modules with q_proj/k_proj/v_proj/layer_idx/head_dim"
        )
    return found


def _is_megatron_self_attention(module: nn.Module) -> bool:
    # A Megatron module can only exist once megatron's attention module is imported.
    attention_module = sys.modules.get("megatron.core.transformer.attention")
    return attention_module is not None and isinstance(module, attention_module.SelfAttention)


def _is_hf_attention(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "layer_idx", "head_dim"))


def _hook_megatron_attention(module: nn.Module, record: _Recorder) -> RemovableHandle:
    def before_core_attention(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        names = ("query", "key", "value")
        query, key, value = (args[i] if i < len(args) else kwargs[name] for i, name in enumerate(names))
        record("q", query)
        record("k", key)
        record("v", value)

    return module.core_attention.register_forward_pre_hook(before_core_attention, with_kwargs=True)


class _HFAttentionProbe:
    """Hooks on one HF attention module that reproduce its post-RoPE query and key."""

    def __init__(self, module: nn.Module, record: _Recorder) -> None:
        modeling = sys.modules[type(module).__module__]
        rope = getattr(modeling, "apply_rotary_pos_emb", None)
        if rope is None:
            raise TypeError(
                f"{type(module).__name__} comes from {modeling.__name__}, which has no apply_rotary_pos_emb; "
                "its post-RoPE keys cannot be reproduced"
            )
        self._module = module
        self._record = record
        self._rope = rope
        self._signature = inspect.signature(module.forward)
        self._call: dict[str, Any] = {}

    def register(self) -> list[RemovableHandle]:
        module = self._module
        query_source = module.q_norm if hasattr(module, "q_norm") else module.q_proj
        key_source = module.k_norm if hasattr(module, "k_norm") else module.k_proj
        return [
            module.register_forward_pre_hook(self._before, with_kwargs=True),
            query_source.register_forward_hook(self._keeper("query")),
            key_source.register_forward_hook(self._keeper("key")),
            module.v_proj.register_forward_hook(self._record_value),
            module.register_forward_hook(self._after),
        ]

    def _before(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        if bound.get("position_embeddings") is None:
            raise ValueError(
                f"{type(self._module).__name__} (layer {self._module.layer_idx}) was called without "
                "position_embeddings; the calibrator needs them to apply RoPE"
            )
        self._call = {"input_shape": bound["hidden_states"].shape[:-1], "rope": bound["position_embeddings"]}

    def _record_value(self, _: nn.Module, __: Any, output: torch.Tensor) -> None:
        self._record("v", output)

    def _keeper(self, name: str) -> Callable[[nn.Module, Any, torch.Tensor], None]:
        def keep(_: nn.Module, __: Any, output: torch.Tensor) -> None:
            self._call[name] = output

        return keep

    def _after(self, module: nn.Module, _: Any, __: Any) -> None:
        call, self._call = self._call, {}
        heads = (*call["input_shape"], -1, module.head_dim)
        with torch.no_grad():
            query = call["query"].detach().reshape(heads).transpose(1, 2)
            key = call["key"].detach().reshape(heads).transpose(1, 2)
            cos, sin = call["rope"]
            query, key = self._rope(query, key, cos, sin)
        self._record("q", query)
        self._record("k", key)
