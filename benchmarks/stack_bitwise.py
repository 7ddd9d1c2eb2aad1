"""Bitwise inside a stack's own trainer code (GPU): verl 0.9.1's or OpenRLHF 0.11.2's actor, NeMo
RL's DTensor policy, TRL 1.16.0's GRPOTrainer or a megatron-core trainer against an fp8_align
bitwise engine, with the stack's own weight sync between its policy steps.

    python benchmarks/stack_bitwise.py --out REPORT.json [--stack verl|openrlhf|nemo_rl|trl|megatron]
        [--model qwen3-8b-4l|qwen3-30b-a3b-4l|qwen3-moe-tiny]
        [--variants fp8,fp8_pow2] [--kv-cache-dtype fp8|auto] [--steps 3] [--temperatures 0.6,1.0]
        [--batch-size 64] [--max-tokens 64] [--lr 1e-3] [--linear-backward bf16|fp8] [--work /root/stack_bitwise_work]
    python benchmarks/stack_bitwise.py --out benchmarks/results/stack_bitwise.json --collect REPORT.json...

Per variant one process: a random-init Qwen3-8B shape cut to 4 layers, or with `--model` a Qwen3-MoE
one (`on_policy_bitwise.prepare_model`; not with TRL), one `FP8Config(on_policy="bitwise")` engine on GPU 0 that
returns the stack's `logprobs_mode` and runs the stack's own worker extension; with an FP8 KV cache
its scales are calibrated once by the engine and given to the trainer. The trainer is the model
converted by `make_bitwise` with the stack's log-prob function patched (`patch_stack_logprobs`):
- verl: `benchmarks/verl_scorer.VerlActorScorer` (its compute_log_prob and update_policy units),
  `processed_logprobs`, verl's sync (`BucketedWeightSender` over CUDA IPC into the workers'
  `update_weights_from_ipc`);
- openrlhf: `benchmarks/openrlhf_scorer.OpenRLHFActorScorer` (its `Actor` on packed samples and its
  `PolicyLoss`), vLLM's default `raw_logprobs`, temperature 1 only, OpenRLHF's sync (its trainer's
  per-tensor CUDA-IPC handles into the workers' `update_weight_cuda_ipc`);
- nemo_rl: `benchmarks/nemo_rl_scorer.NemoRLPolicyScorer` (its DTensor policy's packed log-prob and
  train units, vendored at 7ea279a), `processed_logprobs` (its GRPO configs' setting), NeMo RL's
  refit (its trainer's `stream_weights_via_ipc_zmq_impl`, CUDA IPC over ZMQ, into its worker
  extension's `update_weights_via_ipc_zmq`; weights only, so the engine keeps the K/V scales the
  trainer scores with). Needs NeMo RL's pins first on PYTHONPATH (`.cache/nemo_rl_site`, the box's
  `nemo_rl` stage): NeMo RL refuses transformers >= 5.12.
- trl: `benchmarks/trl_scorer.TrlGRPOScorer` (its GRPOTrainer's log-prob unit and GRPO loss) in TRL's
  colocate mode: TRL builds the engine itself (`patch_trl_engine(cfg)`, `processed_logprobs`, in
  this process) and syncs it with its own `sync_weights` (one `load_weights` per parameter). One
  temperature (TRL fixes it at construction) and a BF16 KV cache; the checkpoint gets a word-level
  tokenizer of its vocabulary (TRL and its engine load one). No unpatched probe: TRL installs its
  head at construction, so undoing the patch afterwards changes nothing (tests/trl_checks.py
  compares TRL's own head on CPU). `--variants fast,trl_bf16` (TRL only; beside a bitwise variant, e.g.
  `fp8,fast,trl_bf16`): TRL builds the fast mode's engine (`patch_trl_engine(FP8Config())`) or its own
  BF16 one, against TRL's own unconverted trainer and head: the mismatch TRL's importance-sampling
  correction would correct (off here too), each row's `engine` says which.
- megatron: `benchmarks/megatron_scorer.MegatronBitwiseActor`, the bitwise megatron-core GPTModel
  (`fp8_align.megatron_ext.bitwise`) under megatron-core's own DDP and optimizer,
  `processed_logprobs`, the weights synced as HF tensors by fp8_align's `refit_weights` (no worker
  extension; nothing is patched, so no unpatched probe).

Each step: the engine samples `--batch-size` prompts at each of `--temperatures` (a seed per
request); the stack's unit scores every completion at its temperature, a row per (step,
temperature): tokens, max |engine logp - stack logp|. Then, except after the last step, one policy
update with the stack's loss (micro-batches of 8 sequences; NeMo RL packs them by its token budget;
AdamW at `--lr`) on the first temperature's batch, with the trainer's log-probs as old log-probs
(the stacks' default) and batch-normalized advantages of a fixed reward (the share of even token
ids in a completion), and the stack's sync of the new weights. `--linear-backward fp8`: the trainer's FP8
linears' backward in block FP8 (`FP8Config(bitwise_linear_backward="fp8")`; the summary rows say which).
At step 0 each row also has `unpatched_max_abs_dlogp`: the same batch through the stack's own
log-prob code, the patch undone for that one scoring; TRL's rows instead have
`bitwise_forward_max_abs_dlogp` (and its first mismatches): the batch through fp8_align's own
`BitwiseForward` on a fresh copy of the checkpoint, in TRL's process. Every row keeps its first
mismatching tokens (`first_mismatches`).
The report has those rows and one summary row per (stack, vllm, variant) with `tokens` (all steps),
`max_abs_dlogp` (the largest of any step) and `mult_prob_error` (over all steps' tokens), device and versions (the stack's and transformers').
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `benchmarks.*`

from benchmarks.on_policy_bitwise import MOE_MODELS, VARIANTS, _device_and_versions, _metrics, prepare_model  # noqa: E402
from fp8_align.config import FP8Config  # noqa: E402
from fp8_align.hf_training import make_bitwise, patch_stack_logprobs, unpatch_stack_logprobs  # noqa: E402
from fp8_align.hf_training.inputs import check_temperature  # noqa: E402
from fp8_align.vllm_plugin.engine_args import lab_switch_unless_proven  # noqa: E402

#: The models `--model` takes: the 4-layer Qwen3-8B shape (default), or a Qwen3-MoE one
#: (`on_policy_bitwise.MOE_MODELS`; the engine runs `moe_backend="triton"`).
MODELS = ("qwen3-8b-4l", *MOE_MODELS)
MAX_MODEL_LEN = 1024
#: Share of GPU memory the engine takes; the trainer (model, gradients, AdamW state) lives beside it.
GPU_MEMORY_UTILIZATION = 0.4
#: Sequences the stack's unit scores per call, and per policy-step micro-batch.
SCORE_BATCH, MICRO_BATCH = 32, 8
#: verl's colocated sync buckets (its default is 512 MiB; smaller here so that the 4-layer model takes several).
BUCKET_SIZE_MB = 256


@dataclass(frozen=True)
class Stack:
    """What differs between the stacks' runs: the engine's worker extension and log-prob mode."""

    worker_extension: str | None
    logprobs_mode: str
    temperature_one_only: bool


STACKS = {
    "verl": Stack("verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension", "processed_logprobs", False),
    "openrlhf": Stack("openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap", "raw_logprobs", True),
    "nemo_rl": Stack("tests.nemo_rl_worker.WorkerExtension", "processed_logprobs", False),
    "trl": Stack(None, "processed_logprobs", False),
    "megatron": Stack(None, "processed_logprobs", False),
}
#: TRL's engines beside the bitwise one (`--stack trl` only): the fast mode and TRL's own BF16 engine,
#: against TRL's own trainer, for their mismatch (name -> the config patch_trl_engine takes; None: unpatched).
TRL_REFERENCE_ENGINES: dict[str, Any] = {"fast": FP8Config(), "trl_bf16": None}
#: Stacks whose own log-prob code is not re-scored unpatched at step 0 (stack_bitwise's docstring says why).
NO_UNPATCHED_PROBE = ("megatron", "trl")
#: Mismatching tokens a row keeps (`first_mismatches`): where engine and stack part, for the results log.
MISMATCHES_KEPT = 16
#: NeMo RL's refit buffer (it sizes it from free memory, NRL_REFIT_BUFFER_MEMORY_RATIO).
NEMO_RL_BUFFER_BYTES = 512 * 2**20
#: NeMo RL's `policy.max_total_sequence_length` here: the longest prompt (400) and its completion fit.
NEMO_RL_MAX_SEQUENCE = 512


def verl_sync(llm: Any, model: Any, job_id: str) -> None:
    """verl 0.9.1's colocated weight sync of `model`'s parameters into the engine: its trainer-side
    `BucketedWeightSender` (CUDA-IPC buckets over ZMQ) against the workers' own
    `update_weights_from_ipc`; raises what either side raised."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    sender = BucketedWeightSender(f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-0-rank-0.sock", bucket_size_mb=BUCKET_SIZE_MB)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            asyncio.run(sender.async_send_weights((name, p.detach()) for name, p in model.named_parameters()))
        except BaseException as error:  # raised below, in the caller
            errors.append(error)

    thread = threading.Thread(target=send)
    thread.start()
    llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": False})
    thread.join(timeout=300)
    if thread.is_alive() or errors:
        raise RuntimeError(f"verl's weight sender did not finish: {errors or 'still running after 300 s'}")


