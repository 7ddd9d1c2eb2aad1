"""Block-FP8 GEMM throughput per backend vs BF16, and the weight quantizer's bandwidth (CUDA).

    python benchmarks/gemm_kernels.py --results DIR [--skip-gemm]

GEMM shapes of an 8B model (Qwen3-8B / Llama-3-8B style), N x K:
qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down 4096x12288, at M = 4096 (prefill) and
M = 64 (decode). For each fp8_align backend (`vllm_plugin.kernels.gpu.GPU_KERNEL_ORDER` minus the torch
reference and triton_per_shard; a backend not eligible on the device is recorded as skipped,
with the reason) two timings: `gemm` (pre-quantized activations, the backend's scale layout) and
`linear` (activation quantization + GEMM, what the plugin runs). BF16 is `F.linear`.
TFLOP/s = 2 M N K / median time (`triton.testing.do_bench`, which flushes L2 before each run).

Weight quantization: the torch reference `fp8_align.quant.quantize_weight_blockwise` and the
Triton kernel the plugin runs on CUDA (`quant.triton_blockwise.quantize_weight_blockwise_triton`,
bit-identical) for each weight, GB/s = (2 N K bytes read + N K codes + scales written) / median
time, next to two measured device-to-device copy bandwidths (bytes read + written): a 1 GiB
tensor (`copy_bandwidth_GBps`, the device's best) and a copy of that same [N, K] bf16 weight
(`copy_same_shape_GBps`: the same launch, wave and tail effects as the quantizer, which reads
the same bytes). The activation quantization kernel's bandwidth is reported the same way at M = 4096.
Writes DIR/kernels.json (DIR/kernels_quant.json with --skip-gemm: quantization rows only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fp8_align.config import FP8Config
from fp8_align.quant import quantize_weight_blockwise
from fp8_align.rounding import Rounding
from fp8_align.quant.triton_blockwise import quantize_weight_blockwise_triton
from fp8_align.quant.triton_groupwise import ScaleLayout, quantize_activation_triton
from fp8_align.vllm_plugin.kernels import gpu as gk
from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
M_VALUES = {"prefill": 4096, "decode": 64}


def median_ms(fn: Any) -> float:
    """Median milliseconds of `fn()` over about 200 ms of runs, after 50 ms of warm-up."""
    return float(do_bench(fn, warmup=50, rep=200, return_mode="median"))


def _layer(n: int, k: int) -> torch.nn.Module:
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    codes, scales = quantize_weight_blockwise(w)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(codes, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
    layer.fp8_align = Fp8AlignLayerState("linear", f"bench[{n}x{k}]", Rounding(), shard_sizes=[n])
    layer.bf16_weight = w
    return layer


def gemm_rows(target: Any) -> list[dict[str, Any]]:
    rows = []
    for shape_name, (n, k) in SHAPES.items():
        layer = _layer(n, k)
        for phase, m in M_VALUES.items():
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            flops = 2.0 * m * n * k
            bf16_ms = median_ms(lambda: F.linear(x, layer.bf16_weight))
            rows.append({"shape": shape_name, "phase": phase, "M": m, "N": n, "K": k, "kernel": "bf16", "op": "linear",
                         "ms": bf16_ms, "tflops": flops / bf16_ms / 1e9})  # fmt: skip
            for kernel_type in gk.GPU_KERNEL_ORDER:
                kernel = kernel_type()
                if kernel.name in ("emulated", "triton_per_shard"):
                    continue
                reason = kernel.unsupported_reason(gk.LayerShape(n, k, (n,)), target)
                if reason is not None:
                    rows.append({"shape": shape_name, "phase": phase, "M": m, "N": n, "K": k, "kernel": kernel.name, "skipped": reason})
                    continue
                x_fp8, x_scale = quantize_activation_triton(x, False, int(kernel.scale_layout))
                gemm_ms = median_ms(lambda: kernel.gemm(layer, x_fp8, x_scale, torch.bfloat16))
                linear_ms = median_ms(lambda: kernel.apply(layer, x, None))
                for op, ms in (("gemm", gemm_ms), ("linear", linear_ms)):
                    rows.append({"shape": shape_name, "phase": phase, "M": m, "N": n, "K": k, "kernel": kernel.name, "op": op,
                                 "ms": ms, "tflops": flops / ms / 1e9, "speedup_vs_bf16": bf16_ms / ms})  # fmt: skip
            print(f"timed {shape_name} {phase}", flush=True)
        del layer
    return rows


def copy_gbps(src: torch.Tensor) -> float:
    """Device-to-device copy bandwidth of `src` into a new tensor: GB/s, bytes read + written."""
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / median_ms(lambda: dst.copy_(src)) / 1e6


def copy_bandwidth_gbps() -> float:
    """The device's copy bandwidth, measured on a 1 GiB tensor."""
    return copy_gbps(torch.empty(2**30, dtype=torch.uint8, device="cuda").random_())


