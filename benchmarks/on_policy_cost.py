"""What `on_policy="bitwise"` costs (GPU): rollout throughput and trainer forward+backward time.

    python benchmarks/on_policy_cost.py --out benchmarks/results/on_policy_cost.json
        [--parts rollout,trainer] [--shapes short,long] [--variants bf16,fp8_fast,fp8_bitwise]

Rollout: a random Qwen3-8B-shaped model (dummy weights), every variant in its own process, one
timed `generate` of the shape's prompts (token ids) after a warm-up: short = 256 x (256 in, 512
out), long = 512 x (512 in, 2048 out); output tokens per second. Variants: bf16 (vLLM's default
BF16 engine), fp8_fast (fp8_align's default recipe with CUTLASS GEMMs, `use_deep_gemm=False`, no
JIT compile at start), fp8_bitwise (`FP8Config(on_policy="bitwise")`), bf16_bitwise
(`FP8Config(on_policy="bitwise", precision="bf16")`).
Trainer: forward + backward of the summed token log-probs of 8 sequences x `--trainer-lengths`
tokens (default 512 and 2048) on the Qwen3-8B shape cut to 4 decoder layers: HF's BF16 model,
BitwiseForward (bf16 and fp8, built once outside the timed steps, as a trainer builds it), and the
pure-torch FP8 emulation (`apply_fp8_training(forward_kernel="emulation")`, at the first length
only); median of 3 after a warm-up.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "hidden_act": "silu",
}  # fmt: skip
SHAPES = {"short": (256, 256, 512), "long": (512, 512, 2048)}
ROLLOUT_VARIANTS: dict[str, dict[str, Any] | None] = {
    "bf16": None,
    "fp8_fast": {"use_deep_gemm": False},
    "fp8_bitwise": {"on_policy": "bitwise"},
    "bf16_bitwise": {"on_policy": "bitwise", "precision": "bf16"},
}


def rollout_one(variant: str, shape: str, work: Path) -> dict[str, Any]:
    """One engine for `variant`, one warm-up and one timed generate of `shape`."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align import FP8Config
    from fp8_align.vllm_plugin import engine_kwargs

    model = work / "qwen3-8b-config"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    fields = ROLLOUT_VARIANTS[variant]
    kwargs = {} if fields is None else engine_kwargs(FP8Config(**fields))
    prompts_n, prompt_len, out_len = SHAPES[shape]
    start = time.perf_counter()
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, max_num_seqs=prompts_n,
              max_model_len=prompt_len + out_len + 16, gpu_memory_utilization=0.9, seed=0, **kwargs)  # fmt: skip
    start_s = time.perf_counter() - start
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 100000) for _ in range(prompt_len)]) for _ in range(prompts_n)]
    params = SamplingParams(temperature=1.0, max_tokens=out_len, ignore_eos=True, detokenize=False, seed=0)
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"variant": variant, "shape": shape, "output_tokens": tokens, "seconds": round(seconds, 2),
            "output_tok_per_s": round(tokens / seconds, 1), "engine_start_s": round(start_s, 1)}  # fmt: skip


