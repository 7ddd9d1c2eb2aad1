"""Decode-only attention over vLLM's FP8 KV cache with FlashInfer's XQA kernel (Hopper).

vLLM 0.22's FLASH_ATTN backend decodes an FP8 KV cache with FA3, which reads the cache at
~2.2 TB/s on an H100; TensorRT-LLM's XQA kernel (shipped in FlashInfer as
`flashinfer.xqa.xqa`, `mha_sm90.cu` for a 16-bit query over an E4M3 cache) reads the same cache
faster at large decode batches (docs/xqa_decode.md). Where the engine plan chose XQA
(`vllm_plugin.engine_plan`: `kv_decode_kernel` "auto", the default, or "xqa"), each attention
layer's implementation is marked (`route_decode_to_xqa`) and the patch `fp8_kv_decode_with_xqa`
(fp8_align.vllm_plugin.patches) sends every pure-decode batch (one query token per sequence) of a
marked `FlashAttentionImpl.forward` here; prefill and mixed batches, and unmarked engines of the
same process, stay on FA3. Both kernels read the same paged cache in place ([blocks, block_size,
kv_heads, head_dim] views of FA's `(2, blocks, block_size, kv_heads, head_dim)` tensor; XQA takes
strides).

Numerics, matched to FA3's FP8 path: vLLM's attention layer has already quantized the query to
E4M3 codes with `_q_scale` (FA3 consumes FP8 queries). XQA gets those codes widened to BF16
(exact: E4M3 values are BF16 values) and casts them back to E4M3 inside, so both kernels multiply
the same Q and K codes; every scale goes into XQA's two FP32 multipliers, read from device
tensors at run time (CUDA-graph safe, so scales pushed between steps apply):
  logits = (q_code . k_code) * q_scale * k_scale * softmax_scale    (bmm1_scale)
  out    = softmax(logits) @ v_code * v_scale                        (bmm2_scale)
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from fp8_align.versions import FEATURE_SERIES

#: XQA scratch: 8 MiB of semaphores (zeroed once) plus the multi-block partial results.
XQA_WORKSPACE_BYTES = 256 << 20
#: Compute capability XQA's FP8-KV kernel (`mha_sm90.cu`) is built for.
XQA_CAPABILITY = (9, 0)
#: vLLM series whose FlashAttentionImpl.forward(layer, query, key, value, kv_cache, attn_metadata,
#: output, output_scale, output_block_scale) and FlashAttentionMetadata (max_query_len, seq_lens,
#: block_table, use_cascade) were checked for this route: 0.22.0 (CUDA) and 0.22.1.
#: vLLM 0.25+ routes SM90 FP8-KV decode to XQA itself (its FLASHINFER backend).
XQA_SERIES = FEATURE_SERIES["kv_decode_kernel='xqa' route (CUDA, Hopper)"]
#: vLLM `kv_cache_dtype` values of an E4M3 cache, the one XQA's FP8 kernel reads.
XQA_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
#: Attribute set on an attention implementation whose decode batches go to XQA.
XQA_ROUTE_ATTR = "fp8_align_xqa"

_workspaces: dict[int, torch.Tensor] = {}
_lock = threading.Lock()
#: Pure-decode batches routed to XQA in this process (per Python call: with CUDA graphs, a
#: captured call replays without coming back here).
decode_calls = 0


class XqaDecodeError(RuntimeError):
    """XQA was requested and cannot run; the message says what is missing and how to provide it."""


def xqa_scales(
    q_scale: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """XQA's (bmm1_scale, bmm2_scale) from vLLM's per-tensor FP32 scales ([1] or [] tensors).

    bmm1 = q_scale * k_scale * softmax_scale multiplies Q_code . K_code; bmm2 = v_scale multiplies
    P @ V_code. Returns two FP32 device tensors, computed by tensor ops (no host sync).
    """
    bmm1 = (q_scale.float() * k_scale.float() * softmax_scale).reshape(1)
    bmm2 = v_scale.float().reshape(1)
    return bmm1, bmm2


def xqa_kernel_scales(bmm1: torch.Tensor, bmm2: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_scale, kv_scale) arguments of `flashinfer.xqa.xqa` for the multipliers (bmm1, bmm2).

    XQA (TensorRT-LLM's convention) scales Q.K by q_scale * kv_scale / sqrt(head_dim) and P.V by
    kv_scale, one kv_scale for K and V; so kv_scale = bmm2 and q_scale = bmm1 / bmm2 * sqrt(head_dim),
    as FlashInfer's `xqa_batch_decode_with_kv_cache` derives them.
    """
    return bmm1 / bmm2 * head_dim**0.5, bmm2


def route_decode_to_xqa(impl: Any) -> None:
    """Mark the attention implementation `impl` (a FlashAttentionImpl) so that its pure-decode
    batches go to XQA wherever the patch `fp8_kv_decode_with_xqa` is applied."""
    setattr(impl, XQA_ROUTE_ATTR, True)


def routes_to_xqa(impl: Any) -> bool:
    """True when `route_decode_to_xqa(impl)` was called."""
    return bool(getattr(impl, XQA_ROUTE_ATTR, False))


