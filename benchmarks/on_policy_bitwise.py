"""Bitwise on-policy proof (GPU): a `FP8Config(on_policy="bitwise")` engine's returned log-probs
against `fp8_align.hf_training.BitwiseForward`'s, per model, variant, sampling and batch size.

    python benchmarks/on_policy_bitwise.py --out benchmarks/results/on_policy_bitwise.json
        [--models smollm2,qwen3-8b-4l] [--variants bf16,fp8,fp8_pow2] [--kv-cache-dtypes auto,fp8]
        [--batch-sizes 1,7,64,512] [--max-tokens 96] [--work /root/bitwise_work]
        [--logprobs-mode raw_logprobs|processed_logprobs] [--temperatures 1.0[,0.6]] [--tensor-parallel-size 1|2]
        [--scorer bitwise_forward|verl|megatron|nemo_rl_megatron] [--model-runner v1|v2]

Models: SmolLM2-135M-Instruct (the trained default model, `smollm2_checkpoint()`; its chat prompts),
and a random-init Qwen3-8B-shaped model cut to 4 decoder layers (random token prompts); on request
(`MOE_MODELS`) Qwen3-30B-A3B's shape cut to 4 layers and a tiny Qwen3-MoE,
for `--out benchmarks/results/moe_bitwise.json` (`--variants fp8,fp8_pow2`: the bitwise MoE runs
block-FP8 experts). Variants:
bf16 (all linears BF16), fp8 (FP32 scales), fp8_pow2 (power-of-two weight and activation scales);
each with a BF16 KV cache (`auto`) and, for the FP8 variants, an E4M3 cache (`fp8`): its per-layer
K/V scales are calibrated by the engine on the probe prompts (`calibrate_kv_scales`) and read back
for the trainer (`engine_kv_scales`, `BitwiseForward.set_kv_scales`), as an RL step does.
Per (model, variant, KV cache) one engine (its own process): 4 probe prompts of different lengths are
generated alone (batch size 1) and together with filler prompts up to batch sizes 7, 64 and 512,
greedy and sampled at each of `--temperatures` (a fixed seed per request); every generated sequence
is then scored by BitwiseForward on the same GPU. The engine returns `--logprobs-mode` log-probs:
vLLM's default `raw_logprobs` (before the temperature: the trainer scores at 1.0) or
`processed_logprobs` (after it, as verl and NeMo RL configure it: the trainer scores at the
request's temperature, `token_logprobs(temperature=T)`). A row per (model, variant, KV cache,
sampling, temperature, batch size): tokens,
max |engine logp - trainer logp| and the token multiplicative probability error
mean(exp(|dlogp|)); per (model, variant, sampling) whether each probe's tokens and log-probs were
the same bits at every batch size.

`--tensor-parallel-size 2` (two GPUs; Qwen3-8B shape only: SmolLM2's 9 heads do not split in two)
starts each engine over both GPUs and scores with `BitwiseForward(..., tensor_parallel_size=2)` on
GPU 0; each row also gives `max_abs_dlogp_unsharded_trainer`, the same tokens scored as one GPU's
engine computes them, which shows what reproducing the ranks' partial sums is worth.

`--model-runner v2` runs the engines on vLLM's V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`), which
the bitwise engine runs only on the releases this proof covers (`engine_args.bitwise_proven`);
on another one the run sets the lab switch `FP8_ALIGN_UNPROVEN_BITWISE=v2_runner`
(`vllm_plugin.engine_args.UNPROVEN_BITWISE_ENV_VAR`) for its engines (so does an MoE model with
"qwen3_moe"), and the report records it. Every row names the runner the engine ran (`runner`).

`--scorer verl` scores with verl 0.9.1's own compute_log_prob code instead
(`benchmarks/verl_scorer.VerlActorScorer`): the HF model converted by `make_bitwise`, verl's
`logprobs_from_logits` patched by `patch_stack_logprobs("verl")`; verl must be importable; tensor
parallel size 1. `--scorer megatron` scores with the bitwise megatron-core GPTModel
(`fp8_align.megatron_ext.bitwise.build_bitwise_gpt` of the same checkpoint, `token_logprobs`);
megatron-core must be importable; with `--tensor-parallel-size 2` at Megatron tensor parallel size 2,
one process per GPU beside the engine (`benchmarks.megatron_scorer.MegatronTensorParallelScorer`).
`--scorer nemo_rl_megatron` scores that
model through NeMo RL's own Megatron-policy log-prob unit (`benchmarks/nemo_rl_megatron_scorer.py`,
`patch_stack_logprobs("nemo_rl_megatron")`; NeMo RL's pins first on the path). Each row names its scorer.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `benchmarks.*`

from benchmarks.rollout.checkpoints import QWEN3_30B_A3B  # noqa: E402

from fp8_align.config import FP8Config  # noqa: E402
from fp8_align.hf_training.inputs import check_temperature  # noqa: E402
from fp8_align.vllm_plugin.engine_args import UNPROVEN_BITWISE_ENV_VAR, V2_MODEL_RUNNER_ENV_VAR, lab_switch_unless_proven  # noqa: E402

MODELS = ("smollm2", "qwen3-8b-4l")
#: Mixture-of-Experts models (random init, random token prompts): Qwen3-30B-A3B's shape cut to 4
#: decoder layers (all 128 experts, top-8), and a tiny Qwen3-MoE (64 experts, top-4). Not in the
#: default --models (`--out benchmarks/results/moe_bitwise.json` holds their rows).
MOE_MODELS = ("qwen3-30b-a3b-4l", "qwen3-moe-tiny")
MODEL_RUNNERS = ("v1", "v2")
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {"precision": "bf16"},
    "fp8": {"precision": "fp8"},
    "fp8_pow2": {"precision": "fp8", "use_weight_pow2_scale": True, "use_activation_pow2_scale": True},
}
#: Qwen3-8B's shape with 4 of its 36 decoder layers.
QWEN3_8B_4L = {
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 4, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip
#: Qwen3-30B-A3B's shape with 4 of its 48 decoder layers, and a tiny Qwen3-MoE with 64 experts.
QWEN3_30B_A3B_4L = {key: value for key, value in QWEN3_30B_A3B.items() if key not in ("architectures", "model_type", "torch_dtype")} | {"num_hidden_layers": 4}
QWEN3_MOE_TINY = QWEN3_30B_A3B_4L | {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "moe_intermediate_size": 256,
                                     "num_experts": 64, "num_experts_per_tok": 4, "num_hidden_layers": 2, "max_window_layers": 2}  # fmt: skip
#: The random-init models (random token prompts): name -> (HF model_type, config fields).
RANDOM_MODELS = {"qwen3-8b-4l": ("qwen3", QWEN3_8B_4L), "qwen3-30b-a3b-4l": ("qwen3_moe", QWEN3_30B_A3B_4L),
                 "qwen3-moe-tiny": ("qwen3_moe", QWEN3_MOE_TINY)}  # fmt: skip
MAX_MODEL_LEN = 1024
#: Share of GPU memory the engine takes; the trainer's model lives beside it on the same GPU.
GPU_MEMORY_UTILIZATION = 0.5
#: Sequences BitwiseForward scores per call (any grouping gives the same bits).
TRAINER_BATCH = 32
#: NeMo RL's Megatron `logprob_mb_tokens` here: its `max_total_sequence_length` (512 in its Megatron
#: GRPO configs; the longest probe and its completion fit) times 4 sequences.
NEMO_RL_LOGPROB_MB_TOKENS = 2048


def prepare_model(name: str, work: Path) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(checkpoint dir, probe prompts, filler prompts) as token ids."""
    rng = random.Random(0)
    if name == "smollm2":
        from fp8_align.error_bench.prompts import default_prompts_path, read_prompt_records, tokenize_prompts
        from fp8_align.error_bench.default_model import smollm2_checkpoint

        path = smollm2_checkpoint()
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        chats = tokenize_prompts(read_prompt_records(default_prompts_path()), path, vocab)
        long_probe = [t for chat in chats[:8] for t in chat][:400]
        probes = [chats[0], chats[1], chats[2], long_probe]
        fillers = [chats[i % len(chats)][: rng.randint(8, len(chats[i % len(chats)]))] for i in range(508)]
        return path, probes, fillers
    if name in RANDOM_MODELS:
        model_type, shape = RANDOM_MODELS[name]
        path = work / name
        if not (path / "config.json").is_file():
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            torch.manual_seed(0)
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape)).to(torch.bfloat16)
            model.save_pretrained(path)
            del model
        vocab = shape["vocab_size"]

        def prompt(length: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(length)]

        return path, [prompt(n) for n in (5, 37, 130, 400)], [prompt(rng.randint(8, 300)) for _ in range(508)]
    raise ValueError(f"unknown model {name!r}; known: {MODELS + MOE_MODELS}")


