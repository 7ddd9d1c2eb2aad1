"""Attention of packed sequences for the bitwise trainer (`BitwiseForward`, `make_bitwise`): where
each token sits (`PackedBatch`), the pure-torch reference, and the engine's attention kernel over a paged copy of K/V written as a
bitwise engine writes its KV cache: BF16 (vLLM's TRITON_ATTN kernel), or E4M3 with the engine's
per-layer scales (`KVCacheScales`, `FP8Config(kv_cache_dtype="fp8")`: fp8_align's
`fp8_cache_attention`, which the engine runs through `vllm_plugin.on_policy.attend_over_fp8_cache`).

With an FP8 cache the engine's attention reads every key and value from E4M3 codes, prefill and
decode alike (the cache is written before attention runs), with the BF16 query. The trainer writes
its copy with the engine's own cache-write kernel and scales and runs the same kernel on it, so
each token's attention output is the engine's bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fp8_align.bitwise.reference import fp8_kv_cache_reference
from fp8_align.vllm_plugin.kv.scales import KVScaleError, validate_kv_scales

try:
    from fp8_align.bitwise.fp8_cache_attention import TRAINER_TILINGS, fp8_cache_attention
except ImportError:  # CPU builds of torch come without Triton; the CPU path runs attention_reference
    fp8_cache_attention = TRAINER_TILINGS = None

if TYPE_CHECKING:  # vLLM is imported only where its kernels run (CUDA)
    from fp8_align.vllm_plugin.compat import BatchInvariantKernels

#: KV-cache block size of the trainer's paged K/V copy (vLLM's default for TRITON_ATTN on CUDA;
#: both kernels reduce over fixed tiles of the sequence whatever the block size).
ATTENTION_BLOCK_SIZE = 16
#: `kv_cache_dtype` of an E4M3 cache, as vLLM's cache-write kernel takes it.
FP8_KV_CACHE_DTYPE = "fp8"


@dataclass(frozen=True)
class KVCacheScales:
    """One decoder layer's FP8 KV-cache scales: FP32 [1] dequantization multipliers on the
    trainer's device (vLLM's `_k_scale` / `_v_scale`: codes are `E4M3(x / scale)`)."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; to CUDA through pinned memory without waiting for queued device
    work (a pageable copy would stall the host until the stream drains)."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def kv_scales_on_device(
    kv_cache_dtype: str, scales: Mapping[int, Mapping[str, float]], num_layers: int, device: torch.device, owner: str
) -> dict[int, KVCacheScales]:
    """Per decoder layer, the engine's FP8 KV-cache scales `scales` ({layer: {"k_scale", "v_scale"[,
    "q_scale"]}}, FP32 amax / 448, as `engine_kv_scales(llm)` returns them) on `device`. Every layer
    of `num_layers` needs both scales; `q_scale` is accepted and not used (a bitwise engine attends
    with BF16 queries). Raises ValueError when `kv_cache_dtype` (of `owner`'s FP8Config) is not
    "fp8", KVScaleError naming the layer or value otherwise."""
    if kv_cache_dtype != "fp8":
        raise ValueError(
            f"K/V scales apply to an FP8 KV cache; this {owner}'s FP8Config has kv_cache_dtype={kv_cache_dtype!r} "
            "(the engine's cache is BF16, its K/V are not quantized)"
        )
    payload = validate_kv_scales(scales)
    layers = set(range(num_layers))
    if set(payload) != layers:
        raise KVScaleError(
            f"K/V scales for layers {sorted(payload)}; the model's decoder layers are 0..{num_layers - 1}: "
            f"missing {sorted(layers - set(payload))}, unknown {sorted(set(payload) - layers)}"
        )
    order = sorted(payload)
    values = host_to_device(torch.tensor([[payload[i]["k_scale"], payload[i]["v_scale"]] for i in order], dtype=torch.float32), device)
    return {i: KVCacheScales(values[row, 0:1], values[row, 1:2]) for row, i in enumerate(order)}


