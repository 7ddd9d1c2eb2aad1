"""Decode attention alone: vLLM's FlashAttention 3 on a paged KV cache, BF16 vs FP8, by page size.

    python benchmarks/attention_decode.py --results DIR [--batch 256] [--context 1554] [--kernels fa3,xqa]
        [--xqa-layouts NHD,HND] [--output NAME.json]

One decode step of one layer of the Qwen3-8B shape (32 query heads, 8 KV heads, head dim 128):
`batch` sequences of `context` cached tokens each, pages of `block_size` tokens scattered at
random over the cache (as a long-running engine leaves them), called the way vLLM 0.22's
FLASH_ATTN backend calls it (`torch.ops._vllm_fa3_C.fwd`; FP8: query, K and V in e4m3 with
descales). Also FA3's `pack_gqa` and `num_splits` choices. Reports the time per call (median of
CUDA-event timings) and the KV bytes read per second, to DIR/attention_decode.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `benchmarks.*`

from benchmarks.rollout.report import device_and_versions  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _timed_decode(call: Callable[[], None], kv_bytes: int, repeats: int) -> dict[str, Any]:
    """Median seconds of `call` over `repeats` CUDA-event timings (after 3 warm-up calls), and the
    achieved read rate of its `kv_bytes` KV-cache bytes."""
    import torch

    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    seconds = statistics.median(times)
    return {"seconds": seconds, "kv_bytes": kv_bytes, "GBps": kv_bytes / seconds / 1e9}


def time_decode_attention(
    dtype_name: str, batch: int, context: int, block_size: int, pack_gqa: bool | None, num_splits: int, repeats: int = 30
) -> dict[str, Any]:
    """Median seconds of one FA3 decode call and the KV-cache bytes it reads."""
    import torch

    import vllm.vllm_flash_attn  # noqa: F401  (registers torch.ops._vllm_fa3_C)

    fp8 = dtype_name == "fp8"
    device = "cuda"
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    g = torch.Generator(device=device).manual_seed(0)
    k_cache = torch.randn((num_blocks, block_size, KV_HEADS, HEAD_DIM), device=device, dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn((batch, Q_HEADS, HEAD_DIM), device=device, dtype=torch.bfloat16, generator=g)
    if fp8:
        k_cache, v_cache, q = (t.to(torch.float8_e4m3fn) for t in (k_cache, v_cache, q))
    block_table = torch.randperm(num_blocks - 1, device=device, generator=g)[: batch * blocks_per_seq].view(batch, blocks_per_seq).int()
    seqused_k = torch.full((batch,), context, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    out = torch.empty((batch, Q_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)
    descale = torch.ones(1, dtype=torch.float32, device=device).expand(batch, KV_HEADS) if fp8 else None

    def call() -> None:
        torch.ops._vllm_fa3_C.fwd(
            q, k_cache, v_cache, None, None, None, out, cu_seqlens_q, None, None, None, seqused_k, 1, context,
            block_table, None, None, None, None, None, descale, descale, descale, HEAD_DIM**-0.5, True, -1, -1, 0.0,
            True, None, num_splits, pack_gqa, 0, None, 1, 0, None,
        )  # fmt: skip

    return _timed_decode(call, 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size(), repeats)


def time_xqa_decode(batch: int, context: int, block_size: int, layout: str = "NHD", repeats: int = 30) -> dict[str, Any]:
    """Median seconds of one FlashInfer XQA decode call (BF16 query, E4M3 KV cache, the same
    scattered pages as `time_decode_attention`) and the KV-cache bytes it reads. `layout`: the
    page layout, "NHD" ([page, token, head, dim], vLLM's default) or "HND" ([page, head, token,
    dim], vLLM's VLLM_KV_CACHE_LAYOUT=HND). Needs the XQA module for this shape prebuilt
    (benchmarks/box/build_flashinfer_aot.sh) where nvcc is missing."""
    import torch
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    device = "cuda"
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    g = torch.Generator(device=device).manual_seed(0)
    page = (block_size, KV_HEADS) if layout == "NHD" else (KV_HEADS, block_size)
    k_cache = torch.randn((num_blocks, *page, HEAD_DIM), device=device, generator=g).to(torch.float8_e4m3fn)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(torch.float8_e4m3fn)
    q = torch.randn((batch, Q_HEADS, HEAD_DIM), device=device, dtype=torch.bfloat16, generator=g)
    block_table = torch.randperm(num_blocks - 1, device=device, generator=g)[: batch * blocks_per_seq].view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=device)
    out = torch.empty_like(q)

    def call() -> None:
        trtllm_batch_decode_with_kv_cache(
            q, (k_cache, v_cache), workspace, block_table, seq_lens, context, bmm1_scale=HEAD_DIM**-0.5, bmm2_scale=1.0,
            out=out, kv_layout=layout, backend="xqa",
        )  # fmt: skip

    return _timed_decode(call, 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size(), repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1554)
    parser.add_argument("--block-sizes", default="16,32,64,128,256")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--kernels", default="fa3", help="fa3 (BF16 and FP8, all FA3 settings) and/or xqa (FP8 KV)")
    parser.add_argument("--xqa-layouts", default="NHD", help="page layouts XQA is timed with: NHD and/or HND")
    parser.add_argument("--output", default="attention_decode.json")
    args = parser.parse_args(argv)
    kernels = set(args.kernels.split(","))
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **device_and_versions(), "batch": args.batch, "context": args.context, "runs": [],
    }  # fmt: skip
    for block_size in map(int, args.block_sizes.split(",")):
        for layout in args.xqa_layouts.split(",") if "xqa" in kernels else ():
            run = {"kernel": "xqa", "dtype": "fp8", "block_size": block_size, "layout": layout}
            try:
                run.update(time_xqa_decode(args.batch, args.context, block_size, layout))
            except Exception as exc:  # a missing prebuilt module or shape: recorded, not fatal
                run["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
        for dtype_name in ("bf16", "fp8") if "fa3" in kernels else ():
            for pack_gqa in (None, False, True):
                for num_splits in (0, 1):
                    run = {"kernel": "fa3", "dtype": dtype_name, "block_size": block_size, "pack_gqa": pack_gqa, "num_splits": num_splits}
                    try:
                        run.update(time_decode_attention(dtype_name, args.batch, args.context, block_size, pack_gqa, num_splits))
                    except RuntimeError as exc:  # an unsupported combination: recorded, not fatal
                        run["error"] = str(exc).splitlines()[0][:300]
                    report["runs"].append(run)
                    print(json.dumps(run), flush=True)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / args.output).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
