"""Which batch-invariant kernels the bitwise mode can afford (GPU): block-FP8 GEMM tile
configurations and TRITON_ATTN launch settings, each checked for bit-invariance and timed.

    python benchmarks/bitwise_kernels.py --out bitwise_kernels.json [--parts gemm,attention] [--tiles all|current]
        [--kv-caches bf16,fp8] [--attention-settings all|current] [--fp8-tilings all|current]

GEMM: fp8_align's fixed-tile block-FP8 Triton GEMM (`bitwise.triton_kernels`) on the Qwen3-8B
projection shapes with random E4M3 codes and FP32 scales. Per tile configuration: whether its rows
are the same bits at M = 1, 7, 64, 256, 512 and 4096 as at M = 8192 (`m_invariant`), whether they
equal the current `GEMM_TILE`'s bits (`equals_current`), and its time at the decode and training
sizes next to vLLM's CUTLASS block-FP8 GEMM (the fast mode; its M-invariance and bits against the
Triton GEMM checked the same way), DeepGEMM's `fp8_gemm_nt` (the fast mode's GEMM; whole
128-blocks only, so the Qwen3-8B shapes: its M-invariance and bits against the Triton GEMM, FP32
scales) and a BF16 cuBLAS matmul.
Attention: vLLM's TRITON_ATTN 2D kernel as the bitwise engine runs it (decode at batch 256 over a
paged cache, BF16 or E4M3 with per-tensor scales and a BF16 query), per (tile size, warps, stages):
whether a decode row equals the same token's row of a full-sequence (prefill) launch, its time and
the cache bytes it reads per second, next to FlashAttention-3 (`num_splits=1`) on the BF16 cache.
FP8 attention: fp8_align's FP8-cache kernel (`bitwise.fp8_cache_attention`, what the bitwise
engine runs over an E4M3 cache) per `AttentionTiling`, the same checks and figures at batch 512, and
the time of a 16-sequence prefill over the same cache.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

from fp8_align.bitwise.fp8_cache_attention import ATTENTION_TILING, AttentionTiling, fp8_cache_attention
from fp8_align.bitwise.triton_kernels import GEMM_TILE, block_fp8_gemm_fixed_tile

#: (name, N, K) of the Qwen3-8B projections (fused qkv and gate_up, as the engine holds them).
GEMM_SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288), ("down_llama3", 4096, 14336))
M_CHECK = (1, 7, 64, 256, 512, 4096)
M_MAX = 8192
M_TIME = (256, 512, 4096)
TILES = [
    dict(GEMM_TILE),
    {**GEMM_TILE, "GROUP_M": 8},
    {**GEMM_TILE, "num_stages": 4},
    {**GEMM_TILE, "BLOCK_N": 64, "num_stages": 4},
    {**GEMM_TILE, "BLOCK_M": 128, "num_warps": 8, "GROUP_M": 8},
    {**GEMM_TILE, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "GROUP_M": 8},
    {**GEMM_TILE, "BLOCK_M": 64, "BLOCK_N": 256, "num_warps": 8, "GROUP_M": 8},
    {**GEMM_TILE, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4, "GROUP_M": 8},
    {**GEMM_TILE, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 5, "GROUP_M": 8},
    {**GEMM_TILE, "BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "GROUP_M": 8},
]


def _codes(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=generator, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)


def gemm_part(tiles: list[dict[str, int]]) -> list[dict[str, Any]]:
    """One row per (shape, tile configuration of `tiles`, the first being the current one) and one
    per (shape, reference kernel)."""
    from fp8_align.vllm_plugin.compat import cutlass_block_fp8_mm
    from fp8_align.vllm_plugin.kernels import fixed_tile  # noqa: F401  (registers vLLM's padded CUTLASS op)

    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in GEMM_SHAPES:
        x = _codes(M_MAX, k, gen)
        xs = torch.rand(M_MAX, k // 128, generator=gen, device="cuda") * 1e-2 + 1e-4
        w = _codes(n, k, gen)
        ws = torch.rand(n // 128, k // 128, generator=gen, device="cuda") * 1e-2 + 1e-4
        current = None
        for tile in tiles:
            run = functools.partial(block_fp8_gemm_fixed_tile, tile=tile)
            full = run(x, xs, w, ws, torch.empty(M_MAX, n, dtype=torch.bfloat16, device="cuda"))
            current = full if current is None else current
            invariant = all(torch.equal(run(x[:m], xs[:m], w, ws, torch.empty(m, n, dtype=torch.bfloat16, device="cuda")), full[:m]) for m in M_CHECK)
            times = {}
            for m in M_TIME:
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                times[str(m)] = round(do_bench(lambda: run(x[:m], xs[:m], w, ws, out), warmup=10, rep=50) * 1e3, 2)
            row = {"shape": name, "n": n, "k": k, "tile": tile, "m_invariant": invariant, "equals_current": torch.equal(full, current), "us": times}
            rows.append(row)
            print(json.dumps(row), flush=True)
        xs_cm = xs.t().contiguous().t()
        cutlass_full = cutlass_block_fp8_mm(x, w, xs_cm, ws, torch.bfloat16)
        cutlass_invariant = all(torch.equal(cutlass_block_fp8_mm(x[:m], w, xs_cm[:m].t().contiguous().t(), ws, torch.bfloat16), cutlass_full[:m]) for m in M_CHECK)
        rows.append({"shape": name, "n": n, "k": k, "kernel": "cutlass_block_fp8", "m_invariant": cutlass_invariant,
                     "equals_current": torch.equal(cutlass_full, current), "k_le_3n": k <= 3 * n})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        deepgemm = functools.partial(_deepgemm, x, xs, w, ws)
        deepgemm_full = deepgemm(M_MAX)
        rows.append({"shape": name, "n": n, "k": k, "kernel": "deepgemm_fp8_gemm_nt",
                     "m_invariant": all(torch.equal(deepgemm(m), deepgemm_full[:m]) for m in M_CHECK),
                     "m_invariant_m_1_to_512_step_17": all(torch.equal(deepgemm(m), deepgemm_full[:m]) for m in range(1, 513, 17)),
                     "equals_current": torch.equal(deepgemm_full, current),
                     "us": {str(m): round(do_bench(functools.partial(deepgemm, m), warmup=10, rep=50) * 1e3, 2) for m in M_TIME}})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        wb = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        xb = torch.randn(M_MAX, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        for ref, fn in (
            ("cutlass_block_fp8", lambda m: cutlass_block_fp8_mm(x[:m], w, xs_cm[:m], ws, torch.bfloat16)),
            ("cublas_bf16", lambda m: xb[:m] @ wb.t()),
        ):
            times = {str(m): round(do_bench(functools.partial(fn, m), warmup=10, rep=50) * 1e3, 2) for m in M_TIME}
            rows.append({"shape": name, "n": n, "k": k, "kernel": ref, "us": times})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _deepgemm(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, m: int) -> torch.Tensor:
    """DeepGEMM's block-FP8 product of the first m rows, as fp8_align's DeepGEMM backend calls it:
    activation scales in the TMA-aligned column-major layout, FP32 scales (no UE8M0 cast)."""
    import vllm.model_executor.kernels.linear.scaled_mm.deep_gemm  # noqa: F401  (registers torch.ops.vllm.fp8_gemm_nt_op)

    from fp8_align.quant.triton_groupwise import ScaleLayout, empty_scales

    scale = empty_scales(m, xs.shape[1], ScaleLayout.COLUMN_MAJOR_TMA, x.device)
    scale.copy_(xs[:m])
    out = torch.empty(m, w.shape[0], dtype=torch.bfloat16, device=x.device)
    torch.ops.vllm.fp8_gemm_nt_op(x[:m], scale, w, ws, out, False)
    return out


class _Launch:
    """`kernel[grid](**kwargs)` with num_warps / num_stages added (the vLLM wrapper passes none)."""

    def __init__(self, kernel: Any, **options: int) -> None:
        self.kernel, self.options = kernel, options

    def __getitem__(self, grid: Any) -> Any:
        return lambda **kwargs: self.kernel[grid](**kwargs, **self.options)


#: TRITON_ATTN launch settings (tile, warps, stages); the first is what vLLM 0.22 runs in batch-invariant mode.
ATTENTION_SETTINGS = [(32, 4, 3), (32, 4, 2), (32, 8, 3), (32, 4, 4), (64, 4, 3), (64, 4, 2), (64, 8, 3), (64, 4, 4),
                      (128, 4, 3), (128, 4, 2), (128, 8, 3), (128, 4, 4)]  # fmt: skip


def attention_part(
    batch: int = 256, contexts: tuple[int, ...] = (512, 1536), kv_caches: tuple[str, ...] = ("bf16", "fp8"),
    settings: list[tuple[int, int, int]] = ATTENTION_SETTINGS,
) -> list[dict[str, Any]]:
    """Decode over a paged cache (Qwen3-8B heads, 16-token blocks) per KV-cache dtype and TRITON_ATTN setting."""
    from vllm.v1.attention.ops import triton_unified_attention as tua
    from vllm.v1.kv_cache_interface import KVQuantMode
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    heads, kv_heads, dim, block = 32, 8, 128, 16
    original_kernel, original_tile = tua.kernel_unified_attention, tua._get_tile_size
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for kv_cache, context in [(c, n) for c in kv_caches for n in contexts]:
        blocks = -(-context // block)
        cache_dtype = torch.bfloat16 if kv_cache == "bf16" else torch.float8_e4m3fn
        cache_k = (torch.randn(batch * blocks, block, kv_heads, dim, generator=gen, device="cuda") * 16).to(cache_dtype)
        cache_v = (torch.randn(batch * blocks, block, kv_heads, dim, generator=gen, device="cuda") * 16).to(cache_dtype)
        scale = 1.0 if kv_cache == "bf16" else 1 / 16
        quant = {} if kv_cache == "bf16" else {"kv_quant_mode": KVQuantMode.FP8_PER_TENSOR}
        table = torch.randperm(batch * blocks, generator=gen, device="cuda").to(torch.int32).view(batch, blocks)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        unit = torch.full((batch, kv_heads), scale, device="cuda")
        # prefill of sequence 0: every position's query, the last one equal to the decode query
        q_pre = torch.randn(context, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
        q_pre[-1] = q[0]
        cu_pre = torch.tensor([0, context], dtype=torch.int32, device="cuda")

        def call(query: torch.Tensor, cu: torch.Tensor, max_q: int, seqs: int) -> torch.Tensor:
            out = torch.empty_like(query)
            tua.unified_attention(q=query, k=cache_k, v=cache_v, out=out, cu_seqlens_q=cu, max_seqlen_q=max_q, seqused_k=lens[:seqs],
                                  max_seqlen_k=context, softmax_scale=dim**-0.5, causal=True, window_size=(-1, -1),
                                  block_table=table[:seqs], softcap=0, q_descale=None, k_descale=unit[:seqs], v_descale=unit[:seqs],
                                  **quant)  # fmt: skip
            return out

        bytes_read = 2 * batch * context * kv_heads * dim * cache_k.element_size()
        for tile, warps, stages in settings:
            setting = {"kv_cache": kv_cache, "context": context, "tile": tile, "num_warps": warps, "num_stages": stages}
            tua._get_tile_size = lambda *a, _t=tile, **kw: _t
            tua.kernel_unified_attention = _Launch(original_kernel, num_warps=warps, num_stages=stages)
            try:
                decode = call(q, cu_q, 1, batch)
                prefill = call(q_pre, cu_pre, context, 1)
                same = torch.equal(decode[0], prefill[-1])
                us = round(do_bench(lambda: call(q, cu_q, 1, batch), warmup=10, rep=50) * 1e3, 1)
                row = {**setting, "decode_equals_prefill": same, "decode_us": us, "kv_read_gb_per_s": round(bytes_read / us / 1e3)}
            except Exception as error:  # noqa: BLE001  (a setting that does not compile is a result)
                row = {**setting, "error": repr(error)[:300]}
            finally:
                tua._get_tile_size, tua.kernel_unified_attention = original_tile, original_kernel
            rows.append(row)
            print(json.dumps(row), flush=True)
        rows.append({"kv_cache": kv_cache, "context": context, "kv_bytes_per_call": bytes_read})
        if kv_cache != "bf16":
            continue
        out = torch.empty_like(q)

        def fa3() -> None:
            flash_attn_varlen_func(q=q, k=cache_k, v=cache_v, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=lens, max_seqlen_k=context,
                                   softmax_scale=dim**-0.5, causal=True, block_table=table, fa_version=3, num_splits=1)  # fmt: skip

        rows.append({"kv_cache": kv_cache, "context": context, "kernel": "fa3_num_splits_1", "decode_us": round(do_bench(fa3, warmup=10, rep=50) * 1e3, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


#: fp8_cache_attention tilings compared; the first is ATTENTION_TILING.
FP8_TILINGS = [ATTENTION_TILING] + [
    tiling for tile in (64, 128) for warps in (1, 2, 4) for stages in (1, 2, 3) for split in (False, True)
    if (tiling := AttentionTiling(16, tile, warps, stages, split)) != ATTENTION_TILING
]  # fmt: skip


def fp8_attention_part(
    tilings: list[AttentionTiling], heads: int = 32, kv_heads: int = 8, batch: int = 512, contexts: tuple[int, ...] = (512, 1536),
    prefill_seqs: int = 16,
) -> list[dict[str, Any]]:  # fmt: skip
    """Decode over a paged E4M3 cache (`heads` query heads over `kv_heads` of 128 dimensions, by default
    Qwen3-8B's; 16-token blocks scattered) per tiling, and the prefill of `prefill_seqs` whole
    sequences of the same context over the same cache."""
    dim, block = 128, 16
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    for context in contexts:
        blocks = -(-context // block)
        cache_k = (torch.randn(batch * blocks, block, kv_heads, dim, generator=gen, device="cuda") * 16).to(torch.float8_e4m3fn)
        cache_v = (torch.randn(batch * blocks, block, kv_heads, dim, generator=gen, device="cuda") * 16).to(torch.float8_e4m3fn)
        scale = torch.full((1,), 1 / 16, device="cuda")
        table = torch.randperm(batch * blocks, generator=gen, device="cuda").to(torch.int32).view(batch, blocks)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
        starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        q_pre = torch.randn(context, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
        q_pre[-1] = q[0]
        starts_pre = torch.tensor([0, context], dtype=torch.int32, device="cuda")
        q_fill = torch.randn(prefill_seqs * context, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
        starts_fill = torch.arange(prefill_seqs + 1, dtype=torch.int32, device="cuda") * context
        bytes_read = 2 * batch * context * kv_heads * dim
        for tiling in tilings:
            setting = {"kernel": "fp8_cache_attention", "heads": heads, "kv_heads": kv_heads, "batch": batch, "context": context,
                       **tiling.__dict__, "current": tiling == ATTENTION_TILING}  # fmt: skip

            def call(query: torch.Tensor, starts: torch.Tensor, seqs: int, _tiling: AttentionTiling = tiling) -> torch.Tensor:
                return fp8_cache_attention(query, cache_k, cache_v, table[:seqs], starts, lens[:seqs], dim**-0.5, scale, scale,
                                           torch.empty_like(query), _tiling)  # fmt: skip

            try:
                same = torch.equal(call(q, starts, batch)[0], call(q_pre, starts_pre, 1)[-1])
                us = round(do_bench(lambda: call(q, starts, batch), warmup=10, rep=50) * 1e3, 1)
                prefill_us = round(do_bench(lambda: call(q_fill, starts_fill, prefill_seqs), warmup=5, rep=20) * 1e3, 1)
                row = {**setting, "decode_equals_prefill": same, "decode_us": us, "kv_read_gb_per_s": round(bytes_read / us / 1e3),
                       "prefill_seqs": prefill_seqs, "prefill_us": prefill_us}  # fmt: skip
            except Exception as error:  # noqa: BLE001  (a tiling that does not compile is a result)
                row = {**setting, "error": repr(error)[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="gemm,attention,fp8_attention")
    parser.add_argument("--tiles", choices=("all", "current"), default="all", help="GEMM tile configurations to compare")
    parser.add_argument("--kv-caches", default="bf16,fp8", help="attention: KV-cache dtypes, bf16 and/or fp8")
    parser.add_argument("--attention-settings", choices=("all", "current"), default="all", help="attention: TRITON_ATTN launch settings")
    parser.add_argument("--fp8-tilings", choices=("all", "current"), default="all", help="fp8_attention: fp8_cache_attention tilings")
    parser.add_argument("--fp8-heads", default="32,8", metavar="Q,KV",
                        help="fp8_attention: query and KV heads (Qwen3-8B's 32,8 by default; Qwen3-1.7B's 16,8)")
    args = parser.parse_args(argv)
    try:
        heads, kv_heads = (int(n) for n in args.fp8_heads.split(","))
    except ValueError:
        parser.error(f"--fp8-heads {args.fp8_heads}: two integers, Q,KV, expected")
    if kv_heads < 1 or heads % kv_heads:
        parser.error(f"--fp8-heads {args.fp8_heads}: the query heads must be a multiple of the KV heads")
    import vllm

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                              "vllm": vllm.__version__, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    tiles = TILES if args.tiles == "all" else TILES[:1]
    settings = ATTENTION_SETTINGS if args.attention_settings == "all" else ATTENTION_SETTINGS[:1]
    attention = functools.partial(attention_part, kv_caches=tuple(args.kv_caches.split(",")), settings=settings)
    fp8_attention = functools.partial(fp8_attention_part, FP8_TILINGS if args.fp8_tilings == "all" else FP8_TILINGS[:1], heads, kv_heads)
    for part, fn in (("gemm", functools.partial(gemm_part, tiles)), ("attention", attention), ("fp8_attention", fp8_attention)):
        if part in args.parts:
            report[part] = fn()
            args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
