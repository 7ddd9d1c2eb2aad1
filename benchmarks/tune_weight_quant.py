"""Pick the launch configuration of the Triton weight quantizer (`quant.triton_blockwise.LAUNCH`).

    python benchmarks/tune_weight_quant.py --results DIR

For each (128x128 blocks per program along K, warps, loop stages) it checks the output against
the torch reference bit for bit on every 8B-model weight shape of benchmarks/kernels.py, then
times it (`triton.testing.do_bench` median, L2 flushed) and reports GB/s = (2 N K read + N K
codes + scales written) / time as a share of the measured device-to-device copy bandwidth.
Writes DIR/tune_weight_quant.json; the best configuration (highest worst-shape share) is the one
to put into `LAUNCH`.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.kernels import SHAPES, copy_bandwidth_gbps, median_ms  # noqa: E402
from fp8_align.quant import quantize_weight_blockwise  # noqa: E402
from fp8_align.quant import triton_blockwise as tb  # noqa: E402

GRID = {"k_blocks": (1, 2, 4), "num_warps": (4, 8, 16), "num_stages": (1, 2, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    weights = {name: (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for name, (n, k) in SHAPES.items()}
    references = {name: quantize_weight_blockwise(w) for name, w in weights.items()}
    copy_gbps = copy_bandwidth_gbps()
    rows = []
    for k_blocks, num_warps, num_stages in itertools.product(*GRID.values()):
        if k_blocks == 1 and num_stages > 1:
            continue  # a one-iteration loop has nothing to pipeline
        tb.LAUNCH.update(k_blocks=k_blocks, num_warps=num_warps, num_stages=num_stages)
        row = {"k_blocks": k_blocks, "num_warps": num_warps, "num_stages": num_stages, "share_of_copy": {}}
        for name, w in weights.items():
            codes, scales = tb.quantize_weight_blockwise_triton(w, check_finite=False)
            ref_codes, ref_scales = references[name]
            if not (torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and torch.equal(scales, ref_scales)):
                raise AssertionError(f"{row} differs from the reference on {name}")
            n, k = w.shape
            moved = 3 * n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)
            ms = median_ms(lambda: tb.quantize_weight_blockwise_triton(w, check_finite=False))
            row["share_of_copy"][name] = moved / ms / 1e6 / copy_gbps
        row["worst_share"] = min(row["share_of_copy"].values())
        rows.append(row)
        print(json.dumps(row), flush=True)
    best = max(rows, key=lambda r: r["worst_share"])
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "copy_bandwidth_GBps": copy_gbps, "configs": rows, "best": best,
    }  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "tune_weight_quant.json").write_text(json.dumps(report, indent=2))
    print(f"best: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
