"""Decode-only attention over vLLM's FP8 KV cache with FlashInfer's XQA kernel (Hopper).

vLLM 0.22's FLASH_ATTN backend decodes an FP8 KV cache with FA3, which reads the cache at
~2.2 TB/s on an H100; TensorRT-LLM's XQA kernel (shipped in FlashInfer as
`flashinfer.xqa.xqa`, `mha_sm90.cu` for a 16-bit query over an E4M3 cache) reads the same cache
faster at large decode batches (docs/xqa_decode.md). `FP8Config(kv_decode_kernel="xqa")` makes
the patch `fp8_kv_decode_with_xqa` (fp8_align.vllm_plugin.patches) send every pure-decode batch
(one query token per sequence) of `FlashAttentionImpl.forward` here; prefill and mixed batches
stay on FA3. Both kernels read the same paged cache in place ([blocks, block_size, kv_heads,
head_dim] views of FA's `(2, blocks, block_size, kv_heads, head_dim)` tensor; XQA takes strides).

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

#: XQA scratch: 8 MiB of semaphores (zeroed once) plus the multi-block partial results.
XQA_WORKSPACE_BYTES = 256 << 20
#: Compute capability XQA's FP8-KV kernel (`mha_sm90.cu`) is built for.
XQA_CAPABILITY = (9, 0)

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


def is_pure_decode(impl: Any, attn_metadata: Any) -> bool:
    """Whether this FLASH_ATTN call is a batch XQA takes: one new token per sequence, FP8 cache,
    decoder self-attention without cascade, sliding window, sinks, ALiBi, soft-cap or DCP."""
    return (
        attn_metadata is not None
        and attn_metadata.max_query_len == 1
        and not attn_metadata.use_cascade
        and str(impl.kv_cache_dtype).startswith("fp8")
        and impl.attn_type == "decoder"
        and impl.sliding_window in (None, (-1, -1))
        and impl.sinks is None
        and impl.alibi_slopes is None
        and not impl.logits_soft_cap
        and getattr(impl, "dcp_world_size", 1) == 1
    )


def check_xqa_device(device: torch.device) -> None:
    """Raise XqaDecodeError unless `device` is a CUDA device of compute capability 9.0 with FlashInfer."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != XQA_CAPABILITY:
        raise XqaDecodeError(
            f"kv_decode_kernel='xqa' needs an SM90 (Hopper) GPU; this engine runs on {device}"
            + (f" (capability {torch.cuda.get_device_capability(device)})" if device.type == "cuda" else "")
        )
    try:
        import flashinfer.xqa  # noqa: F401
    except ImportError as exc:
        raise XqaDecodeError(f"kv_decode_kernel='xqa' needs flashinfer-python (vLLM's pinned version): {exc}") from exc


def check_xqa_backend(model: torch.nn.Module) -> int:
    """Number of attention layers of `model` whose decode XQA takes over; raises XqaDecodeError when
    a layer runs another backend than FLASH_ATTN (the patch would silently not apply to it)."""
    impls = [m.impl for m in model.modules() if hasattr(m, "impl") and hasattr(m, "kv_cache_dtype")]
    others = sorted({type(impl).__name__ for impl in impls if type(impl).__name__ != "FlashAttentionImpl"})
    if others or not impls:
        raise XqaDecodeError(
            f"kv_decode_kernel='xqa' replaces the decode of vLLM's FLASH_ATTN backend, but this engine's attention "
            f"runs {others or 'no attention layers'}; start it with attention_backend='FLASH_ATTN' (the default on Hopper)"
        )
    return len(impls)


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
