"""Pick the launch configurations of the refit's Triton kernels (CUDA).

    python benchmarks/tune_weight_quant.py --results DIR

Three kernels, each timed with `triton.testing.do_bench` (median, L2 flushed) for every
configuration of its grid, after checking its output against the torch reference:

    single   `quant.triton_blockwise.LAUNCH`: one weight per launch, on each 8B weight shape of
             benchmarks/gemm_kernels.py; GB/s = (2 N K read + N K codes + scales written) / time.
    grouped  `quant.triton_blockwise.GROUPED_LAUNCH`: the 252 projection weights of a Qwen3-8B
             refit (q, k, v, o, gate, up, down of 36 layers, as the trainer sends them) in one
             launch, what `refit_weights` runs; bytes moved as above, summed. Also `wall_ms`:
             the median of 10 synchronized calls timed on the host (launch preparation included:
             what the refit's quantize phase pays).
    finite   `checks.finite_triton.LAUNCH`: the NaN/Inf check over the same 252 weights (the
             refit's validation); GB/s = bytes read / time.

Each rate is also given as a share of the device-to-device copy bandwidth of a 1 GiB tensor
(bytes read + written). Writes DIR/tune_weight_quant.json; for each kernel the best configuration
(single: highest worst-shape share; the others: highest share) is the one to put into its LAUNCH.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `benchmarks.*`

import torch  # noqa: E402

from benchmarks.gemm_kernels import SHAPES, copy_bandwidth_gbps, median_ms, weight_quant_bytes  # noqa: E402
from fp8_align.checks import finite_triton as ft  # noqa: E402
from fp8_align.quant import quantize_weight_blockwise  # noqa: E402
from fp8_align.quant import triton_blockwise as tb  # noqa: E402

SINGLE_GRID = {"k_blocks": (1, 2), "num_warps": (4, 8), "rows_per_pass": (128, 64, 32)}
GROUPED_GRID = {"num_warps": (4, 8, 16), "rows_per_pass": (128, 64, 32)}
FINITE_GRID = {"block": (2048, 4096, 8192), "num_warps": (4, 8), "programs_per_sm": (2, 4, 8)}
#: Qwen3-8B (hidden 4096, intermediate 12288, 32 query / 8 KV heads of 128, 36 layers).
LAYER_SHAPES = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096),
                "gate": (12288, 4096), "up": (12288, 4096), "down": (4096, 12288)}  # fmt: skip
NUM_LAYERS = 36


def _configs(grid: dict[str, tuple[int, ...]]) -> list[dict[str, int]]:
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def _same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


def _wall_ms(fn: Callable[[], Any], calls: int = 10) -> float:
    """Median host wall time of `fn()` in ms, the device synchronized before and after each call."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def tune(name: str, grid: dict[str, tuple[int, ...]], launch: dict[str, int], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Time `run()` (which checks its output and returns its row) under every configuration of
    `grid` written into `launch`; restore `launch` and return {configs, best}."""
    default = dict(launch)
    rows = []
    try:
        for config in _configs(grid):
            launch.update(config)
            row = {**config, **run()}
            rows.append(row)
            print(name, json.dumps(row), flush=True)
    finally:
        launch.clear()
        launch.update(default)
    best = max(rows, key=lambda r: r["score"])
    return {"default": default, "configs": rows, "best": best}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    copy = copy_bandwidth_gbps()

    weights = {name: (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for name, (n, k) in SHAPES.items()}
    references = {name: quantize_weight_blockwise(w) for name, w in weights.items()}

    def single() -> dict[str, Any]:
        shares = {}
        for name, w in weights.items():
            if not _same_bits(tb.quantize_weight_blockwise_triton(w, check_finite=False), references[name]):
                raise AssertionError(f"{dict(tb.LAUNCH)} differs from the reference on {name}")
            ms = median_ms(lambda: tb.quantize_weight_blockwise_triton(w, check_finite=False))
            shares[name] = weight_quant_bytes(*w.shape) / ms / 1e6 / copy
        return {"share_of_copy": shares, "score": min(shares.values())}

    single_report = tune("single", SINGLE_GRID, tb.LAUNCH, single)
    del weights, references

    model = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(NUM_LAYERS) for n, k in LAYER_SHAPES.values()]
    codes = [torch.empty(w.shape, dtype=torch.float8_e4m3fn, device="cuda") for w in model]
    scales = [torch.empty((math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128)), device="cuda") for w in model]
    checked = {i: quantize_weight_blockwise(model[i]) for i in range(len(LAYER_SHAPES))}  # one layer, bit for bit
    grouped_bytes = sum(weight_quant_bytes(*w.shape) for w in model)
    read_bytes = sum(2 * w.numel() for w in model)

    def grouped() -> dict[str, Any]:
        tb.quantize_weights_blockwise_triton(model, codes, scales)
        for i, want in checked.items():
            if not _same_bits((codes[i], scales[i]), want):
                raise AssertionError(f"{dict(tb.GROUPED_LAUNCH)} differs from the reference on weight {i}")
        ms = median_ms(lambda: tb.quantize_weights_blockwise_triton(model, codes, scales))
        wall_ms = _wall_ms(lambda: tb.quantize_weights_blockwise_triton(model, codes, scales))
        return {"ms": ms, "wall_ms": wall_ms, "GBps": grouped_bytes / ms / 1e6, "score": grouped_bytes / ms / 1e6 / copy}

    grouped_report = tune("grouped", GROUPED_GRID, tb.GROUPED_LAUNCH, grouped)

    def finite() -> dict[str, Any]:
        if ft.flag_nonfinite_triton(model).any():
            raise AssertionError("finite weights flagged")
        ms = median_ms(lambda: ft.flag_nonfinite_triton(model))
        return {"ms": ms, "GBps": read_bytes / ms / 1e6, "score": read_bytes / ms / 1e6 / copy}

    finite_report = tune("finite", FINITE_GRID, ft.LAUNCH, finite)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "copy_bandwidth_GBps": copy,
        "model": {"layer_shapes": LAYER_SHAPES, "num_layers": NUM_LAYERS, "quantize_bytes_moved": grouped_bytes, "finite_bytes_read": read_bytes},
        "score": "single: worst share of copy over the shapes; grouped: share of copy; finite: read GB/s over copy GB/s",
        "single": single_report, "grouped": grouped_report, "finite": finite_report,
    }  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "tune_weight_quant.json").write_text(json.dumps(report, indent=2))
    for name in ("single", "grouped", "finite"):
        print(f"{name}: default {report[name]['default']}, best {report[name]['best']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
