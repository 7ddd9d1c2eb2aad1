"""Where a decode step's GPU time goes: BF16 vs fp8_align (+ FP8 KV, or bitwise), Qwen3-8B shape, one GPU.

    python benchmarks/decode_profile.py --results DIR [--context 1536] [--steps 20]
        [--batch bf16=140,fp8_align_kv=320]        # or fp8_align=140,fp8_bitwise=140: what bitwise costs
        [--deepgemm-cache DIR] [--model-runner v1|v2] [--attention-backend NAME]
    # the rollout's best configuration at batch 512 (issue #26):
    python benchmarks/decode_profile.py --results DIR --batch fp8_align_kv_xqa_dg=512 --deepgemm-cache /root/dg_cache --model-runner v2
    # the same on vLLM 0.25.1 (FlashInfer's XQA decodes the FP8 cache):
    python benchmarks/decode_profile.py --results DIR --batch fp8_align_kv_dg=512 --attention-backend FLASHINFER --deepgemm-cache /root/dg_cache --model-runner v2

Per variant (own process): the engine of `rollout_throughput.py` (same checkpoint and settings),
`batch` prompts of `context` random tokens each, generating 64 tokens, with vLLM's torch profiler
recording `--steps` engine steps after the prefill (all sequences decoding at about `context`
tokens of KV). The default batch sizes are what each variant's KV cache holds at the long
rollout shape's mean context (512 prompt + 1024 of 2048 generated tokens). Writes
DIR/decode_profile.json: per variant the engine start (LLM constructor wall time; with an empty
`--deepgemm-cache` it includes fp8_align's DeepGEMM fill at start), the GPU time of a decode step (sum of its kernels), output
tokens per second at that batch and step time, and the GPU time per kernel family (attention,
GEMM, activation quantization, ...) per step, from the profiler's self-CUDA-time table (saved
next to it; `kernel_families` reads it). Before profiling, the wall time of a decode step is
measured without the profiler (two generates of fresh prompts, 1 and 1 + `DECODE_TOKENS` output
tokens, the difference over `DECODE_TOKENS`); a step's wall time less its GPU time is what the GPU
waits on the host (launches, scheduling, sampling's host work): `launch_gap_ms_per_step`.

Variants whose FP8Config has use_deep_gemm run with VLLM_USE_DEEP_GEMM=1 and, given
`--deepgemm-cache`, DG_JIT_CACHE_DIR (filled by `fp8-align prepare-deepgemm`); `--model-runner`
sets VLLM_USE_V2_MODEL_RUNNER for every variant (session 15's best rollout used v2).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `benchmarks.*`

from benchmarks.rollout.checkpoints import QWEN3_8B, ensure_bf16_checkpoint  # noqa: E402
from benchmarks.rollout.report import device_and_versions  # noqa: E402

#: FP8Config fields of each variant (None: stock BF16): fp8_align's fast mode with a BF16 or FP8 KV
#: cache (CUTLASS GEMMs; FA3 decode, as profiled before XQA became the default), and `on_policy="bitwise"`.
VARIANTS: dict[str, dict[str, Any] | None] = {
    "bf16": None,
    "fp8_align": {"use_deep_gemm": False},
    "fp8_align_kv": {"use_deep_gemm": False, "kv_cache_dtype": "fp8", "kv_decode_kernel": "backend"},
    "fp8_bitwise": {"on_policy": "bitwise"},
    # bitwise over an FP8 cache (TRITON_ATTN reads E4M3 K/V with the layers' scales, BF16 queries)
    "fp8_bitwise_kv": {"on_policy": "bitwise", "kv_cache_dtype": "fp8"},
    # the best rollout configuration (session 15): DeepGEMM linears, FP8 KV cache, XQA decode
    "fp8_align_kv_xqa_dg": {"use_deep_gemm": True, "kv_cache_dtype": "fp8", "kv_decode_kernel": "xqa"},
    # the same on vLLM 0.25+, whose FLASHINFER backend decodes an FP8 cache with XQA itself
    # (with --attention-backend FLASHINFER; fp8_align's own XQA route is vLLM 0.22's)
    "fp8_align_kv_dg": {"use_deep_gemm": True, "kv_cache_dtype": "fp8", "kv_decode_kernel": "backend"},
}
#: Output tokens of the longer of the two unprofiled generates that time one decode step.
DECODE_TOKENS = 32
#: Kernel-name patterns -> family (first match wins; the rest is "other").
FAMILIES = (
    ("kv_cache_write", r"reshape_and_cache|concat_and_cache"),
    ("attention", r"flash|attn|attention|fmha|kernel_mha|xqa"),  # kernel_mha: XQA (FlashInfer)
    ("gemm", r"nvjet|gemm|cutlass|cublas|xmma|matmul|deep_gemm"),
    # Inductor's fused kernels (norms, activations, residual adds) are named after every op they
    # feed, our quantization custom op included, so they are matched before "quant".
    ("inductor_fused", r"triton_(poi|red|per)_fused"),
    ("activation_quant", r"quant"),
    ("norm_act_rope", r"rms|norm|silu|act_and_mul|rotary|rope"),
    ("sampling", r"softmax|exponential|argmax|sort|topk|sampl|distribution"),
)
#: Rows that are not kernels but wrap them (the step's annotation, aten/custom ops whose "self"
#: CUDA time repeats their kernels' time).
_WRAPPER = re.compile(r"^(execute_context|[\w.]+::\w+$|cuda[A-Z]\w*$|cu[A-Z]\w*$|Activity Buffer)")
_ROW = re.compile(r"^(?P<name>.+?)\s{2,}.*?(?P<self_cuda>[\d.]+)(?P<unit>ms|us|s)\s+[\d.]+%\s+[\d.]+(?:ms|us|s)\s+[\d.]+(?:ms|us|s)\s+(?P<calls>\d+)\s*$")


def run_engine(variant: str, model: str, batch: int, context: int, steps: int, prof_dir: str, attention_backend: str | None = None,
               gpu_memory_utilization: float = 0.85) -> dict[str, Any]:  # fmt: skip
    """Engine with the torch profiler armed for `steps` decode steps; timings (worker process)."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align.config import FP8Config
    from fp8_align.vllm_plugin import engine_kwargs

    chunk = 16384  # vLLM 0.22's max_num_batched_tokens for an offline LLM on an 80 GB GPU
    prefill_steps = math.ceil(batch * context / chunk)
    kwargs: dict[str, Any] = dict(
        model=model, skip_tokenizer_init=True, dtype="bfloat16", seed=0, gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=2560, max_num_seqs=max(batch, 16), max_num_batched_tokens=chunk,
        profiler_config={
            "profiler": "torch", "torch_profiler_dir": prof_dir, "torch_profiler_with_stack": False,
            "delay_iterations": prefill_steps + 8, "max_iterations": steps,
        },
    )  # fmt: skip
    if attention_backend is not None:
        kwargs["attention_backend"] = attention_backend
    fields = VARIANTS[variant]
    if fields is not None:
        kwargs.update(engine_kwargs(FP8Config(**fields)))
    start = time.perf_counter()
    llm = LLM(**kwargs)
    engine_start_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(0)
    prompt_sets = [[TokensPrompt(prompt_token_ids=ids) for ids in torch.randint(0, QWEN3_8B["vocab_size"], (batch, context), generator=g).tolist()]
                   for _ in range(3)]  # fresh prompts per generate: no prefix-cache hits
    prompts = prompt_sets[0]
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=1.0)
    llm.generate(prompts[:16], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm-up
    timed = []
    for prompt_set, new_tokens in ((prompt_sets[1], 1), (prompt_sets[2], 1 + DECODE_TOKENS)):
        start = time.perf_counter()
        llm.generate(prompt_set, SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=1.0), use_tqdm=False)
        timed.append(time.perf_counter() - start)
    step_wall_ms = (timed[1] - timed[0]) / DECODE_TOKENS * 1e3
    llm.start_profile()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    llm.stop_profile()
    return {"engine_kwargs": {k: v for k, v in kwargs.items() if k != "hf_overrides"}, "engine_start_s": engine_start_s, "prefill_steps": prefill_steps,
            "generate_s": generate_s, "step_wall_ms": step_wall_ms}  # fmt: skip