def _metrics(engine: list[float], trainer: list[float]) -> tuple[float, float]:
    diffs = [abs(a - b) for a, b in zip(engine, trainer, strict=True)]
    return max(diffs, default=0.0), sum(math.exp(d) for d in diffs) / max(len(diffs), 1)


def run_one(
    model_name: str, variant: str, kv_cache_dtype: str, batch_sizes: list[int], max_tokens: int, work: Path,
    logprobs_mode: str, temperatures: list[float], tensor_parallel_size: int = 1, scorer: str = "bitwise_forward",
    extra_engine_kwargs: dict[str, Any] | None = None, attention_tiling: str = "tile64", trainer_kernels_first: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One engine and the trainer forward for (model, variant, KV-cache dtype); returns its rows.
    `extra_engine_kwargs` go to `vllm.LLM` last (e.g. {"max_num_batched_tokens": 4096}: the engine's
    scheduling under which the proof runs); `attention_tiling` is both sides'
    `FP8Config.bitwise_attention_tiling` with an FP8 KV cache. `trainer_kernels_first`: the trainer's
    CUDA kernels are loaded before the engine's arguments set VLLM_BATCH_INVARIANT, as `make_bitwise`
    does in TRL's process before TRL builds its engine (with an in-process engine, `external_launcher`)."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.utils.network_utils import get_open_port

    from fp8_align.hf_training import BitwiseForward
    from fp8_align.vllm_plugin import calibrate_kv_scales, engine_kv_scales, engine_kwargs

    path, probes, fillers = prepare_model(model_name, work)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # calibrate_kv_scales: collective_rpc with functions
    if (extra_engine_kwargs or {}).get("distributed_executor_backend") == "external_launcher":
        # the engine in this process, as TRL's colocate mode builds it: torchrun's rank 0 of 1
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(get_open_port())}.items():  # fmt: skip
            os.environ.setdefault(name, value)
    flag_before_engine = None
    if trainer_kernels_first:
        from vllm.v1.attention.ops import triton_unified_attention

        from fp8_align.hf_training.engine_ops import kernels_for

        kernels_for(torch.device("cuda"))
        flag_before_engine = triton_unified_attention.is_batch_invariant
    tiling = {"bitwise_attention_tiling": attention_tiling} if kv_cache_dtype == "fp8" else {}
    cfg = FP8Config(on_policy="bitwise", kv_cache_dtype=kv_cache_dtype, **VARIANTS[variant], **tiling)
    start = time.perf_counter()
    settings: dict[str, Any] = {
        "max_num_seqs": 512, "max_model_len": MAX_MODEL_LEN, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "seed": 0,
        # MoE: a backend whose setup keeps fp8_align's expert codes and scale grids where the bitwise block reads them
        **({"moe_backend": "triton"} if model_name in MOE_MODELS else {}),
        **(extra_engine_kwargs or {}),  # last: they replace this function's settings (e.g. TRL's max_num_seqs)
    }  # fmt: skip
    llm = LLM(
        model=str(path), skip_tokenizer_init=True, logprobs_mode=logprobs_mode,
        **engine_kwargs(cfg, tensor_parallel_size=tensor_parallel_size, **settings),
    )
    engine_start_s = time.perf_counter() - start
    runner = "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
    scales = None
    if kv_cache_dtype == "fp8":
        calibrate_kv_scales(llm, probes, include_q=False)
        scales = engine_kv_scales(llm)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    unsharded = BitwiseForward(model, cfg, kv_scales=scales) if tensor_parallel_size > 1 else None
    if scorer == "megatron" and tensor_parallel_size > 1:
        from benchmarks.megatron_scorer import MegatronTensorParallelScorer

        trainer = MegatronTensorParallelScorer(path, cfg, scales, device, size=tensor_parallel_size)
    elif scorer in ("megatron", "nemo_rl_megatron"):
        from fp8_align.megatron_ext.bitwise import build_bitwise_gpt, token_logprobs

        gpt = build_bitwise_gpt(model, cfg, kv_scales=scales)
        if scorer == "megatron":
            trainer = SimpleNamespace(token_logprobs=functools.partial(token_logprobs, gpt))  # BitwiseForward's call
        else:
            from benchmarks.nemo_rl_megatron_scorer import NemoRLMegatronScorer

            eos = model.config.eos_token_id
            trainer = NemoRLMegatronScorer(gpt, eos if isinstance(eos, int) else 0, NEMO_RL_LOGPROB_MB_TOKENS)
    elif scorer == "verl":
        from benchmarks.verl_scorer import VerlActorScorer
        from fp8_align.hf_training import make_bitwise, patch_stack_logprobs

        make_bitwise(model, cfg, kv_scales=scales)
        patch_stack_logprobs("verl")
        trainer: Any = VerlActorScorer(model)
    else:
        trainer = BitwiseForward(model, cfg, kv_scales=scales, tensor_parallel_size=tensor_parallel_size)
    rows, invariance = [], []
    for sampling, temperature in [("greedy", 0.0)] + [("sampled", t) for t in temperatures]:
        # greedy requests' processed log-probs are taken before any temperature, as raw ones are
        scored_at = temperature if logprobs_mode == "processed_logprobs" and sampling == "sampled" else 1.0
        probe_runs: list[list[tuple[list[int], list[float]]]] = []
        for size in batch_sizes:
            groups = [[p] for p in probes] if size == 1 else [probes + fillers[: size - len(probes)]]
            sequences, prompt_lens, engine_logprobs, probe_outputs = [], [], [], []
            for g, group in enumerate(groups):
                first = g if size == 1 else 0  # index of the group's first request: probe j keeps seed 1000 + j
                params = [
                    SamplingParams(
                        temperature=temperature, max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                        seed=None if sampling == "greedy" else 1000 + first + i, detokenize=False,
                    )  # fmt: skip
                    for i in range(len(group))
                ]
                outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in group], params, use_tqdm=False)
                for i, (prompt, out) in enumerate(zip(group, outputs)):
                    completion = out.outputs[0]
                    tokens = list(completion.token_ids)
                    logps = [step[t].logprob for step, t in zip(completion.logprobs, tokens)]
                    sequences.append(prompt + tokens)
                    prompt_lens.append(len(prompt))
                    engine_logprobs.append(logps)
                    if i < len(probes):
                        probe_outputs.append((tokens, logps))
            probe_runs.append(probe_outputs)
            flat_engine = [x for lp in engine_logprobs for x in lp]
            flat_trainer = _score(trainer, sequences, prompt_lens, scored_at)
            max_abs, mult = _metrics(flat_engine, flat_trainer)
            rows.append({
                "model": model_name, "variant": variant, "kv_cache_dtype": kv_cache_dtype, "sampling": sampling,
                "temperature": temperature, "logprobs_mode": logprobs_mode, "trainer_temperature": scored_at, "batch_size": size,
                "tensor_parallel_size": tensor_parallel_size, "scorer": scorer, "runner": runner,
                "attention_tiling": cfg.bitwise_attention_tiling if kv_cache_dtype == "fp8" else None, "sequences": len(sequences), "tokens": len(flat_engine), "max_abs_dlogp": max_abs, "mult_prob_error": mult,
                "tokens_with_nonzero_dlogp": sum(a != b for a, b in zip(flat_engine, flat_trainer)),
                **({"unified_attention_flag_before_engine": flag_before_engine} if trainer_kernels_first else {}),
            })  # fmt: skip
            if unsharded is not None:
                rows[-1]["max_abs_dlogp_unsharded_trainer"] = _metrics(flat_engine, _score(unsharded, sequences, prompt_lens, scored_at))[0]
            print(json.dumps(rows[-1]), flush=True)
        invariance.append({
            "model": model_name, "variant": variant, "kv_cache_dtype": kv_cache_dtype, "sampling": sampling,
            "temperature": temperature, "logprobs_mode": logprobs_mode, "batch_sizes": batch_sizes, "runner": runner,
            "probe_tokens_equal": all(run[i][0] == probe_runs[0][i][0] for run in probe_runs for i in range(len(probes))),
            "probe_logprobs_equal": all(run[i][1] == probe_runs[0][i][1] for run in probe_runs for i in range(len(probes))),
        })  # fmt: skip
        print(json.dumps(invariance[-1]), flush=True)
    if hasattr(trainer, "close"):
        trainer.close()
    del llm
    gc.collect()
    name = f"{model_name}/{variant}/{kv_cache_dtype}"
    return {"rows": rows, "invariance": invariance, "engine_start_s": {name: round(engine_start_s, 1)}, "kv_scales": {name: scales}}