@dataclass(frozen=True)
class PackedBatch:
    """Where each token of packed sequences sits, as device index tensors made once per forward
    (every attention call and its backward reuse them: no host-to-device copy per layer).

    `row`/`position` [T] int64: each token's sequence and place in it (the padded batch of
    `attention_reference`); `slot` [T] int64, `block_table` [B, max blocks] int32, `cu_seqlens`
    [B + 1] int32, `lengths` [B] int32: the paged K/V layout of `paged_triton_attention`
    (`ATTENTION_BLOCK_SIZE`-token blocks, each sequence's blocks in order)."""

    seq_lens: tuple[int, ...]
    row: torch.Tensor
    position: torch.Tensor
    slot: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return sum(-(-length // ATTENTION_BLOCK_SIZE) for length in self.seq_lens)

    @classmethod
    def from_lengths(cls, seq_lens: Sequence[int], device: torch.device | str) -> PackedBatch:
        """The layout of sequences of `seq_lens` tokens (each >= 1) packed in that order, on `device`."""
        lengths = [int(n) for n in seq_lens]
        blocks = [-(-n // ATTENTION_BLOCK_SIZE) for n in lengths]
        block_table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
        rows, positions, slots, first = [], [], [], 0
        for i, (length, count) in enumerate(zip(lengths, blocks)):
            block_table[i, :count] = torch.arange(first, first + count, dtype=torch.int32)
            rows.append(torch.full((length,), i))
            positions.append(torch.arange(length))
            slots.append(torch.arange(length) + first * ATTENTION_BLOCK_SIZE)
            first += count
        length_tensor = torch.tensor(lengths, dtype=torch.int32)
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), length_tensor.cumsum(0, dtype=torch.int32)])
        return cls(
            tuple(lengths), host_to_device(torch.cat(rows), device), host_to_device(torch.cat(positions), device),
            host_to_device(torch.cat(slots), device), host_to_device(block_table, device), host_to_device(cu_seqlens, device),
            host_to_device(length_tensor, device),
        )  # fmt: skip


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PackedBatch,
    head_size: int,
    compute_dtype: torch.dtype = torch.float32,
    kv_scales: KVCacheScales | None = None,
) -> torch.Tensor:
    """Causal attention of packed sequences: q [T, Hq * D], k/v [T, Hk * D] (grouped heads) ->
    [T, Hq * D] in q's dtype, computed in `compute_dtype` (FP32: the reference; q's dtype: the
    standard attention whose gradient the trainer's backward is) with scale D ** -0.5. With
    `kv_scales`, K and V are first read back from an E4M3 cache (`fp8_kv_cache_reference`). The
    sequences are padded at their ends into one [B, H, L, D] batch for torch's scaled-dot-product
    attention (one fused kernel, forward and backward: flash on CUDA in BF16); a query never sees
    a padded key, every key it may see comes before it."""
    if kv_scales is not None:
        k, v = fp8_kv_cache_reference(k, kv_scales.k_scale), fp8_kv_cache_reference(v, kv_scales.v_scale)
    heads, kv_heads = q.shape[-1] // head_size, k.shape[-1] // head_size
    count, longest = len(batch.seq_lens), max(batch.seq_lens)

    def padded(x: torch.Tensor, num_heads: int) -> torch.Tensor:
        grid = x.new_zeros(count, longest, num_heads, head_size).index_put((batch.row, batch.position), x.reshape(-1, num_heads, head_size))
        return grid.transpose(1, 2).to(compute_dtype)  # [B, H, L, D]

    qs = padded(q, heads)
    ks = padded(k, kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    vs = padded(v, kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=head_size**-0.5)
    return out.transpose(1, 2)[batch.row, batch.position].reshape(q.shape[0], heads * head_size).to(q.dtype)


#: The dtypes flash attention's kernels take.
FLASH_DTYPES = (torch.bfloat16, torch.float16)
#: A closed-form attention backward: ((q, k, v), forward output (unused), (grad,)) -> (dq, dk, dv).
AttentionVjp = Callable[[tuple[torch.Tensor, ...], torch.Tensor | None, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]


def flash_attention_vjp(batch: PackedBatch, head_size: int) -> AttentionVjp:
    """The gradient of `attention_reference` in q's dtype (BF16 or FP16, CUDA) through flash attention's
    variable-length kernels over the packed tokens as they are: q [T, Hq * D], k/v [T, Hk * D]
    (grouped heads, no padding, no repeated K/V; last dimension contiguous), causal, scale
    D ** -0.5. Flash's forward runs again for the log-sum-exp its backward takes; dk/dv are summed
    over each KV head's query heads."""
    longest = max(batch.seq_lens)
    scale = head_size**-0.5

    def vjp(inputs: tuple[torch.Tensor, ...], output: torch.Tensor | None, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        q, k, v = (x.reshape(x.shape[0], -1, head_size) for x in inputs)
        lens = batch.cu_seqlens
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, lens, lens, longest, longest, 0.0, True, False, scale=scale)
        grad = grads[0].reshape(q.shape).contiguous()
        found = torch.ops.aten._flash_attention_backward(grad, q, k, v, out, lse, lens, lens, longest, longest, 0.0, True, rng_state, unused, scale=scale)
        return tuple(g.reshape(g.shape[0], -1) for g in found)

    return vjp


def paged_triton_attention(
    kernels: BatchInvariantKernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PackedBatch,
    head_size: int,
    kv_scales: KVCacheScales | None = None,
    tiling: str = "tile64",
) -> torch.Tensor:
    """`attention_reference`'s contract computed by the kernel a bitwise engine runs: K/V written
    by vLLM's cache-write kernel into a paged cache of `ATTENTION_BLOCK_SIZE`-token blocks
    (`batch`'s layout), BF16 and attended by TRITON_ATTN's `unified_attention`, or with `kv_scales`
    E4M3 codes attended by `fp8_cache_attention` (BF16 query, `TRAINER_TILINGS[tiling]` for the
    engine's `FP8Config.bitwise_attention_tiling`: the engine's rows' bits); every query of a
    sequence attends to its prefix, softmax scale D ** -0.5."""
    tokens, device = q.shape[0], q.device
    heads, kv_heads = q.shape[-1] // head_size, k.shape[-1] // head_size
    blocks, seqs = batch.num_blocks, len(batch.seq_lens)
    cache_dtype = k.dtype if kv_scales is None else torch.float8_e4m3fn
    key_cache = torch.zeros(blocks, ATTENTION_BLOCK_SIZE, kv_heads, head_size, dtype=cache_dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    if kv_scales is None:
        k_scale = v_scale = torch.ones(1, dtype=torch.float32, device=device)
    else:
        k_scale, v_scale = kv_scales.k_scale, kv_scales.v_scale
    kernels.write_kv_cache(
        k.reshape(tokens, kv_heads, head_size), v.reshape(tokens, kv_heads, head_size), key_cache, value_cache, batch.slot,
        "auto" if kv_scales is None else FP8_KV_CACHE_DTYPE, k_scale, v_scale,
    )  # fmt: skip
    query = q.reshape(tokens, heads, head_size).contiguous()
    out = torch.empty(tokens, heads, head_size, dtype=q.dtype, device=device)
    if kv_scales is not None:
        if fp8_cache_attention is None:
            raise RuntimeError("the FP8-cache attention kernel needs Triton on CUDA; install the triton that matches torch")
        fp8_cache_attention(
            query, key_cache, value_cache, batch.block_table, batch.cu_seqlens, batch.lengths, head_size**-0.5, k_scale, v_scale, out,
            TRAINER_TILINGS[tiling],
        )  # fmt: skip
        return out.reshape(tokens, heads * head_size)
    kernels.unified_attention(
        q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=batch.cu_seqlens, max_seqlen_q=max(batch.seq_lens),
        seqused_k=batch.lengths, max_seqlen_k=max(batch.seq_lens), softmax_scale=head_size**-0.5, causal=True,
        window_size=(-1, -1), block_table=batch.block_table, softcap=0, q_descale=None, k_descale=k_scale.expand(seqs, kv_heads),
        v_descale=v_scale.expand(seqs, kv_heads),
    )  # fmt: skip
    return out.reshape(tokens, heads * head_size)