def trainer_times(lengths: tuple[int, ...] = (512, 2048), repeats: int = 3, profile_dir: Path | None = None) -> list[dict[str, Any]]:
    """Forward + backward seconds per trainer variant on the 4-layer Qwen3-8B shape, 8 sequences of
    each of `lengths` tokens; with `profile_dir`, one more profiled step per variant at the first
    length writes its CUDA-time and host-time tables there."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8_align import FP8Config
    from fp8_align.hf_training import BitwiseForward, apply_fp8_training

    config = Qwen3Config(**{k: v for k, v in QWEN3_8B.items() if k not in ("architectures", "model_type", "torch_dtype")})
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    emulated = copy.deepcopy(model)
    apply_fp8_training(emulated, FP8Config(), forward_kernel="emulation")
    # built once, as a trainer builds them (RoPE table, kernel choice); each step is token_logprobs + backward
    bitwise_bf16 = BitwiseForward(model, FP8Config(on_policy="bitwise", precision="bf16"))
    bitwise_fp8 = BitwiseForward(model, FP8Config(on_policy="bitwise"))
    rows = []
    for length in lengths:
        sequences = [torch.randint(1000, 100000, (length,)).tolist() for _ in range(8)]
        prompt_lens = [64] * len(sequences)
        ids = torch.tensor(sequences, device="cuda")

        def hf_loss(m: torch.nn.Module, ids: torch.Tensor = ids) -> torch.Tensor:
            logprobs = m(ids).logits[:, 63:-1].float().log_softmax(-1)
            return logprobs.gather(-1, ids[:, 64:, None]).sum()

        runs = {
            "hf_bf16": lambda: hf_loss(model),
            "bitwise_bf16": lambda: torch.cat(bitwise_bf16.token_logprobs(sequences, prompt_lens)).sum(),
            "bitwise_fp8": lambda: torch.cat(bitwise_fp8.token_logprobs(sequences, prompt_lens)).sum(),
        }
        if length == lengths[0]:
            runs["emulation_fp8"] = lambda: hf_loss(emulated)
        for name, loss_fn in runs.items():
            times = []
            for i in range(repeats + 1):
                model.zero_grad(set_to_none=True)
                emulated.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                start = time.perf_counter()
                loss_fn().backward()
                torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - start)
            rows.append({"trainer": name, "tokens": 8 * length, "sequence_length": length, "median_s": round(statistics.median(times), 4),
                         "times_s": [round(t, 4) for t in times]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            if profile_dir is not None and length == lengths[0]:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
                    loss_fn().backward()
                    torch.cuda.synchronize()
                table = prof.key_averages()
                (profile_dir / f"trainer_{name}.txt").write_text(
                    table.table(sort_by="self_cuda_time_total", row_limit=45) + "\n\nBy host time:\n" + table.table(sort_by="self_cpu_time_total", row_limit=30)
                )
        del runs
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="rollout,trainer")
    parser.add_argument("--shapes", default="short")
    parser.add_argument("--variants", default="bf16,fp8_fast,fp8_bitwise")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fp8_align_cost"))
    parser.add_argument("--profile-trainer", type=Path, help="write each trainer variant's profiler table into this folder")
    parser.add_argument("--trainer-lengths", default="512,2048", help="tokens per sequence of the trainer steps (8 sequences each)")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "SHAPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.one:
        args.out.write_text(json.dumps(rollout_one(*args.one, args.work)))
        return 0
    import torch
    import vllm

    report: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), "device": torch.cuda.get_device_name(0),
                              "torch": torch.__version__, "vllm": vllm.__version__, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "rollout": [], "trainer": [], "failures": []}  # fmt: skip
    if "trainer" in args.parts:
        if args.profile_trainer:
            args.profile_trainer.mkdir(parents=True, exist_ok=True)
        report["trainer"] = trainer_times(tuple(int(n) for n in args.trainer_lengths.split(",")), profile_dir=args.profile_trainer)
        args.out.write_text(json.dumps(report, indent=1))
    if "rollout" in args.parts:
        for shape in args.shapes.split(","):
            for variant in args.variants.split(","):
                part, log = args.work / f"{variant}_{shape}.json", args.work / f"{variant}_{shape}.log"
                part.unlink(missing_ok=True)
                env = {k: v for k, v in os.environ.items() if k != "VLLM_BATCH_INVARIANT"}
                with log.open("w") as handle:
                    code = subprocess.run([sys.executable, __file__, "--out", str(part), "--one", variant, shape, "--work", str(args.work)],
                                          stdout=handle, stderr=subprocess.STDOUT, env=env).returncode  # fmt: skip
                if code or not part.is_file():
                    report["failures"].append({"variant": variant, "shape": shape, "returncode": code, "log_tail": log.read_text()[-3000:]})
                    print(f"FAILED {variant}/{shape} rc {code}", flush=True)
                    continue
                report["rollout"].append(json.loads(part.read_text()))
                print(json.dumps(report["rollout"][-1]), flush=True)
                args.out.write_text(json.dumps(report, indent=1))
    args.out.write_text(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