def openrlhf_sync(llm: Any, model: Any) -> None:
    """OpenRLHF 0.11.2's colocated weight sync of `model`'s parameters (its trainer's CUDA-IPC path,
    openrlhf/trainer/ray/ppo_actor.py `_handle_cuda_ipc`): per parameter a clone shared with
    `reduce_tensor`, keyed by `get_physical_gpu_id()`, into the workers' `update_weight_cuda_ipc`."""
    from openrlhf.trainer.ray.utils import get_physical_gpu_id
    from torch.multiprocessing.reductions import reduce_tensor

    params = list(model.named_parameters())
    for count, (name, param) in enumerate(params, start=1):
        weight = param.data.clone()
        handles = {get_physical_gpu_id(): reduce_tensor(weight)}
        llm.collective_rpc("update_weight_cuda_ipc", args=(name, param.dtype, param.shape, handles, count == len(params)))


def nemo_rl_sync(llm: Any, model: Any) -> None:
    """NeMo RL 7ea279a's colocated refit of `model`'s parameters (tests/nemo_rl_worker.py, as
    tests/test_gpu_nemo_rl_refit.py drives it): `prepare_refit_info`, its trainer's
    `stream_weights_via_ipc_zmq_impl` at its socket address for this GPU, its workers'
    `update_weights_via_ipc_zmq`; raises what either side raised."""
    from nemo_rl.utils.nvml import get_device_uuid

    from tests.nemo_rl_worker import start_ipc_sender, state_dict_info

    stream = [(name, p.detach()) for name, p in model.named_parameters()]
    llm.collective_rpc("prepare_refit_info", args=(state_dict_info(stream),))
    thread, errors = start_ipc_sender(f"ipc:///tmp/{get_device_uuid(0)}.sock", stream, NEMO_RL_BUFFER_BYTES)
    updated = llm.collective_rpc("update_weights_via_ipc_zmq")
    thread.join(timeout=300)
    if thread.is_alive() or errors or updated != [True]:
        raise RuntimeError(f"NeMo RL's refit did not finish: workers {updated}, trainer {errors or ('still running' if thread.is_alive() else 'done')}")


