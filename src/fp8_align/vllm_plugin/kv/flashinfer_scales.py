"""Per-step K/V scales for vLLM's FLASHINFER attention over an FP8 KV cache on Hopper (vLLM 0.25).

vLLM 0.25.1's `FlashInferImpl` (vllm/v1/attention/backends/flashinfer.py) decodes an FP8 cache on
SM90 with FlashInfer's XQA kernel (`trtllm_batch_decode_with_kv_cache(backend="xqa")`) and hands
it the K and V scales as Python floats: `bmm2_scale`, set from `layer._v_scale_float` at the
implementation's first forward and kept (`if self.bmm2_scale is None`), and
`get_xqa_bmm1_scale(layer, q_dtype)`, `impl.scale * layer._k_scale_float` at each call. A CUDA
graph captures both as launch arguments. New tokens are written into the cache with the device
buffers `layer._k_scale` / `layer._v_scale`. So scales pushed after the engine started (every RL
step) reach the cache writes but not the captured decode, which would then read the cache with the
old scales: wrong attention, silently.

`read_scales_live(attn)` makes one attention layer's implementation hand XQA device tensors
instead: `bmm2_scale` is the layer's `_v_scale` buffer itself (every push and vLLM's reset fill it
in place) and `get_xqa_bmm1_scale` returns `impl.scale * layer._k_scale` (times `_q_scale` for an
FP8 query), computed on the device inside the graph. FlashInfer's XQA takes tensors for both
(flashinfer-python 0.6.13, vLLM 0.25.1's pin: `xqa(q_scale=..., kv_scale=...)` reads a tensor on
the device). Only instance attributes change, before the first forward (the engine plan calls it
once the model is loaded): the class and other engines are untouched, and `stop_reading_live`
(`patches.undo_patches`) restores the instance. `unread_scales_reason(layers)` says why pushed
scales would not reach some layer's decode (an FP8-cache FLASHINFER layer not made live, e.g. one
vLLM decodes with FlashInfer's native kernel, whose float scales are captured alike), so that a
push is refused instead.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fp8_align.versions import FEATURE_SERIES

#: vLLM series whose FlashInferImpl was read for this: bmm2_scale cached at the first forward,
#: get_xqa_bmm1_scale(layer, q_data_type) from host floats, both passed to
#: trtllm_batch_decode_with_kv_cache (0.25.1).
LIVE_SCALES_SERIES = FEATURE_SERIES["live K/V scales on attention_backend='FLASHINFER' (CUDA, Hopper)"]
#: The vLLM attention implementation class that keeps K/V scales as launch arguments.
FLASHINFER_IMPL = "FlashInferImpl"
_LIVE_ATTR = "fp8_align_live_kv_scales"
_live: weakref.WeakSet[Any] = weakref.WeakSet()


def _fp8_flashinfer(attn: torch.nn.Module) -> bool:
    """An attention layer whose implementation is vLLM's FlashInferImpl over an FP8 cache."""
    impl = getattr(attn, "impl", None)
    return type(impl).__name__ == FLASHINFER_IMPL and str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8")


def live_xqa_bmm1_scale(impl: Any, layer: torch.nn.Module, q_data_type: torch.dtype) -> torch.Tensor:
    """XQA's bmm1 scale as a device tensor (0-dim FP32, like the layer's buffers): softmax scale x
    K scale (x Q scale for an FP8 query), read from the layer's buffers when the kernel runs."""
    scale = impl.scale * layer._k_scale
    if q_data_type in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = scale * layer._q_scale
    return scale


def read_scales_live(attn: torch.nn.Module) -> bool:
    """Make `attn`'s FlashInferImpl read its K/V scales from the layer's device buffers (see the
    module doc); False, changing nothing, for another implementation or a BF16 cache. Idempotent."""
    if not _fp8_flashinfer(attn):
        return False
    impl = attn.impl
    if not getattr(impl, _LIVE_ATTR, False):
        impl.bmm2_scale = attn._v_scale
        impl.get_xqa_bmm1_scale = lambda layer, q_data_type: live_xqa_bmm1_scale(impl, layer, q_data_type)
        setattr(impl, _LIVE_ATTR, True)
        _live.add(impl)
    return True


def reads_scales_live(attn: torch.nn.Module) -> bool:
    """True when `read_scales_live(attn)` is in effect."""
    return bool(getattr(getattr(attn, "impl", None), _LIVE_ATTR, False))


def _restore(impl: Any) -> None:
    impl.__dict__.pop("get_xqa_bmm1_scale", None)
    impl.bmm2_scale = None  # vLLM's forward computes it again from the host floats
    impl.__dict__.pop(_LIVE_ATTR, None)


def stop_reading_live() -> None:
    """Undo `read_scales_live` on every implementation it changed in this process."""
    for impl in list(_live):
        _restore(impl)
    _live.clear()


def unread_scales_reason(layers: dict[int, torch.nn.Module]) -> str | None:
    """Why K/V scales written into `layers` ({decoder-layer index: vLLM Attention}) would not reach
    the decode of some layer (an FP8-cache FLASHINFER layer whose scales are not live), or None."""
    stale = [index for index, attn in sorted(layers.items()) if _fp8_flashinfer(attn) and not reads_scales_live(attn)]
    if not stale:
        return None
    return (
        f"vLLM's FLASHINFER attention of layers {stale} keeps the K/V scales it read at its first forward (FlashInferImpl."
        "bmm2_scale, and CUDA graphs capture the decode's float scales), so pushed scales would reach the cache writes but "
        "not the decode. fp8_align makes them live on vLLM 0.25 with an FP8 cache on Hopper where vLLM decodes with XQA "
        "(FlashInfer's native decode is taken where NVIDIA's cubin artifactory is unreachable: set "
        "VLLM_HAS_FLASHINFER_CUBIN=1 on a machine with nvcc); elsewhere use attention_backend='FLASH_ATTN' for per-step "
        "K/V scales"
    )
