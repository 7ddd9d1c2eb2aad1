"""Push per-layer FP8 KV-cache (and query) scales into a running vLLM engine, e.g. every RL step.

Scales are vLLM's attention-layer convention: one FP32 per-tensor dequantization multiplier per
layer, `scale = amax / 448`, keyed by decoder-layer index, exactly what
`fp8_align.megatron_ext.calibration.KVScaleCalibrator.scales()` returns::

    {0: {"k_scale": 0.0123, "v_scale": 0.0045, "q_scale": 0.0210}, 1: {...}, ...}

`k_scale` and `v_scale` are required, `q_scale` optional. Every attention layer of the engine
must get scales (a missing or unknown layer raises), and all values must be finite and > 0;
nothing is written unless everything is valid. In each worker the values are written in place
(`_k_scale.fill_`, never rebinding, so captured graphs keep reading them) together with the host
copies backends read (`_k_scale_float`, `_k_scale_cpu`, ...). vLLM's weight reload resets these
to 1.0; `fp8_align.vllm_plugin.refit.refit_weights` puts the pushed values back after it, and so
does the `kv_scales_survive_post_processing` patch after vLLM's `process_weights_after_loading`
(which verl and NeMo RL run after every sync): each layer remembers the values last written into it.

Scales may also arrive inside a stack's weight stream, under vLLM's parameter names
(`model.layers.N.self_attn.k_scale`, `...self_attn.v_scale`, `...self_attn.attn.q_scale`: NeMo RL
appends these to its refit when its KV cache is FP8). `split_kv_scale_entries` takes them out of
a `load_weights` call; the weight sync writes them like pushed ones (`write_streamed_scales`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from fp8_align.vllm_plugin.kv.flashinfer_scales import unread_scales_reason
from fp8_align.vllm_plugin.worker_calls import call_workers

#: Scale names a layer may carry; the first two are required.
REQUIRED_KEYS = ("k_scale", "v_scale")
OPTIONAL_KEYS = ("q_scale",)

KVScales = dict[int, dict[str, float]]

#: Attribute where an attention layer keeps the scales last written into it.
PUSHED_SCALES_ATTR = "_fp8_align_kv_scales"

#: One attention scale in a weight stream, by vLLM's names (the targets of its
#: `maybe_remap_kv_scale_name`; NeMo RL's `get_vllm_qkv_scale_names`): layer index and q/k/v.
_STREAMED_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?([qkv])_scale$")


class KVScaleError(ValueError):
    """KV scales were refused; nothing in the engine was changed."""


def push_kv_scales(llm: Any, scales: Mapping[int, Mapping[str, float]]) -> None:
    """Write `scales` ({layer index: {"k_scale", "v_scale"[, "q_scale"]}}, FP32 amax/448) into every
    attention layer of every worker of `llm` (a `vllm.LLM`; needs VLLM_ALLOW_INSECURE_SERIALIZATION=1).

    Raises KVScaleError for a bad value or key here, and (raised in the workers, then here after
    every worker replied) when the layer set differs from the engine's attention layers. Clears the prefix cache: its FP8 KV entries were
    stored with the old scales.
    """
    payload = validate_kv_scales(scales)
    call_workers(llm, _push_kv_scales_in_worker, (payload,))
    llm.reset_prefix_cache()


def read_kv_scales(llm: Any) -> list[KVScales]:
    """Per worker: {layer index: {"k_scale", "v_scale", "q_scale"}} as the attention layers hold them
    (the FP32 buffers; `push_kv_scales` keeps the host copies equal)."""
    return call_workers(llm, _read_kv_scales_in_worker)


def engine_kv_scales(llm: Any) -> KVScales:
    """The scales every attention layer of `llm` holds now, {layer: {"k_scale", "v_scale",
    "q_scale"}}: the ones each rollout uses until the next push or calibration (the scales a
    bitwise trainer scores that rollout with, `BitwiseForward.set_kv_scales`). Raises KVScaleError
    when the workers hold different scales."""
    per_worker = read_kv_scales(llm)
    if any(scales != per_worker[0] for scales in per_worker[1:]):
        raise KVScaleError(f"the engine's {len(per_worker)} workers hold different K/V scales; push_kv_scales writes the same to all")
    return per_worker[0]


def validate_kv_scales(scales: Mapping[int, Mapping[str, float]]) -> KVScales:
    """Plain-float copy of `scales`, each value rounded to FP32 (the attention buffers' dtype, so
    buffers and host copies hold the same number); raises KVScaleError naming the first bad layer
    or value (a value that rounds to 0 in FP32 included)."""
    if not scales:
        raise KVScaleError("no KV scales given")
    payload: KVScales = {}
    for layer, values in scales.items():
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise KVScaleError(f"layer key {layer!r}: expected an int decoder-layer index")
        unknown = set(values) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS)
        missing = set(REQUIRED_KEYS) - set(values)
        if unknown or missing:
            raise KVScaleError(f"layer {layer}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
        payload[layer] = {}
        for key, value in values.items():
            fp32 = torch.tensor(float(value), dtype=torch.float32).item()
            if not math.isfinite(fp32) or fp32 <= 0.0:
                raise KVScaleError(f"layer {layer} {key}: {value} is not a finite positive FP32 scale")
            payload[layer][key] = fp32
    return payload


def split_kv_scale_entries(batch: list[Any]) -> tuple[list[Any], KVScales]:
    """Split the entries of one `load_weights` call into weights and attention scales.

    A scale entry is `(name, tensor)` with a name matching `_STREAMED_SCALE` and a one-element
    floating tensor; it is returned in `{layer: {"k_scale", "v_scale", "q_scale"}}`, rounded to
    FP32. Every other entry is returned unchanged, in order. Raises KVScaleError naming the entry
    for a scale that is not one finite positive FP32 value or is sent twice."""
    weights: list[Any] = []
    scales: KVScales = {}
    for entry in batch:
        match = _STREAMED_SCALE.search(entry[0]) if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) else None
        if match is None:
            weights.append(entry)
            continue
        name, tensor = entry
        layer, key = int(match.group(1)), f"{match.group(2)}_scale"
        if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel() == 1):
            raise KVScaleError(f"{name}: an attention scale is one floating value, got {_describe(tensor)}")
        if key in scales.get(layer, {}):
            raise KVScaleError(f"{name}: layer {layer} {key} sent twice in one load_weights call")
        fp32 = tensor.detach().to("cpu", torch.float32).item()
        if not math.isfinite(fp32) or fp32 <= 0.0:
            raise KVScaleError(f"{name}: {tensor.item()} is not a finite positive FP32 scale")
        scales.setdefault(layer, {})[key] = fp32
    return weights, scales


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def streamed_scale_layers(model: torch.nn.Module, scales: KVScales) -> dict[int, torch.nn.Module]:
    """The attention modules `scales` (from `split_kv_scale_entries`) go to; raises KVScaleError
    naming the layers the model does not have, or where a layer's decode would not read them."""
    layers = attention_layers(model)
    unknown = sorted(set(scales) - set(layers))
    if unknown:
        raise KVScaleError(f"attention scales for layers {unknown}, the engine's attention layers are {sorted(layers)}")
    _refuse_unread(layers)
    return {index: layers[index] for index in scales}