def first_mismatches(
    sequences: list[list[int]], prompt_lens: list[int], engine: list[list[float]], scored: list[Any], limit: int = MISMATCHES_KEPT
) -> list[dict[str, Any]]:  # fmt: skip
    """The first `limit` completion tokens whose engine and stack log-probs differ, in sequence order:
    {sequence, prompt_len, position (in the completion), token, engine, stack}; [] when all agree."""
    found: list[dict[str, Any]] = []
    for index, (seq, prompt_len, mine, theirs) in enumerate(zip(sequences, prompt_lens, engine, scored, strict=True)):
        for position, (a, b) in enumerate(zip(mine, theirs.tolist(), strict=True)):
            if a != b:
                found.append({"sequence": index, "prompt_len": prompt_len, "position": position, "token": seq[prompt_len + position], "engine": a, "stack": b})
                if len(found) == limit:
                    return found
    return found


def bitwise_forward_logprobs(path: Path, cfg: Any, sequences: list[list[int]], prompt_lens: list[int], temperature: float) -> list[Any]:
    """Per sequence, FP32 completion log-probs of the checkpoint at `path` through `BitwiseForward` (a
    fresh copy on GPU 0, freed after): the engine's bits by the other stacks' proofs, so a stack that
    differs from the engine where this agrees has the difference in its own code."""
    import torch
    from transformers import AutoModelForCausalLM

    from fp8_align.hf_training import BitwiseForward

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
    with torch.no_grad():
        scored = BitwiseForward(model, cfg).token_logprobs(sequences, prompt_lens, temperature=temperature)
    del model
    torch.cuda.empty_cache()
    return scored


