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
to 1.0; `fp8_align.vllm_plugin.refit.refit_weights` puts the pushed values back after it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

#: Scale names a layer may carry; the first two are required.
REQUIRED_KEYS = ("k_scale", "v_scale")
OPTIONAL_KEYS = ("q_scale",)

KVScales = dict[int, dict[str, float]]


class KVScaleError(ValueError):
    """KV scales were refused; nothing in the engine was changed."""


def push_kv_scales(llm: Any, scales: Mapping[int, Mapping[str, float]]) -> None:
    """Write `scales` ({layer index: {"k_scale", "v_scale"[, "q_scale"]}}, FP32 amax/448) into every
    attention layer of every worker of `llm` (a `vllm.LLM`; needs VLLM_ALLOW_INSECURE_SERIALIZATION=1).

    Raises KVScaleError for a bad value or key here, and (re-raised by vLLM) when the layer set
    differs from the engine's attention layers. Clears the prefix cache: its FP8 KV entries were
    stored with the old scales.
    """
    payload = validate_kv_scales(scales)
    llm.collective_rpc(_push_kv_scales_in_worker, args=(payload,))
    llm.reset_prefix_cache()


def read_kv_scales(llm: Any) -> list[KVScales]:
    """Per worker: {layer index: {"k_scale", "v_scale", "q_scale"}} as the attention layers hold them
    (the FP32 buffers; `push_kv_scales` keeps the host copies equal)."""
    return llm.collective_rpc(_read_kv_scales_in_worker)


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
    must equal the model's attention layers (checked before any write)."""
    layers = attention_layers(model)
    if not layers or set(layers) != set(payload):
        raise KVScaleError(
            f"scales for layers {sorted(payload)}, the engine's attention layers are {sorted(layers)}: "
            f"missing {sorted(set(layers) - set(payload))}, unknown {sorted(set(payload) - set(layers))}"
        )
    for index, values in payload.items():
        _write_attention_scales(layers[index], values)


def _write_attention_scales(attn: torch.nn.Module, values: dict[str, float]) -> None:
    """In place: the FP32 device buffers and every host copy vLLM 0.32 backends read."""
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