def weight_quant_bytes(n: int, k: int) -> int:
    """Bytes a weight quantizer moves for a bf16 [n, k] weight: read, codes and FP32 block scales written."""
    return 2 * n * k + n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)


def quantizer_rows() -> list[dict[str, Any]]:
    rows = []
    for shape_name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        moved = weight_quant_bytes(n, k)
        same_shape_gbps = copy_gbps(w)
        kernels = {
            "quantize_weight_blockwise": lambda: quantize_weight_blockwise(w),
            # as the refit runs it: the input was validated before (no NaN check, no sync)
            "quantize_weight_blockwise_triton": lambda: quantize_weight_blockwise_triton(w, check_finite=False),
        }
        for what, fn in kernels.items():
            ms = median_ms(fn)
            rows.append({"what": what, "shape": shape_name, "N": n, "K": k, "ms": ms, "GBps": moved / ms / 1e6,
                         "copy_same_shape_GBps": same_shape_gbps, "share_of_same_shape_copy": moved / ms / 1e6 / same_shape_gbps})  # fmt: skip
        x = torch.randn(M_VALUES["prefill"], k, device="cuda").to(torch.bfloat16)
        ms = median_ms(lambda: quantize_activation_triton(x, False, int(ScaleLayout.ROW_MAJOR)))
        moved = 3 * x.numel() + 4 * x.shape[0] * math.ceil(k / 128)
        same_shape_gbps = copy_gbps(x)
        rows.append({"what": "quantize_activation_triton", "shape": f"x[{x.shape[0]}, {k}]", "M": x.shape[0], "K": k, "ms": ms,
                     "GBps": moved / ms / 1e6, "copy_same_shape_GBps": same_shape_gbps,
                     "share_of_same_shape_copy": moved / ms / 1e6 / same_shape_gbps})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--skip-gemm", action="store_true", help="time the quantization kernels only")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    target = gk.Target(device, torch.cuda.get_device_capability(0), torch.bfloat16, FP8Config())
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=True)
    import triton
    import vllm

    device_copy_gbps = copy_bandwidth_gbps()
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": smi.stdout.strip(),
        "torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": triton.__version__, "vllm": vllm.__version__,
        "timing": "triton.testing.do_bench median, warmup 50 ms, rep 200 ms, L2 flushed before each run",
        "copy_bandwidth_GBps": device_copy_gbps,
        "quantization": quantizer_rows(),
        "gemm": [] if args.skip_gemm else gemm_rows(target),
    }  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / ("kernels_quant.json" if args.skip_gemm else "kernels.json")).write_text(json.dumps(report, indent=2))
    print(f"\ncopy {device_copy_gbps:.0f} GB/s; " + "; ".join(
        f"{r['what']} {r['shape']} {r['GBps']:.0f} GB/s ({r['GBps'] / device_copy_gbps:.0%}; same-shape copy {r['copy_same_shape_GBps']:.0f}, "
        f"{r['share_of_same_shape_copy']:.0%})" for r in report["quantization"]))
    print(f"{'shape':8} {'phase':7} {'kernel':9} {'op':6} {'TFLOP/s':>8} {'x bf16':>7}")
    for r in report["gemm"]:
        if "skipped" in r:
            print(f"{r['shape']:8} {r['phase']:7} {r['kernel']:9} skipped: {r['skipped']}")
            continue
        print(f"{r['shape']:8} {r['phase']:7} {r['kernel']:9} {r['op']:6} {r['tflops']:8.0f} {r.get('speedup_vs_bf16', 1.0):7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