def _score(trainer: Any, sequences: list[list[int]], prompt_lens: list[int], temperature: float) -> list[float]:
    """`trainer.token_logprobs` of every sequence's completion, `TRAINER_BATCH` sequences a call, flattened."""
    import torch

    scored: list[float] = []
    with torch.no_grad():
        for chunk in range(0, len(sequences), TRAINER_BATCH):
            part = slice(chunk, chunk + TRAINER_BATCH)
            scored += [x for lp in trainer.token_logprobs(sequences[part], prompt_lens[part], temperature=temperature) for x in lp.tolist()]
    return scored


def _device_and_versions() -> dict[str, str]:
    import torch
    import triton
    import vllm

    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": triton.__version__, "vllm": vllm.__version__,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report (one row per model, variant, sampling, batch size)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--kv-cache-dtypes", default="auto,fp8", help="auto (BF16) and/or fp8 (E4M3; FP8 variants only)")
    parser.add_argument("--batch-sizes", default="1,7,64,512")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fp8_align_bitwise"))
    parser.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"), default="raw_logprobs",
                        help="what the engine returns: vLLM's default raw_logprobs, or processed_logprobs (after the temperature)")
    parser.add_argument("--temperatures", default="1.0", help="sampling temperatures of the sampled rows (hf_training.inputs.check_temperature)")
    parser.add_argument("--tensor-parallel-size", type=int, choices=(1, 2), default=1,
                        help="the engine's (2: two GPUs, the trainer on GPU 0 scores each rank's share as that rank does)")
    parser.add_argument("--scorer", choices=("bitwise_forward", "verl", "megatron", "nemo_rl_megatron"), default="bitwise_forward",
                        help="the trainer side: BitwiseForward, verl 0.9.1's compute_log_prob on the converted model, the bitwise "
                             "megatron-core GPTModel, or NeMo RL's Megatron log-prob unit on it")
    parser.add_argument("--model-runner", choices=MODEL_RUNNERS, default="v1",
                        help="vLLM's model runner of the engines (v2 where unproven on the installed vLLM: the lab switch "
                             "FP8_ALIGN_UNPROVEN_BITWISE=v2_runner)")
    parser.add_argument("--engine-kwargs", default="{}", metavar="JSON",
                        help='vllm.LLM arguments for every engine, over this script\'s own, e.g. TRL\'s colocate engine: '
                             '\'{"max_num_batched_tokens": 4096, "max_num_seqs": 64, "distributed_executor_backend": "external_launcher"}\' '
                             '(external_launcher: the engine in the scoring process, as rank 0 of 1)')
    tiling_field = FP8Config.model_fields["bitwise_attention_tiling"]
    parser.add_argument("--attention-tiling", choices=get_args(tiling_field.annotation), default=tiling_field.default,
                        help="FP8Config.bitwise_attention_tiling of the FP8-KV-cache engines and their trainer")
    parser.add_argument("--trainer-kernels-first", action="store_true",
                        help="load the trainer's CUDA kernels before each engine, as make_bitwise does in TRL's process")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "VARIANT", "KV_CACHE_DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        extra_engine_kwargs = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as error:
        parser.error(f"--engine-kwargs: not JSON ({error})")
    if not isinstance(extra_engine_kwargs, dict):
        parser.error(f"--engine-kwargs: a JSON object of vllm.LLM arguments expected, got {args.engine_kwargs!r}")
    models = args.models.split(",")
    if args.one is None and set(models) - set(MODELS + MOE_MODELS):
        parser.error(f"unknown --models {sorted(set(models) - set(MODELS + MOE_MODELS))}; known: {', '.join(MODELS + MOE_MODELS)}")
    if set(models) & set(MOE_MODELS) and any(VARIANTS[v]["precision"] != "fp8" for v in args.variants.split(",")):
        parser.error("the MoE models run block-FP8 experts in bitwise mode: --variants fp8 and/or fp8_pow2")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    for temperature in temperatures:
        try:
            check_temperature(temperature)  # the trainer's own check, before any engine starts
        except ValueError as error:
            parser.error(f"--temperatures: {error}")
    if args.tensor_parallel_size > 1 and not args.one and "smollm2" in args.models.split(","):
        parser.error("--tensor-parallel-size 2: SmolLM2's 9 attention heads do not split over 2 ranks; use --models qwen3-8b-4l")
    if args.scorer not in ("bitwise_forward", "megatron") and args.tensor_parallel_size > 1:
        parser.error(f"--scorer {args.scorer}: tensor parallel size 1 (it scores one model, not an engine's ranks)")
    if any(b != 1 and b < 4 for b in batch_sizes):
        parser.error("batch sizes other than 1 must be at least 4 (the 4 probes share the batch)")
    args.work.mkdir(parents=True, exist_ok=True)
    # the lab switch, read by engine_kwargs and the engine's start check, here and in each --one child
    if args.model_runner == "v2":
        os.environ[V2_MODEL_RUNNER_ENV_VAR] = "1"
        lab_switch_unless_proven("v2_runner")
    if set(models) & set(MOE_MODELS):
        lab_switch_unless_proven("qwen3_moe")
    if args.one:
        result = run_one(*args.one, batch_sizes, args.max_tokens, args.work, args.logprobs_mode, temperatures, args.tensor_parallel_size, args.scorer,
                         extra_engine_kwargs, args.attention_tiling, args.trainer_kernels_first)  # fmt: skip
        args.out.write_text(json.dumps(result))
        return 0
    report: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), **_device_and_versions(),
                              "unproven_bitwise": os.environ.get(UNPROVEN_BITWISE_ENV_VAR, ""), "engine_kwargs": extra_engine_kwargs,
                              "attention_tiling": args.attention_tiling, "trainer_kernels_first": args.trainer_kernels_first}  # fmt: skip
    if args.scorer in ("megatron", "nemo_rl_megatron"):
        report["megatron_core"] = importlib.metadata.version("megatron-core")
    report.update(rows=[], invariance=[], engine_start_s={}, kv_scales={}, failures=[])
    kv_dtypes = args.kv_cache_dtypes.split(",")
    unknown = sorted(set(kv_dtypes) - {"auto", "fp8"})
    if unknown:
        parser.error(f"unknown KV-cache dtypes {unknown}; choose from auto, fp8")
    runs = [(m, v, kv) for m in models for v in args.variants.split(",") for kv in kv_dtypes
            if kv == "auto" or VARIANTS[v].get("precision") == "fp8"]  # fmt: skip
    for model, variant, kv in runs:
        part = args.work / f"{model}_{variant}_{kv}.json"
        part.unlink(missing_ok=True)
        log = args.work / f"{model}_{variant}_{kv}.log"
        cmd = [sys.executable, __file__, "--out", str(part), "--one", model, variant, kv, "--batch-sizes", args.batch_sizes,
               "--max-tokens", str(args.max_tokens), "--work", str(args.work), "--logprobs-mode", args.logprobs_mode,
               "--temperatures", args.temperatures, "--tensor-parallel-size", str(args.tensor_parallel_size), "--scorer", args.scorer,
               "--model-runner", args.model_runner, "--engine-kwargs", args.engine_kwargs, "--attention-tiling", args.attention_tiling,
               *(["--trainer-kernels-first"] if args.trainer_kernels_first else [])]  # fmt: skip
        with log.open("w") as handle:
            code = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
        if code or not part.is_file():
            report["failures"].append({"model": model, "variant": variant, "kv_cache_dtype": kv, "returncode": code,
                                       "log_tail": log.read_text()[-3000:]})  # fmt: skip
            print(f"FAILED {model}/{variant}/{kv} (rc {code}); log {log}", flush=True)
            continue
        result = json.loads(part.read_text())
        for key in ("rows", "invariance"):
            report[key] += result[key]
        for key in ("engine_start_s", "kv_scales"):
            report[key].update(result[key])
        args.out.write_text(json.dumps(report, indent=1))
        for row in result["rows"]:
            print(f"{model:12s} {variant:9s} kv={kv:4s} {row['sampling']:8s} T={row['temperature']:<4g} b={row['batch_size']:<4d} tokens={row['tokens']:<6d} "
                  f"max|dlogp|={row['max_abs_dlogp']:.3g} mult={row['mult_prob_error']:.6f}", flush=True)  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
