"""How DeepGEMM's m-grouped contiguous GEMM (vLLM's MoE DeepGEMM backend) JIT-compiles on this GPU:
time one call per M and count new kernels in DG_JIT_CACHE_DIR, for the Qwen3-30B-A3B expert shapes.

    DG_JIT_CACHE_DIR=/tmp/dg_probe python benchmarks/box/deepgemm_grouped_probe.py OUT.json

If every new M compiles a kernel, vLLM's start-up warm-up (every multiple of 128 up to
max_num_batched_tokens * top_k + experts * 127) compiles ~1,150 kernels per weight, serially.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from vllm.utils.deep_gemm import m_grouped_fp8_gemm_nt_contiguous

EXPERTS, BLOCK = 128, 128
SHAPES = {"w13": (1536, 2048), "w2": (2048, 768)}  # (N, K) of Qwen3-30B-A3B's experts
M_VALUES = (128, 256, 384, 512, 4096, 8192, 20352, 65536, 147328)


def cache_entries(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def main() -> None:
    cache = Path(os.environ["DG_JIT_CACHE_DIR"])
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.zeros(EXPERTS, n, k, device="cuda").to(torch.float8_e4m3fn)
        w_scale = torch.ones(EXPERTS, n // BLOCK, k // BLOCK, device="cuda")
        for m in M_VALUES:
            a = torch.zeros(m, k, device="cuda").to(torch.float8_e4m3fn)
            a_scale = torch.ones(m, k // BLOCK, device="cuda")
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ids = torch.randint(0, EXPERTS, (m // BLOCK,), device="cuda", generator=g, dtype=torch.int32).repeat_interleave(BLOCK)
            before = cache_entries(cache)
            torch.cuda.synchronize()
            start = time.perf_counter()
            m_grouped_fp8_gemm_nt_contiguous((a, a_scale), (w, w_scale), out, ids)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            start = time.perf_counter()
            m_grouped_fp8_gemm_nt_contiguous((a, a_scale), (w, w_scale), out, ids)
            torch.cuda.synchronize()
            rows.append({"weight": name, "n": n, "k": k, "m": m, "first_call_s": round(first, 4),
                         "second_call_s": round(time.perf_counter() - start, 5), "new_cache_entries": cache_entries(cache) - before})
            print(rows[-1], flush=True)
    Path(sys.argv[1]).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