def score(actor: Any, sequences: list[list[int]], prompt_lens: list[int], temperature: float) -> list[Any]:
    """The stack unit's completion log-probs of `sequences`, `SCORE_BATCH` sequences per call."""
    scored: list[Any] = []
    for chunk in range(0, len(sequences), SCORE_BATCH):
        part = slice(chunk, chunk + SCORE_BATCH)
        scored += actor.token_logprobs(sequences[part], prompt_lens[part], temperature)
    return scored


def stack_version(stack: str) -> str:
    """The running stack's release (NeMo RL's from its package, with the vendored commit)."""
    if stack == "megatron":
        return importlib.metadata.version("megatron-core")
    if stack == "nemo_rl":
        import nemo_rl.package_info

        return f"{nemo_rl.package_info.__shortversion__} (7ea279a)"
    return importlib.metadata.version(stack)


def advantages_of(completions: list[list[int]]) -> list[float]:
    """Batch-normalized advantages of a fixed reward: the share of even token ids per completion."""
    rewards = [sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completions]
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards]


def run_variant(stack: str, variant: str, kv_cache_dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine and the stack's actor over `args.steps` policy steps; returns the rows."""
    import torch
    import transformers
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align.vllm_plugin import calibrate_kv_scales, engine_kv_scales, engine_kwargs, refit_weights

    path, probes, fillers = prepare_model(args.model, args.work)
    prompts = (probes + fillers)[: args.batch_size]
    job_id = f"fp8align{os.getpid()}"
    os.environ["VERL_RAY_JOB_ID"] = job_id  # names verl's ZMQ socket; the engine's workers inherit it
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # calibrate_kv_scales: collective_rpc with functions
    cfg = (
        TRL_REFERENCE_ENGINES[variant] if variant in TRL_REFERENCE_ENGINES
        else FP8Config(on_policy="bitwise", kv_cache_dtype=kv_cache_dtype, bitwise_linear_backward=args.linear_backward, **VARIANTS[variant])
    )  # fmt: skip
    bitwise = cfg is not None and cfg.on_policy == "bitwise"
    actor: Any
    if stack == "trl":  # TRL builds its engine itself, around the trainer
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from benchmarks.trl_scorer import TrlGRPOScorer
        from tests.model_factory import make_tiny_tokenizer

        tokenizer = AutoTokenizer.from_pretrained(make_tiny_tokenizer(path, vocab_size=json.loads((path / "config.json").read_text())["vocab_size"]))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
        actor = TrlGRPOScorer(model, cfg, tokenizer, args.temperatures[0], colocate_engine={
            "vllm_gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "vllm_max_model_length": MAX_MODEL_LEN,
            "per_device_train_batch_size": args.batch_size})  # TRL's engine takes max_num_seqs from it  # fmt: skip
        llm = actor.engine
    else:
        llm = LLM(
            model=str(path), skip_tokenizer_init=True, max_num_seqs=args.batch_size, max_model_len=MAX_MODEL_LEN,
            gpu_memory_utilization=GPU_MEMORY_UTILIZATION, seed=0, logprobs_mode=STACKS[stack].logprobs_mode,
            **({"moe_backend": "triton"} if args.model in MOE_MODELS else {}),
            **({"worker_extension_cls": STACKS[stack].worker_extension} if STACKS[stack].worker_extension else {}), **engine_kwargs(cfg),
        )  # fmt: skip
    scales = None
    if kv_cache_dtype == "fp8":  # the trl stack runs a BF16 KV cache (main refuses fp8 for it)
        calibrate_kv_scales(llm, probes, include_q=False)
        scales = engine_kv_scales(llm)
    if stack == "verl":
        from transformers import AutoModelForCausalLM

        from benchmarks.verl_scorer import VerlActorScorer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
        make_bitwise(model, cfg, kv_scales=scales)
        patch_stack_logprobs("verl")
        actor = VerlActorScorer(model)
    elif stack == "openrlhf":
        from benchmarks.openrlhf_scorer import OpenRLHFActorScorer

        actor = OpenRLHFActorScorer(path, cfg, kv_scales=scales, device="cuda")
        model = actor.model
    elif stack == "megatron":
        from benchmarks.megatron_scorer import MegatronBitwiseActor

        actor = MegatronBitwiseActor(path, cfg, scales, "cuda", args.lr)
        model = actor.gpt
    elif stack == "nemo_rl":
        from transformers import AutoModelForCausalLM

        from benchmarks.nemo_rl_scorer import NemoRLPolicyScorer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
        make_bitwise(model, cfg, kv_scales=scales)
        eos = model.config.eos_token_id
        actor = NemoRLPolicyScorer(model, eos if isinstance(eos, int) else 0, NEMO_RL_MAX_SEQUENCE, MICRO_BATCH)
    optimizer = None if stack == "megatron" else torch.optim.AdamW(model.parameters(), lr=args.lr)  # Megatron's: the actor's own
    start = {name: p.detach().clone() for name, p in model.named_parameters() if p.dim() >= 2}  # 3-D: the fused routed experts
    rows: list[dict[str, Any]] = []
    for step in range(args.steps + 1):
        batches = []
        for t_index, temperature in enumerate(args.temperatures):
            params = [
                SamplingParams(temperature=temperature, max_tokens=args.max_tokens, logprobs=0, ignore_eos=True,
                               seed=100_000 * step + 1000 * t_index + i, detokenize=False)
                for i in range(len(prompts))
            ]  # fmt: skip
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            completions = [list(out.outputs[0].token_ids) for out in outputs]
            engine = [[s[t].logprob for s, t in zip(out.outputs[0].logprobs, c)] for out, c in zip(outputs, completions)]
            sequences = [p + c for p, c in zip(prompts, completions)]
            prompt_lens = [len(p) for p in prompts]
            scored = score(actor, sequences, prompt_lens, temperature)
            flat_engine = [x for lp in engine for x in lp]
            flat_verl = [x for lp in scored for x in lp.tolist()]
            max_abs, mult = _metrics(flat_engine, flat_verl)
            if step == 0 and stack not in NO_UNPATCHED_PROBE:  # the same batch through the stack's own log-prob code: what the patch changes
                unpatch_stack_logprobs(stack)
                unpatched = _metrics(flat_engine, [x for lp in score(actor, sequences, prompt_lens, temperature) for x in lp.tolist()])[0]
                patch_stack_logprobs(stack)
            probe = {}
            if step == 0 and stack == "trl" and bitwise:  # fp8_align's own scorer in the same process: TRL's code or the engine in its process?
                plain = bitwise_forward_logprobs(path, cfg, sequences, prompt_lens, temperature)
                probe = {"bitwise_forward_max_abs_dlogp": _metrics(flat_engine, [x for lp in plain for x in lp.tolist()])[0],
                         "bitwise_forward_first_mismatches": first_mismatches(sequences, prompt_lens, engine, plain)}  # fmt: skip
            rows.append({
                "stack": stack, "variant": variant, "engine": "bitwise" if bitwise else variant, "kv_cache_dtype": kv_cache_dtype,
                "step": step, "temperature": temperature,
                "logprobs_mode": STACKS[stack].logprobs_mode, "sequences": len(sequences), "tokens": len(flat_engine),
                "max_abs_dlogp": max_abs, "mult_prob_error": mult,
                "tokens_with_nonzero_dlogp": sum(a != b for a, b in zip(flat_engine, flat_verl)),
                "first_mismatches": first_mismatches(sequences, prompt_lens, engine, scored),
                **({"unpatched_max_abs_dlogp": unpatched} if step == 0 and stack not in NO_UNPATCHED_PROBE else {}), **probe,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            batches.append((sequences, prompt_lens, completions, scored))
        if step == args.steps:
            break
        sequences, prompt_lens, completions, scored = batches[0]
        stats = actor.policy_step(
            sequences, prompt_lens, args.temperatures[0], scored, advantages_of(completions), optimizer, micro_batch_size=MICRO_BATCH
        )
        sync_start = time.perf_counter()
        if stack == "verl":
            verl_sync(llm, model, job_id)
        elif stack == "openrlhf":
            openrlhf_sync(llm, model)
        elif stack == "megatron":
            refit_weights(llm, actor.hf_state())
        elif stack == "trl":
            actor.sync()
        else:
            nemo_rl_sync(llm, model)
        moved = sum(not torch.equal(start[name], p) for name, p in model.named_parameters() if name in start)
        rows[-1].update(policy_step=stats, sync_s=round(time.perf_counter() - sync_start, 2), matrices_moved=f"{moved}/{len(start)}")
        print(json.dumps(rows[-1]), flush=True)
    del llm
    gc.collect()
    return {"rows": rows, "kv_scales": scales, "stack_version": stack_version(stack), "transformers": transformers.__version__}


def collect(reports: list[Path]) -> dict[str, Any]:
    """One summary over several runs' reports: every summary row, with the report it came from, its
    date and `unpatched_max_abs_dlogp` (the largest of its step-0 rows). Raises ValueError for a
    report with failures or two rows for one (stack, vllm, variant, model)."""
    rows, seen = [], set()
    for path in reports:
        report = json.loads(path.read_text())
        if report["failures"]:
            raise ValueError(f"{path}: {len(report['failures'])} failed variants")
        for row in report["summary"]:
            key = (row["stack"], row["vllm"], row["variant"], row["model"])
            if key in seen:
                raise ValueError(f"{path}: a second row for {key}")
            seen.add(key)
            probes = [r["unpatched_max_abs_dlogp"] for r in report["rows"] if r["variant"] == row["variant"] and "unpatched_max_abs_dlogp" in r]
            unpatched = max(probes) if probes else None  # megatron, trl: not probed (module docstring)
            rows.append({**row, "unpatched_max_abs_dlogp": unpatched, "date_utc": report["date_utc"], "report": path.as_posix()})
    return {"summary": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report: rows per step and a summary row per variant")
    parser.add_argument("--stack", choices=sorted(STACKS), default="verl")
    parser.add_argument("--model", choices=MODELS, default=MODELS[0], help="random-init model (on_policy_bitwise.prepare_model)")
    parser.add_argument("--variants", default="fp8,fp8_pow2")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="fp8")
    parser.add_argument("--steps", type=int, default=3, help="policy steps (each followed by verl's sync and a new rollout)")
    parser.add_argument("--temperatures", default="0.6,1.0", help="sampling temperatures; the first one is trained on")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (large enough to move BF16 weights)")
    parser.add_argument("--linear-backward", choices=("bf16", "fp8"), default="bf16",
                        help="the trainer's FP8 linears' backward (FP8Config.bitwise_linear_backward)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fp8_align_stack_bitwise"))
    parser.add_argument("--collect", nargs="+", type=Path, metavar="REPORT",
                        help="write to --out only the summary rows of these reports (one per stack run), nothing run")
    parser.add_argument("--one", metavar="VARIANT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.collect:
        args.out.write_text(json.dumps(collect(args.collect), indent=1))
        return 0
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    for temperature in args.temperatures:
        try:
            check_temperature(temperature)
        except ValueError as error:
            parser.error(f"--temperatures: {error}")  # includes greedy (0): a policy step trains on samples
    if args.stack == "trl" and (len(args.temperatures) != 1 or args.kv_cache_dtype != "auto"):
        parser.error("--stack trl: one temperature (TRL fixes it at construction) and --kv-cache-dtype auto (the mode TRL's engine patch takes)")
    if args.stack == "trl" and args.model in MOE_MODELS:
        parser.error("--stack trl: a dense model (TRL builds its engine itself, without the MoE backend the bitwise MoE reads)")
    if STACKS[args.stack].temperature_one_only and args.temperatures != [1.0]:
        parser.error(f"--stack {args.stack}: --temperatures 1.0 only (docs/on_policy.md: its actor multiplies by 1/T on CUDA)")
    known = {*VARIANTS, *TRL_REFERENCE_ENGINES} if args.stack == "trl" else set(VARIANTS)
    unknown = sorted(set(args.variants.split(",")) - known)
    if unknown:
        parser.error(f"unknown variants {unknown} for --stack {args.stack}; known: {sorted(known)}")
    if args.steps < 1 or args.batch_size < 4:
        parser.error("--steps must be at least 1 and --batch-size at least 4 (the 4 probe prompts)")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.model in MOE_MODELS:  # the lab switch where no MoE proof covers the vLLM
        lab_switch_unless_proven("qwen3_moe")
    if args.one:
        args.out.write_text(json.dumps(run_variant(args.stack, args.one, args.kv_cache_dtype, args)))
        return 0
    versions = _device_and_versions()
    report: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), **versions}
    report.update(summary=[], rows=[], kv_scales={}, failures=[])
    for variant in args.variants.split(","):
        kv = args.kv_cache_dtype if VARIANTS.get(variant, {}).get("precision") == "fp8" else "auto"
        part, log = args.work / f"{args.stack}_{variant}.json", args.work / f"{args.stack}_{variant}.log"
        part.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--out", str(part), "--stack", args.stack, "--model", args.model, "--one", variant, "--kv-cache-dtype", kv, "--steps", str(args.steps),
               "--temperatures", ",".join(map(str, args.temperatures)), "--batch-size", str(args.batch_size),
               "--max-tokens", str(args.max_tokens), "--lr", str(args.lr), "--linear-backward", args.linear_backward,
               "--work", str(args.work)]  # fmt: skip
        with log.open("w") as handle:
            code = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
        if code or not part.is_file():
            report["failures"].append({"variant": variant, "returncode": code, "log_tail": log.read_text()[-3000:]})
            print(f"FAILED {variant} (rc {code}); log {log}", flush=True)
            continue
        result = json.loads(part.read_text())
        report["rows"] += result["rows"]
        report["kv_scales"][variant] = result["kv_scales"]
        report["summary"].append({
            "stack": args.stack, "vllm": versions["vllm"], "variant": variant, "kv_cache_dtype": kv, "model": args.model,
            "steps": args.steps, "linear_backward": args.linear_backward, "temperatures": args.temperatures,
            "tokens": sum(r["tokens"] for r in result["rows"]),
            "max_abs_dlogp": max(r["max_abs_dlogp"] for r in result["rows"]),
            "mult_prob_error": sum(r["mult_prob_error"] * r["tokens"] for r in result["rows"]) / sum(r["tokens"] for r in result["rows"]),
            "device": versions["device"],
            "versions": {**{k: versions[k] for k in ("torch", "cuda", "triton", "vllm")}, "transformers": result["transformers"],
                         args.stack: result["stack_version"]},
        })  # fmt: skip
        print(json.dumps(report["summary"][-1]), flush=True)
        args.out.write_text(json.dumps(report, indent=1))
    args.out.write_text(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
