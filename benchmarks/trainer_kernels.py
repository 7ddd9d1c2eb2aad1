"""The bitwise trainer's own kernels at a training shape (GPU, vLLM importable): where its step time
goes against the kernels a TE trainer runs, and which faster launches keep the engine's bits.

    python benchmarks/trainer_kernels.py --out trainer_kernels.json [--batch 8] [--length 2048] [--parts prefill,backward,linear_backward,output]

The shape: B sequences of S tokens, the Qwen3-8B heads (32 query heads, 8 KV heads of 128) and
output layer (4096 -> 151936), as benchmarks/megatron_bitwise_cost.py measures it.
- prefill: the trainer's whole-sequence pass of `fp8_cache_attention` over an E4M3 paged cache
  per `AttentionTiling` (the engine's, `TRAINER_TILING`, and more rows per program), each row's
  bits against the engine tiling's (`equals_engine`) and its time; cuDNN's BF16 attention forward
  (torch SDPA, what TE's spec runs) for scale.
- backward: the attention gradient per implementation (`flash_varlen`: `flash_attention_vjp`, what
  the trainer runs; `padded_sdpa`: autograd of the BF16 `attention_reference`, what it ran before;
  `cudnn_sdpa`: torch's cuDNN backend on the padded batch with repeated K/V; `cudnn_sdpa_grouped`:
  cuDNN with the KV heads as they are, equal lengths unpadded), each timed, checked
  for equal bits over two runs (`repeatable`), and its largest error against the FP32 gradient.
- linear_backward: per Qwen3-8B projection (q|k|v, o, gate|up, down), the two gradient products
  of a linear over `batch * length` tokens in BF16 (cuBLAS, the `bitwise_linear_backward="bf16"`
  backward) and in block FP8 (`fp8_backward.input_gradient`, `weight_gradient`: the Triton
  quantizers and cuBLAS's block-scaled GEMMs), each timed whole, the FP8 one also without its
  quantization (`gemms_ms`), and its relative error against the FP64 product of the BF16 operands.
- output: vLLM's batch-invariant persistent matmul (the engine's output layer) per launch
  configuration, its bits against the engine's configuration (`equals_engine`) and its time, next
  to cuBLAS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from fp8_align.bitwise.fp8_cache_attention import ATTENTION_TILING, TRAINER_TILING, AttentionTiling, fp8_cache_attention
from fp8_align.hf_training.attention import PackedBatch, attention_reference, flash_attention_vjp
from fp8_align.hf_training.fp8_backward import input_gradient, weight_gradient
from fp8_align.quant.shards import quantize_shards
from fp8_align.quant.triton_groupwise import ScaleLayout, quantize_activation_transposed_triton, quantize_activation_triton
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.compat import persistent_matmul

HEADS, KV_HEADS, HEAD_SIZE, HIDDEN, VOCAB = 32, 8, 128, 4096, 151936
#: The Qwen3-8B projections as the engine stacks them: name -> (shard sizes, input size).
PROJECTIONS = {"qkv": ([4096, 1024, 1024], 4096), "o": ([4096], 4096), "gate_up": ([12288, 12288], 4096), "down": ([4096], 12288)}
PREFILL_TILINGS = [ATTENTION_TILING, TRAINER_TILING] + [
    AttentionTiling(block_m, ATTENTION_TILING.tile, ATTENTION_TILING.num_warps, stages, split)
    for block_m in (32, 64) for stages in (1, 2, 3) for split in (False, True)
]  # fmt: skip
#: vLLM's batch-invariant BF16 configuration first (`matmul_persistent`), then candidates with its K step.
OUTPUT_CONFIGS = [
    {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_stages": 3, "num_warps": 8},
    {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_stages": 3, "num_warps": 8},
    {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_stages": 4, "num_warps": 8},
    {"BLOCK_SIZE_M": 256, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_stages": 3, "num_warps": 8},
    {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_stages": 4, "num_warps": 8},
]


def _unique(tilings: list[AttentionTiling]) -> list[AttentionTiling]:
    return list(dict.fromkeys(tilings))


def prefill_part(batch: int, length: int) -> list[dict[str, Any]]:
    """Per tiling, the trainer's prefill of `batch` sequences of `length` tokens over an E4M3 cache."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, block = batch * length, 16
    blocks = tokens // block
    cache_k = (torch.randn(blocks, block, KV_HEADS, HEAD_SIZE, generator=gen, device="cuda") * 16).to(torch.float8_e4m3fn)
    cache_v = (torch.randn(blocks, block, KV_HEADS, HEAD_SIZE, generator=gen, device="cuda") * 16).to(torch.float8_e4m3fn)
    table = torch.randperm(blocks, generator=gen, device="cuda").to(torch.int32).view(batch, -1)
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * length
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(tokens, HEADS, HEAD_SIZE, generator=gen, device="cuda").to(torch.bfloat16)
    scale = torch.full((1,), 1 / 16, device="cuda")

    def call(tiling: AttentionTiling) -> torch.Tensor:
        return fp8_cache_attention(q, cache_k, cache_v, table, starts, lens, HEAD_SIZE**-0.5, scale, scale, torch.empty_like(q), tiling)

    engine = call(ATTENTION_TILING)
    rows: list[dict[str, Any]] = []
    for tiling in _unique(PREFILL_TILINGS):
        row: dict[str, Any] = {"kernel": "fp8_cache_attention", **dataclasses.asdict(tiling), "engine": tiling == ATTENTION_TILING,
                               "trainer": tiling == TRAINER_TILING}  # fmt: skip
        try:
            out = call(tiling)
            row["differing_rows"] = int((out.view(torch.int16) != engine.view(torch.int16)).flatten(1).any(1).sum())
            row["equals_engine"] = row["differing_rows"] == 0
            row["ms"] = round(do_bench(lambda t=tiling: call(t), warmup=5, rep=30), 3)
        except Exception as error:  # noqa: BLE001  (a tiling that does not compile is a result)
            row["error"] = repr(error)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    qs = q.view(batch, length, HEADS, HEAD_SIZE).transpose(1, 2)
    ks = torch.randn(batch, KV_HEADS, length, HEAD_SIZE, device="cuda", dtype=torch.bfloat16).repeat_interleave(HEADS // KV_HEADS, 1)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        ms = do_bench(lambda: F.scaled_dot_product_attention(qs, ks, ks, is_causal=True), warmup=5, rep=30)
    rows.append({"kernel": "cudnn_sdpa_bf16_forward", "ms": round(ms, 3)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def backward_part(batch: int, length: int) -> list[dict[str, Any]]:
    """Per implementation, the attention gradient of `batch` sequences of `length` tokens."""
    torch.manual_seed(0)
    packed = PackedBatch.from_lengths([length] * batch, "cuda")
    tokens = batch * length
    q, k, v = (torch.randn(tokens, h * HEAD_SIZE, device="cuda").to(torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    grad = torch.randn(tokens, HEADS * HEAD_SIZE, device="cuda").to(torch.bfloat16)

    def autograd(dtype: torch.dtype, backend: list[Any] | None = None) -> tuple[torch.Tensor, ...]:
        inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        if backend is None:
            attention_reference(*inputs, packed, HEAD_SIZE, compute_dtype=dtype).backward(grad.to(dtype))
        else:
            with torch.nn.attention.sdpa_kernel(backend):
                attention_reference(*inputs, packed, HEAD_SIZE, compute_dtype=dtype).backward(grad.to(dtype))
        return tuple(x.grad for x in inputs)

    def cudnn_grouped() -> tuple[torch.Tensor, ...]:
        """cuDNN's SDPA forward (for the log-sum-exp) and backward on [B, H, S, D] with the KV heads as
        they are (`enable_gqa`): equal lengths, so no padding."""
        inputs = [x.detach().view(batch, length, -1, HEAD_SIZE).transpose(1, 2).requires_grad_() for x in (q, k, v)]
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True)
        out.backward(grad.view(batch, length, HEADS, HEAD_SIZE).transpose(1, 2))
        return tuple(x.grad.transpose(1, 2).reshape(tokens, -1) for x in inputs)

    exact = autograd(torch.float32)
    vjp = flash_attention_vjp(packed, HEAD_SIZE)
    candidates: dict[str, Callable[[], tuple[torch.Tensor, ...]]] = {
        "flash_varlen": lambda: vjp((q, k, v), None, (grad,)),
        "padded_sdpa": lambda: autograd(torch.bfloat16),
        "cudnn_sdpa": lambda: autograd(torch.bfloat16, [torch.nn.attention.SDPBackend.CUDNN_ATTENTION]),
        "cudnn_sdpa_grouped": cudnn_grouped,
    }
    rows: list[dict[str, Any]] = []
    for name, fn in candidates.items():
        row: dict[str, Any] = {"kernel": name, "batch": batch, "length": length}
        try:
            first, second = fn(), fn()
            row["repeatable"] = all(torch.equal(a, b) for a, b in zip(first, second))
            row["max_error"] = {f"d{n}": (g.float() - e).abs().max().item() for n, g, e in zip("qkv", first, exact)}
            row["ms"] = round(do_bench(fn, warmup=3, rep=20), 3)
        except Exception as error:  # noqa: BLE001  (a backend that refuses the shape is a result)
            row["error"] = repr(error)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def linear_backward_part(batch: int, length: int) -> list[dict[str, Any]]:
    """Per projection, its BF16 and block-FP8 backward over `batch * length` tokens (pow2 scales)."""
    from torch.nn.functional import ScalingType, scaled_mm

    rounding = Rounding(weight_pow2=True, activation_pow2=True)
    tokens = batch * length
    rows: list[dict[str, Any]] = []
    for name, (shards, k) in PROJECTIONS.items():
        gen = torch.Generator(device="cuda").manual_seed(len(rows))
        n = sum(shards)
        x = torch.randn(tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
        weight = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        grad = (torch.randn(tokens, n, generator=gen, device="cuda") * 1e-3).to(torch.bfloat16)
        codes, scales = quantize_shards(weight, shards, True)
        row: dict[str, Any] = {"kernel": name, "n": n, "k": k, "tokens": tokens}
        try:
            row["bf16_ms"] = round(do_bench(lambda: (grad @ weight, grad.t() @ x), warmup=3, rep=20), 3)
            fp8 = lambda: (input_gradient(grad, codes, scales, rounding), weight_gradient(grad, x, rounding))  # noqa: E731
            row["fp8_ms"] = round(do_bench(fp8, warmup=3, rep=20), 3)
            g_rows = quantize_activation_triton(grad, True, int(ScaleLayout.COLUMN_MAJOR))
            g_t, x_t = quantize_activation_transposed_triton(grad, True), quantize_activation_transposed_triton(x, True)
            block_scales = scales.new_zeros(scales.shape[1], -(-scales.shape[0] // 4) * 4)
            block_scales[:, : scales.shape[0]] = scales.t()
            codes_t = codes.t().contiguous().t()

            def gemms() -> tuple[torch.Tensor, torch.Tensor]:
                dx = scaled_mm(g_rows[0], codes_t, g_rows[1], ScalingType.BlockWise1x128, block_scales.t(), ScalingType.BlockWise128x128)
                dw = scaled_mm(g_t[0], x_t[0].t(), g_t[1], ScalingType.BlockWise1x128, x_t[1], ScalingType.BlockWise1x128)
                return dx, dw

            row["gemms_ms"] = round(do_bench(gemms, warmup=3, rep=20), 3)
            dx, dw = fp8()
            exact_dx, exact_dw = grad.double() @ weight.double(), grad.double().t() @ x.double()
            row["relative_error"] = {"dx": ((dx.double() - exact_dx).norm() / exact_dx.norm()).item(),
                                     "dw": ((dw.double() - exact_dw).norm() / exact_dw.norm()).item()}  # fmt: skip
        except Exception as error:  # noqa: BLE001  (a GEMM that refuses the shape is a result)
            row["error"] = repr(error)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def output_part(batch: int, length: int) -> list[dict[str, Any]]:
    """Per launch configuration, the output layer's BF16 product over `batch * length` rows."""
    from vllm.model_executor.layers.batch_invariant import matmul_kernel_persistent

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(batch * length, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)

    def call(config: dict[str, int]) -> torch.Tensor:
        return persistent_matmul(matmul_kernel_persistent, x, weight.t(), config)

    engine = call(OUTPUT_CONFIGS[0])
    rows: list[dict[str, Any]] = []
    for config in OUTPUT_CONFIGS:
        row: dict[str, Any] = {"kernel": "matmul_kernel_persistent", **config, "engine": config == OUTPUT_CONFIGS[0]}
        try:
            row["equals_engine"] = torch.equal(call(config), engine)
            row["ms"] = round(do_bench(lambda c=config: call(c), warmup=3, rep=20), 3)
        except Exception as error:  # noqa: BLE001
            row["error"] = repr(error)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.append({"kernel": "cublas_bf16", "ms": round(do_bench(lambda: x @ weight.t(), warmup=3, rep=20), 3)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--parts", default="prefill,backward,linear_backward,output")
    args = parser.parse_args(argv)
    import vllm

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                              "vllm": vllm.__version__, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "command": " ".join(["trainer_kernels.py", *(sys.argv[1:] if argv is None else argv)])}  # fmt: skip
    parts = {"prefill": prefill_part, "backward": backward_part, "linear_backward": linear_backward_part, "output": output_part}
    for name in args.parts.split(","):
        report[name] = parts[name](args.batch, args.length)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