def is_pure_decode(impl: Any, attn_metadata: Any) -> bool:
    """Whether this FLASH_ATTN call is a batch XQA takes: one new token per sequence, E4M3 cache,
    decoder self-attention without cascade, sliding window, sinks, ALiBi, soft-cap or DCP."""
    return (
        attn_metadata is not None
        and attn_metadata.max_query_len == 1
        and not attn_metadata.use_cascade
        and str(impl.kv_cache_dtype) in XQA_KV_CACHE_DTYPES
        and impl.attn_type == "decoder"
        and impl.sliding_window in (None, (-1, -1))
        and impl.sinks is None
        and impl.alibi_slopes is None
        and not impl.logits_soft_cap
        and getattr(impl, "dcp_world_size", 1) == 1
    )


def xqa_module_error(head_dim: int, head_group_ratio: int, page_size: int) -> str | None:
    """None when FlashInfer's XQA module for a BF16 query and output over an E4M3 cache with these
    head dim, query heads per KV head and page size loads in this process, else why not and how to
    build it.

    Loads it the way the first decode call would (`flashinfer.xqa.get_xqa_module`, cached by
    FlashInfer, so that call reuses it; arguments as in flashinfer-python 0.6.11.post2, vLLM 0.22's
    pin): from FlashInfer's AOT directory or JIT cache, or compiled now where FlashInfer may JIT
    (nvcc present, FLASHINFER_DISABLE_JIT unset). Needs a CUDA device; imports FlashInfer.
    """
    try:
        from flashinfer.xqa import get_xqa_module

        get_xqa_module(torch.bfloat16, torch.float8_e4m3fn, page_size, head_dim, head_group_ratio, False, torch.bfloat16, 1)
    except Exception as exc:  # any failure means XQA cannot run here; the reason is reported
        return (
            f"FlashInfer's XQA module for head_dim {head_dim}, {head_group_ratio} query heads per KV head, pages of "
            f"{page_size} does not load ({type(exc).__name__}: {exc}). Where FlashInfer cannot compile it (no nvcc), "
            f"prebuild it with benchmarks/box/build_flashinfer_aot.sh {head_dim}:{head_group_ratio}:{page_size} and "
            "install it as docs/xqa_decode.md describes"
        )
    return None


def _workspace(device: torch.device) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _workspaces:
            if torch.cuda.is_current_stream_capturing():
                raise XqaDecodeError("XQA workspace first needed inside CUDA-graph capture; run an eager decode step first")
            _workspaces[index] = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return _workspaces[index]


def xqa_decode(
    impl: Any, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor
) -> torch.Tensor:
    """One decode step of attention for every sequence of `attn_metadata` with XQA.

    Args:
        impl: vLLM's FlashAttentionImpl (num_kv_heads, scale).
        layer: the Attention layer (`_q_scale`, `_k_scale`, `_v_scale` FP32 device tensors).
        query: [num_tokens, num_heads, head_dim] E4M3 codes (vLLM quantized them) or BF16.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] FP8 (uint8 or e4m3 storage).
        attn_metadata: FlashAttentionMetadata of a pure-decode batch (`is_pure_decode`).
        output: [num_tokens, num_heads, head_dim] BF16; rows of the batch's sequences are written.
    Returns:
        `output`.
    """
    global decode_calls
    from flashinfer.xqa import xqa

    workspace = _workspace(query.device)
    batch = attn_metadata.seq_lens.shape[0]
    key_cache, value_cache = (c.view(torch.float8_e4m3fn) for c in kv_cache.unbind(0))
    q = query[:batch]
    if q.dtype == torch.float8_e4m3fn:
        q = q.to(torch.bfloat16)  # exact: XQA re-casts to the same E4M3 codes
        q_scale = layer._q_scale
    else:
        q_scale = torch.ones_like(layer._k_scale)  # an unquantized query carries its own magnitude
    head_dim = q.shape[-1]
    q_arg, kv_arg = xqa_kernel_scales(*xqa_scales(q_scale, layer._k_scale, layer._v_scale, impl.scale), head_dim)
    try:
        xqa(
            q.unsqueeze(1), key_cache, value_cache, attn_metadata.block_table, attn_metadata.seq_lens.unsqueeze(1),
            output[:batch].unsqueeze(1), workspace[8 << 20 :], workspace[: 8 << 20], impl.num_kv_heads,
            key_cache.shape[1], q_scale=q_arg, kv_scale=kv_arg, kv_layout="NHD",
        )  # fmt: skip
    except Exception as exc:  # turned into one actionable message; the cause stays chained
        raise XqaDecodeError(
            f"FlashInfer's XQA decode failed for head_dim {head_dim}, {q.shape[1] // impl.num_kv_heads} query heads per KV "
            f"head, pages of {key_cache.shape[1]}: {type(exc).__name__}: {exc}. Where FlashInfer cannot compile (no nvcc), "
            "prebuild the module with benchmarks/box/build_flashinfer_aot.sh HEAD_DIM:GROUP:PAGE and install it as "
            "docs/xqa_decode.md describes (FLASHINFER_DISABLE_JIT=1 names a missing module)."
        ) from exc
    decode_calls += 1
    return output
