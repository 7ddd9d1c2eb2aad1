"""The exact-and-fast summary (issue #39): bitwise on-policy with an FP8 KV cache against BF16 and
the fast mode's default, from rollout reports of one machine.

    python benchmarks/bitwise_speed.py --reports R1.json [R2.json ...] --out benchmarks/results/bitwise_speed.json

The reports are `rollout_throughput.py`'s (Qwen3-8B shape, 3 timed repeats per shape), possibly
one per GPU of one host; they must name one device, vLLM and torch. Variants read:
`bf16` (BF16), `fp8_align_kv_auto_dg` (the fast mode's default: FP8Config(kv_cache_dtype="fp8"),
DeepGEMM, the decode fp8_align picks) and `fp8_align_bitwise_kv` (FP8Config(on_policy="bitwise",
kv_cache_dtype="fp8")). Writes {"device", "vllm", "date", "shapes": {shape: {"bf16": [tok/s of each
repeat], "fp8_fast": [...], "fp8_bitwise_kv": [...]}}, "medians", "targets"}, the targets of the
issue checked on the medians: long >= 0.9x the fast mode and >= 1.9x BF16, short >= 1.35x BF16.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

#: Name in the summary -> rollout variant.
VARIANTS = {"bf16": "bf16", "fp8_fast": "fp8_align_kv_auto_dg", "fp8_bitwise_kv": "fp8_align_bitwise_kv"}
#: (shape, numerator, denominator, minimum ratio of the medians)
TARGETS = (("long", "fp8_bitwise_kv", "fp8_fast", 0.9), ("long", "fp8_bitwise_kv", "bf16", 1.9), ("short", "fp8_bitwise_kv", "bf16", 1.35))
#: Report fields that must agree between the reports joined.
SAME = ("device", "vllm", "torch")


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of `reports` (rollout reports of one machine); ValueError when they disagree on
    `SAME` or a variant is missing or measured twice."""
    for field in SAME:
        values = {str(r.get(field)) for r in reports}
        if len(values) != 1:
            raise ValueError(f"the reports disagree on {field}: {sorted(values)}")
    found: dict[str, dict[str, Any]] = {}
    for report in reports:
        for name, variant in VARIANTS.items():
            if variant in report.get("variants", {}):
                if name in found:
                    raise ValueError(f"variant {variant} is in two reports")
                found[name] = report["variants"][variant]
    missing = sorted(set(VARIANTS) - set(found))
    if missing:
        raise ValueError(f"no report has {[VARIANTS[m] for m in missing]}")
    shapes = sorted({shape for entry in found.values() for shape in entry["by_shape"]})
    per_shape = {shape: {name: found[name]["by_shape"][shape]["output_tok_per_s_each"] for name in VARIANTS} for shape in shapes}
    medians = {shape: {name: statistics.median(values) for name, values in by_name.items()} for shape, by_name in per_shape.items()}
    targets = []
    for shape, num, den, minimum in TARGETS:
        if shape in medians:
            ratio = medians[shape][num] / medians[shape][den]
            targets.append({"shape": shape, "ratio": f"{num}/{den}", "value": round(ratio, 3), "target": minimum, "met": ratio >= minimum})
    first = reports[0]
    return {
        "device": first["device"], "vllm": first["vllm"], "torch": first["torch"], "date": first.get("date_utc"),
        "variants": VARIANTS, "shapes": per_shape, "medians": medians, "targets": targets,
        "preemptions": {shape: {name: found[name]["by_shape"][shape].get("preemptions_each") for name in VARIANTS} for shape in shapes},
        "kv_cache_tokens": {name: found[name].get("kv_cache_tokens") for name in VARIANTS},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reports", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    summary = summarize([json.loads(path.read_text()) for path in args.reports])
    args.out.write_text(json.dumps(summary, indent=1))
    for target in summary["targets"]:
        print(f"{target['shape']:5s} {target['ratio']:24s} {target['value']:.3f} (target {target['target']}): {'met' if target['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
