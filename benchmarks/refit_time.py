"""Weight refit time of an 8B model: fp8_align (push + re-quantize) vs pushing into a BF16 engine.

    python benchmarks/refit_time.py --results DIR [--repeats 5] [--variants bf16,fp8_align,fp8_align_load_weights]

The trainer side holds the new weights as CUDA tensors by Hugging Face name (the Qwen3-8B-shaped
random checkpoint of rollout_throughput.py, loaded onto the GPU and scaled by 1.01, so every
value changes). Both engines get them over the same transport, CUDA IPC handles through
`collective_rpc` (`fp8_align.vllm_plugin.refit.share_cuda_tensors`), so the two timings differ
only in what the worker does with them:

    bf16       LLM(BF16 checkpoint); worker: `model.load_weights(tensors)` (vLLM's own loader,
               what RL frameworks call to refit a BF16 engine), then `llm.reset_prefix_cache()`
    fp8_align  LLM(BF16 checkpoint, quantization="fp8_align"); `refit_weights(llm, tensors)`:
               validation (names, shapes, dtypes, finiteness) of all 399 tensors, then the
               Triton re-quantization of the 252 projection weights straight into the FP8
               storage, overlapped by the model's `load_weights` for embeddings, norms and lm_head
    fp8_align_load_weights
               the same fp8_align engine, pushed exactly as the bf16 baseline: the model's own
               `load_weights(tensors)` (what RL stacks call; fp8_align validates the call and
               re-quantizes each shard as it arrives, `vllm_plugin.weight_sync`)

Each engine runs in its own process (enforce_eager: CUDA graphs do not change refit time; the
in-place refit keeps them valid, tests/test_gpu_refit.py). After one untimed push, `--repeats`
timed pushes, each the wall time of the trainer-side call (it returns after the workers' GPU
work is done), with the worker's time per phase (bf16: receive, load, release; fp8_align:
receive, validate, write, release) and, separately, the trainer-side time to produce the IPC
handles. Median and spread
go to DIR/refit_time.json with the ratio fp8_align / bf16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `benchmarks.*`

from benchmarks.rollout.checkpoints import QWEN3_8B, ensure_bf16_checkpoint  # noqa: E402
from benchmarks.rollout.report import device_and_versions  # noqa: E402

VARIANTS = ("bf16", "fp8_align", "fp8_align_load_weights")


def _load_bf16_in_worker(worker: Any, handles: bytes) -> dict[str, float]:
    """Worker side of the BF16 baseline: vLLM's `load_weights` of the shared tensors; seconds per
    phase, split like `RefitResult.phase_seconds` (receive, load, release)."""
    import torch

    from fp8_align.vllm_plugin.refit.push import PhaseClock
    from fp8_align.vllm_plugin.refit.transport import open_cuda_tensors

    clock = PhaseClock()
    tensors = open_cuda_tensors(handles)
    clock.lap("receive")
    with torch.no_grad():
        worker.get_model().load_weights(iter(tensors.items()))
    clock.lap("load")
    del tensors
    clock.lap("release")
    return clock.phases


def run_engine(variant: str, model: str, repeats: int) -> dict[str, Any]:
    """Start one engine, push the scaled checkpoint `repeats + 1` times; timings (worker process)."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align.config import FP8Config
    from fp8_align.vllm_plugin import engine_kwargs
    from fp8_align.vllm_plugin.refit import refit_weights, share_cuda_tensors

    # by module name, not __main__: vLLM pickles the function for its worker process, which
    # imports it from there (the repository root is on PYTHONPATH on the GPU box)
    from benchmarks.refit_time import _load_bf16_in_worker as bf16_load

    kwargs: dict[str, Any] = dict(
        model=model, skip_tokenizer_init=True, dtype="bfloat16", seed=0, gpu_memory_utilization=0.45,
        max_model_len=1024, enforce_eager=True,
    )  # fmt: skip
    if variant.startswith("fp8_align"):
        kwargs.update(engine_kwargs(FP8Config(use_deep_gemm=False)))
    start = time.perf_counter()
    llm = LLM(**kwargs)
    engine_start_s = time.perf_counter() - start

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(model).glob("*.safetensors")):
        for name, tensor in load_file(shard, device="cuda").items():
            weights[name] = tensor * 1.01
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())

    phases: list[dict[str, float]] = []

    def push() -> tuple[float, float]:
        start = time.perf_counter()
        if variant == "fp8_align":
            worker_phases = refit_weights(llm, weights)[0].phase_seconds
        else:
            worker_phases = llm.collective_rpc(bf16_load, args=(share_cuda_tensors(weights),))[0]
            llm.reset_prefix_cache()  # cached KV came from the old weights (refit_weights does this too)
        wall = time.perf_counter() - start
        phases.append(worker_phases)
        return wall, sum(worker_phases.values())

    push()  # untimed: first IPC mappings, Triton compile
    phases.clear()
    timings = [push() for _ in range(repeats)]
    # trainer side alone: producing the CUDA IPC handles (part of both variants' wall time)
    share_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        share_cuda_tensors(weights)
        share_s.append(time.perf_counter() - start)
    walls = [wall for wall, _ in timings]
    prompt = TokensPrompt(prompt_token_ids=list(range(100, 164)))
    out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    if len(out.token_ids) != 8:
        raise RuntimeError("the engine did not generate after the refits")
    return {
        "engine_start_s": engine_start_s,
        "tensors_pushed": len(weights),
        "bytes_pushed": weight_bytes,
        "push_wall_s": walls,
        "push_worker_s": [worker for _, worker in timings],
        "push_worker_phases_s": phases,
        "push_worker_phase_median_s": {key: statistics.median(p[key] for p in phases) for key in phases[0]},
        "trainer_share_cuda_tensors_s": share_s,
        "push_wall_median_s": statistics.median(walls),
        "push_wall_min_s": min(walls),
        "push_wall_max_s": max(walls),
        "effective_GBps": weight_bytes / statistics.median(walls) / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", type=Path, default=Path("/root/models"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    parser.add_argument("--worker", nargs=3, metavar=("VARIANT", "MODEL", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        variant, model, result_path = args.worker
        Path(result_path).write_text(json.dumps(run_engine(variant, model, args.repeats)))
        return 0

    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    bf16_dir = args.models / "qwen3_8b_random_bf16"
    args.results.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **device_and_versions(),
        "model": {"config": QWEN3_8B, "init": "random, bf16, torch.manual_seed(0); pushed values x1.01"},
        "transport": "CUDA IPC handles via collective_rpc (same for both variants)",
        "create_bf16_checkpoint_s": ensure_bf16_checkpoint(bf16_dir),
        "variants": {},
    }
    failed = []
    for variant in variants:
        result_path, log_path = Path(f"/tmp/refit_{variant}.json"), args.results / f"refit_time_{variant}.log"
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [sys.executable, __file__, "--repeats", str(args.repeats), "--worker", variant, str(bf16_dir), str(result_path)],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        if proc.returncode != 0:
            report["variants"][variant] = {"error": log_path.read_text(errors="replace")[-4000:]}
            failed.append(variant)
        else:
            report["variants"][variant] = json.loads(result_path.read_text())
            log_path.unlink()
        print(json.dumps({variant: report["variants"][variant]})[:2000], flush=True)
    bf16 = report["variants"].get("bf16", {})
    for variant in variants:
        result = report["variants"][variant]
        if variant != "bf16" and "push_wall_median_s" in result and "push_wall_median_s" in bf16:
            report[f"{variant}_over_bf16_median"] = result["push_wall_median_s"] / bf16["push_wall_median_s"]
            print(f"refit {variant} {result['push_wall_median_s']:.3f} s vs bf16 {bf16['push_wall_median_s']:.3f} s: "
                  f"{report[f'{variant}_over_bf16_median']:.3f}x")  # fmt: skip
    (args.results / "refit_time.json").write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