def _refuse_unread(layers: dict[int, torch.nn.Module]) -> None:
    """KVScaleError where some layer's decode would not read scales written now (`unread_scales_reason`)."""
    reason = unread_scales_reason(layers)
    if reason:
        raise KVScaleError(f"K/V scales not written: {reason}")


def write_streamed_scales(layers: dict[int, torch.nn.Module], scales: KVScales) -> None:
    """Write `scales` into the modules of `streamed_scale_layers`, in place (keys not sent stay)."""
    for index, values in scales.items():
        _write_attention_scales(layers[index], values)


def restore_pushed_scales(attn: torch.nn.Module) -> bool:
    """Write the scales last written into `attn` back (after vLLM reset them); False when none were."""
    values = getattr(attn, PUSHED_SCALES_ATTR, None)
    if not values:
        return False
    _write_attention_scales(attn, values)
    return True


def attention_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """vLLM `Attention` modules of `model` by decoder-layer index (from their `layer_name`); may be empty."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index

    layers: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            index = extract_layer_index(module.layer_name)
            if index in layers:
                raise KVScaleError(f"two attention modules for decoder layer {index}; per-layer scales are ambiguous")
            layers[index] = module
    return layers


def read_layer_scales(model: torch.nn.Module) -> KVScales:
    """Worker side: {layer: {"k_scale", "v_scale", "q_scale"}} from the attention layers' FP32 buffers."""
    return {
        index: {f"{kind}_scale": float(getattr(attn, f"_{kind}_scale").item()) for kind in ("k", "v", "q")}
        for index, attn in attention_layers(model).items()
    }


def write_layer_scales(model: torch.nn.Module, payload: KVScales) -> None:
    """Worker side: write validated `payload` into every attention layer, in place; the layer set
    must equal the model's attention layers, and every layer's decode must read what is written
    (`unread_scales_reason`), both checked before any write."""
    layers = attention_layers(model)
    if not layers or set(layers) != set(payload):
        raise KVScaleError(
            f"scales for layers {sorted(payload)}, the engine's attention layers are {sorted(layers)}: "
            f"missing {sorted(set(layers) - set(payload))}, unknown {sorted(set(payload) - set(layers))}"
        )
    _refuse_unread(layers)
    for index, values in payload.items():
        _write_attention_scales(layers[index], values)


def _write_attention_scales(attn: torch.nn.Module, values: dict[str, float]) -> None:
    """In place: the FP32 device buffers and every host copy vLLM 0.20-0.32 backends read
    (`_k_scale_float`, ...; `_k_scale_cpu`/`_v_scale_cpu` where the release has them, 0.27+); the
    layer remembers the values (`PUSHED_SCALES_ATTR`) for `restore_pushed_scales`."""
    attn.__dict__[PUSHED_SCALES_ATTR] = {**attn.__dict__.get(PUSHED_SCALES_ATTR, {}), **values}
    for kind in ("k", "v", "q"):
        key = f"{kind}_scale"
        if key not in values:
            continue
        getattr(attn, f"_{key}").fill_(values[key])
        setattr(attn, f"_{key}_float", values[key])
        host = getattr(attn, f"_{key}_cpu", None)
        if host is not None:
            host.fill_(values[key])


def _push_kv_scales_in_worker(worker: Any, payload: KVScales) -> None:
    # imported here, as vLLM below: this module is imported without vLLM (error_bench.generate's parent)
    from fp8_align.vllm_plugin.compat import kv_scales_unread_reason

    reason = kv_scales_unread_reason()
    if reason:
        raise KVScaleError(f"K/V scales not pushed: {reason}")
    write_layer_scales(worker.get_model(), payload)


def _read_kv_scales_in_worker(worker: Any) -> KVScales:
    return read_layer_scales(worker.get_model())