def _to_ms(value: str, unit: str) -> float:
    return float(value) * {"s": 1e3, "ms": 1.0, "us": 1e-3}[unit]


def kernel_families(table: str, steps: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """GPU ms per step by family, and the rows (name, self CUDA ms per step, calls per step)."""
    families = dict.fromkeys([name for name, _ in FAMILIES] + ["other"], 0.0)
    rows = []
    for line in table.splitlines():
        match = _ROW.match(line.strip())
        if not match or match["name"].startswith(("Name", "Self", "-")):
            continue
        name, ms = match["name"].strip(), _to_ms(match["self_cuda"], match["unit"]) / steps
        if ms == 0 or _WRAPPER.match(name):
            continue
        family = next((fam for fam, pattern in FAMILIES if re.search(pattern, name, re.IGNORECASE)), "other")
        families[family] += ms
        rows.append({"name": name, "family": family, "ms_per_step": ms, "calls_per_step": int(match["calls"]) / steps})
    return families, rows


def summarize(measured: dict[str, Any], table: str, batch: int, steps: int) -> dict[str, Any]:
    """One variant's report entry: the engine's measurements plus the kernel-time breakdown of `table`."""
    families, rows = kernel_families(table, steps)
    gpu_ms = sum(families.values())
    gap = {"launch_gap_ms_per_step": measured["step_wall_ms"] - gpu_ms} if "step_wall_ms" in measured else {}
    return {
        **measured, "batch": batch, "gpu_ms_per_step": gpu_ms, "tok_per_s_at_gpu_time": batch / gpu_ms * 1e3, **gap,
        "families_ms_per_step": families, "top_kernels": sorted(rows, key=lambda r: -r["ms_per_step"])[:25],
    }  # fmt: skip


def variant_env(fields: dict[str, Any] | None, deepgemm_cache: Path | None, model_runner: str | None) -> dict[str, str]:
    """Environment of one variant's engine process on top of this process's: DeepGEMM on for
    FP8Config(use_deep_gemm=True) (with its prepared JIT cache when given), else off; the model runner."""
    deep_gemm = bool(fields and fields.get("use_deep_gemm"))
    env = {"VLLM_USE_DEEP_GEMM": "1" if deep_gemm else "0"}
    if deep_gemm and deepgemm_cache is not None:
        env["DG_JIT_CACHE_DIR"] = str(deepgemm_cache)
    if model_runner is not None:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if model_runner == "v2" else "0"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1536)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", default="bf16=140,fp8_align_kv=320")
    parser.add_argument("--models", type=Path, default=Path("/root/models"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--deepgemm-cache", type=Path, default=None, help="DG_JIT_CACHE_DIR of the DeepGEMM variants")
    parser.add_argument("--model-runner", choices=("v1", "v2"), default=None, help="vLLM's model runner for every variant")
    parser.add_argument("--attention-backend", default=None, help="vLLM's attention backend for every variant (e.g. FLASHINFER)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                        help="of every engine (0.9 lets an H100's FP8 cache hold batch 512 at the default context)")  # fmt: skip
    parser.add_argument("--summarize", action="store_true",
                        help="only recompute DIR/decode_profile.json's breakdowns from the saved tables")  # fmt: skip
    parser.add_argument("--worker", nargs=4, metavar=("VARIANT", "BATCH", "PROFDIR", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    bf16_dir = args.models / "qwen3_8b_random_bf16"
    if args.worker:
        variant, batch, prof_dir, result = args.worker
        Path(result).write_text(json.dumps(run_engine(variant, str(bf16_dir), int(batch), args.context, args.steps, prof_dir, args.attention_backend,
                                                          args.gpu_memory_utilization)))  # fmt: skip
        return 0
    if args.summarize:
        path = args.results / "decode_profile.json"
        report = json.loads(path.read_text())
        for variant, entry in report["variants"].items():
            table = (args.results / f"decode_profile_{variant}" / "profiler_out_0.txt").read_text()
            measured = {k: entry[k] for k in ("engine_kwargs", "engine_start_s", "prefill_steps", "generate_s", "step_wall_ms") if k in entry}
            report["variants"][variant] = summarize(measured, table, entry["batch"], report["steps"])
        path.write_text(json.dumps(report, indent=2))
        return 0
    batches = dict(item.split("=") for item in args.batch.split(","))
    unknown = set(batches) - set(VARIANTS)
    if unknown:
        parser.error(f"--batch names {sorted(unknown)}; variants are {', '.join(VARIANTS)}")
    args.results.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **device_and_versions(), "context": args.context, "steps": args.steps,
        "model_runner": args.model_runner, "attention_backend": args.attention_backend,
        "gpu_memory_utilization": args.gpu_memory_utilization, "deepgemm_cache": str(args.deepgemm_cache) if args.deepgemm_cache else None,
        "create_bf16_checkpoint_s": ensure_bf16_checkpoint(bf16_dir), "variants": {},
    }  # fmt: skip
    for variant, batch in batches.items():
        prof_dir = args.results / f"decode_profile_{variant}"
        prof_dir.mkdir(exist_ok=True)
        result_path, log_path = Path(f"/tmp/decode_{variant}.json"), args.results / f"decode_profile_{variant}.log"
        caches = Path(f"/root/decode_profile_work/{variant}")  # cold compile caches, as the rollout's engines
        shutil.rmtree(caches, ignore_errors=True)
        env = {**os.environ, "VLLM_CACHE_ROOT": str(caches / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
               "TRITON_CACHE_DIR": str(caches / "triton"),
               **variant_env(VARIANTS[variant], args.deepgemm_cache, args.model_runner)}  # fmt: skip
        with open(log_path, "w") as log:
            cmd = [sys.executable, __file__, "--context", str(args.context), "--steps", str(args.steps), "--models", str(args.models),
                   *(["--attention-backend", args.attention_backend] if args.attention_backend else []),
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                   "--worker", variant, batch, str(prof_dir), str(result_path)]  # fmt: skip
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        table_path = prof_dir / "profiler_out_0.txt"
        if proc.returncode != 0 or not table_path.exists():
            report["variants"][variant] = {"error": log_path.read_text(errors="replace")[-3000:]}
            continue
        report["variants"][variant] = summarize(json.loads(result_path.read_text()), table_path.read_text(), int(batch), args.steps)
        print(variant, json.dumps({k: report["variants"][variant][k] for k in ("batch", "gpu_ms_per_step", "families_ms_per_step")}), flush=True)
    (args.results / "decode_profile.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
