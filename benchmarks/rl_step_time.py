"""The time of one GRPO step (issue #39, item 7): rollout, trainer log-probs, forward+backward and
optimizer step, weight sync and K/V-scale recalibration, per variant, one GPU.

    python benchmarks/rl_step_time.py --out benchmarks/results/rl_step_time.json
        [--variants bf16,fp8_fast,fp8_bitwise_kv,bf16@v1] [--layers 8] [--prompts 64] [--group 8]
        [--prompt-tokens 512] [--max-tokens 1024] [--steps 2] [--work /root/rl_step_work]

The model is the Qwen3-8B shape cut to `--layers` decoder layers (random BF16 weights, seed 0): the
trainer keeps FP32 AdamW masters and moments (about 20 bytes a parameter), which for all 36 layers
would not fit one GPU beside the engine. Each variant runs in a process of its own: a vLLM engine
(`gpu_memory_utilization` `--engine-memory`), then the trainer (`grpo.policy.GRPOPolicy`), one
untimed warm-up step and `--steps` timed ones. A step:

- rollout: `--prompts` prompts of random token ids, `--group` samples each at T=1, every completion
  exactly `--max-tokens` long (`ignore_eos`), the sampled tokens' log-probs returned;
- trainer_logprobs: the trainer's log-probs of every sampled token (no grad);
- train: one optimizer step over the whole batch, GRPO's clipped loss with random advantages;
- weight_sync: the trainer's BF16 weights into the engine (`grpo.engine.push_weights`: the stacks'
  `load_weights` path, CUDA IPC handles; an FP8 engine re-quantizes in place);
- kv_scales (FP8 KV variants): `grpo.loop.update_kv_scales`, the trainer's calibration forward
  pushed to the engine (fp8_fast) or the engine's calibration read back by the bitwise trainer.

Variants: bf16 (BF16 engine and trainer), fp8_fast (the fast mode as `bitwise_speed.py` times it
on vLLM 0.22: `FP8Config(kv_cache_dtype="fp8", kv_decode_kernel="xqa")`, DeepGEMM on
`--deepgemm-cache`; the aligned FP8 trainer with the engine's GEMM kernels,
`apply_fp8_training(forward_kernel="engine")`), fp8_bitwise_kv
(`FP8Config(on_policy="bitwise", kv_cache_dtype="fp8")`, `BitwiseForward`). Each engine runs the
model runner vLLM picks for it, as `bitwise_speed.py`'s rollouts did; `VARIANT@v1` or `VARIANT@v2`
forces vLLM's V1 or V2 model runner (`VLLM_USE_V2_MODEL_RUNNER`), so that e.g. `bf16@v1` separates
the runner from the quantization (the bitwise engine refuses V2). Writes seconds per phase for
every timed step, their medians, and each variant's median step time and BF16's over it
(`speedup_vs_bf16`); a variant whose process fails is recorded under `failed` (exit code, the end
of its log), the others still run, and the exit code is 1. `--shape tiny` (hidden 128, vocab 512)
runs the bf16 variant on a CPU machine, to try the script before a GPU run.
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

import torch

# The repository root is on the path, here and (set in main) in vLLM's worker processes, which
# import `benchmarks.grpo.engine` to run its worker-side functions (as grpo_alignment.py does).
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from benchmarks.grpo.engine import push_weights, sample, start_engine  # noqa: E402
from benchmarks.grpo.loop import update_kv_scales  # noqa: E402
from benchmarks.grpo.policy import GRPOPolicy, pack_sequences  # noqa: E402
from benchmarks.rollout.checkpoints import QWEN3_8B, ensure_bf16_checkpoint  # noqa: E402
from fp8_align.config import FP8Config  # noqa: E402
from fp8_align.error_bench.scoring import pad_logprobs  # noqa: E402

#: Variant -> the engine's FP8Config (None: stock BF16); the trainer follows it (GRPOPolicy).
VARIANTS: dict[str, FP8Config | None] = {
    "bf16": None,
    "fp8_fast": FP8Config(kv_cache_dtype="fp8", kv_decode_kernel="xqa"),
    "fp8_bitwise_kv": FP8Config(on_policy="bitwise", kv_cache_dtype="fp8"),
}
SHAPES = {
    "qwen3-8b": QWEN3_8B,
    "tiny": dict(QWEN3_8B, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=512),
}
PHASES = ("rollout", "trainer_logprobs", "train", "weight_sync", "kv_scales")
MODEL_RUNNERS = ("v1", "v2")


def parse_variant(name: str) -> tuple[FP8Config | None, str | None]:
    """`VARIANT[@v1|@v2]` -> (the engine's FP8Config, the forced model runner or None: vLLM's choice)."""
    base, at, runner = name.partition("@")
    if base not in VARIANTS or (at and runner not in MODEL_RUNNERS):
        raise ValueError(f"unknown variant {name!r}: VARIANT[@v1|@v2], VARIANT one of {', '.join(VARIANTS)}")
    return VARIANTS[base], runner or None


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine and trainer for `variant`; a warm-up step, then `args.steps` timed steps."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with functions
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the trainer initializes CUDA in this process
    fp8, model_runner = parse_variant(variant)
    if model_runner is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if model_runner == "v2" else "0"
    deep_gemm = fp8 is not None and fp8.use_deep_gemm and fp8.on_policy == "off"
    os.environ["VLLM_USE_DEEP_GEMM"] = "1" if deep_gemm else "0"  # as rollout_throughput.py's _dg variants
    if deep_gemm and args.deepgemm_cache:
        os.environ["DG_JIT_CACHE_DIR"] = str(args.deepgemm_cache)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    checkpoint = args.work / f"{args.shape.replace('-', '_')}_{args.layers}l_random_bf16"
    ensure_bf16_checkpoint(checkpoint, dict(SHAPES[args.shape], num_hidden_layers=args.layers), device)
    seq_len = args.prompt_tokens + args.max_tokens
    llm_kwargs = {
        "max_model_len": seq_len + 1, "max_num_seqs": args.prompts * args.group, "skip_tokenizer_init": True,
        "enable_prefix_caching": False, "gpu_memory_utilization": args.engine_memory,
    }  # fmt: skip  (+1: the engine's K/V calibration runs each whole sequence as a prompt and generates one token)
    clock = time.perf_counter()
    llm = start_engine(checkpoint, fp8, 0, llm_kwargs)
    engine_start_s = time.perf_counter() - clock
    fp8_forward_kernel = "engine" if device == "cuda" else "emulation"
    policy = GRPOPolicy(checkpoint, device, fp8, lr=1e-6, max_tokens_per_forward=args.max_tokens_per_forward, fp8_forward_kernel=fp8_forward_kernel)
    gen = torch.Generator().manual_seed(1)
    vocab = int(policy.model.config.vocab_size)
    if fp8 is not None and fp8.kv_cache_dtype == "fp8":
        # the first rollout's scales (as grpo_alignment.py), calibrated on random sequences of a step's length
        calibration = torch.randint(0, vocab, (args.group, seq_len), generator=gen).tolist()
        update_kv_scales(llm, policy, pack_sequences([row[: args.prompt_tokens] for row in calibration], [row[args.prompt_tokens :] for row in calibration]))
    steps = []
    for step in range(args.steps + 1):
        prompts = torch.randint(0, vocab, (args.prompts, args.prompt_tokens), generator=gen).tolist()
        seconds: dict[str, float] = {}
        clock = time.perf_counter()
        rollouts = sample(llm, prompts, args.group, args.max_tokens, temperature=1.0, seed=step * len(prompts), ignore_eos=True)
        seconds["rollout"] = time.perf_counter() - clock
        packed = pack_sequences([prompts[r.prompt_index] for r in rollouts], [r.token_ids for r in rollouts])
        clock = time.perf_counter()
        old_logprobs = policy.all_logprobs(packed)
        seconds["trainer_logprobs"] = _synced(clock, device)
        engine_logprobs = pad_logprobs([r.logprobs for r in rollouts])[0].to(old_logprobs.device)
        advantages = torch.randn(packed.num_sequences, generator=gen)
        clock = time.perf_counter()
        policy.update(packed, advantages, old_logprobs, packed.mask.to(old_logprobs.device, torch.float32), clip_eps=0.2, num_minibatches=1)
        seconds["train"] = _synced(clock, device)
        seconds["weight_sync"] = push_weights(llm, policy.bf16_weights())
        if fp8 is not None and fp8.kv_cache_dtype == "fp8":
            clock = time.perf_counter()
            update_kv_scales(llm, policy, packed)
            seconds["kv_scales"] = _synced(clock, device)
        seconds["step"] = sum(seconds.values())
        mask = packed.mask.to(old_logprobs.device)
        max_dlogp = float(((old_logprobs - engine_logprobs).abs() * mask).max())
        steps.append({"step": step, "warm_up": step == 0, "tokens": int(mask.sum()), "engine_trainer_max_abs_dlogp": max_dlogp, "seconds": seconds})
        print(json.dumps({"variant": variant, **steps[-1]}), flush=True)
    timed = [s["seconds"] for s in steps if not s["warm_up"]]
    return {
        "engine_start_s": engine_start_s, "fp8_config": None if fp8 is None else fp8.model_dump(mode="json"),
        "model_runner": model_runner or "vllm_choice", "steps": steps,
        "median_s": {phase: statistics.median(t[phase] for t in timed) for phase in (*PHASES, "step") if phase in timed[0]},
    }  # fmt: skip


def _synced(start: float, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers kept of the shape")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens generated per sample (all of them: ignore_eos)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up step")
    parser.add_argument("--engine-memory", type=float, default=0.3, help="the engine's gpu_memory_utilization (on CPU: of the host's memory)")
    parser.add_argument("--max-tokens-per-forward", type=int, default=4096, help="trainer micro-batch size in tokens")
    parser.add_argument("--deepgemm-cache", type=Path, help="DeepGEMM JIT cache for fp8_fast (fp8-align prepare-deepgemm)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/rl_step_work"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants:
        parser.error("--variants is empty")
    for variant in variants:
        try:
            parse_variant(variant)
        except ValueError as error:
            parser.error(str(error))
    if args.layers < 1 or args.steps < 1:
        parser.error("--layers and --steps must be at least 1")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.one:  # a child process: one variant, its part of the report under --work
        (args.work / f"{args.one}.json").write_text(json.dumps(run_variant(args.one, args), indent=1))
        return 0
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
        "settings": {k: str(v) for k, v in vars(args).items() if k not in ("out", "one", "work")}, "variants": {},
    }  # fmt: skip
    failed: dict[str, dict[str, Any]] = {}
    for variant in variants:
        part, log = args.work / f"{variant}.json", args.work / f"{variant}.log"
        with open(log, "w") as handle:
            code = subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", variant],
                                  stdout=handle, stderr=subprocess.STDOUT).returncode  # fmt: skip
        if code != 0:  # recorded, and the other variants still run: one GPU session measures them all
            failed[variant] = {"exit_code": code, "log_tail": log.read_text().splitlines()[-30:]}
            print(f"{variant} failed (exit {code}); its log: {log}", flush=True)
            continue
        report["variants"][variant] = json.loads(part.read_text())
        print(f"{variant}: median step {report['variants'][variant]['median_s']['step']:.2f} s", flush=True)
    if "bf16" in report["variants"]:
        bf16 = report["variants"]["bf16"]["median_s"]["step"]
        for entry in report["variants"].values():
            entry["speedup_vs_bf16"] = bf16 / entry["median_s"]["step"]
    report["failed"] = failed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
