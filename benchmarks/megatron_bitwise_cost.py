"""What the bitwise megatron-core spec costs (GPU, TransformerEngine and vLLM importable): the
forward+backward time of a log-prob loss through the bitwise GPTModel (`build_bitwise_gpt`)
against megatron-core's TransformerEngine spec (`hf_bridge.build_megatron_gpt`, what Megatron
training runs) with the same block-FP8 recipe, and TE's spec in BF16, on the same weights. The
bitwise model is measured for an engine with a BF16 KV cache (`bitwise_fp8`: vLLM's TRITON_ATTN)
and for one with an FP8 KV cache (`bitwise_fp8_kv`: fp8_align's FP8-cache kernel, every layer's
K/V scale `KV_SCALE`), each with its FP8 linears' backward in BF16 (the default) and in block FP8
(`*_fp8_backward`: `FP8Config(bitwise_linear_backward="fp8")`, the products TE's recipe runs).

    python benchmarks/megatron_bitwise_cost.py --out REPORT.json [--shapes 8x512,8x2048] [--variant fp8_pow2|fp8]
        [--repeats 5] [--work /root/megatron_cost_work] [--profile]

The model: the Qwen3-8B shape cut to 4 decoder layers (`on_policy_bitwise.prepare_model`). Per shape
B x S (B sequences of S random tokens): the loss is the sum of the log-probs of tokens 1..S-1 of
every sequence, FP32 log-softmax of FP32 logits, then backward. The bitwise model scores them with
`token_logprobs` (THD packing, output layer on those positions only); TE's takes a [B, S] batch,
casts its BF16 logits to FP32 and takes `torch.log_softmax`. `--variant fp8_pow2` (TE's default
power-of-two scales; the bitwise engine's `use_*_pow2_scale`) or `fp8` (FP32 scales: run with
NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 set for TE, which this script checks). Per model and shape:
2 warm-up steps, then the median and spread of `--repeats` timed steps (CUDA synchronized), and
peak GPU memory. Ratios: each bitwise model over TE FP8 (the issue's target: at most 1.1x), the BF16-cache one over TE BF16.
`--profile`: per model and shape also one step under torch.profiler: its wall time, the summed
GPU time of its kernels, and the kernels by self GPU time (`profile` in each model's entry).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `benchmarks.*`

import torch  # noqa: E402

from benchmarks.on_policy_bitwise import VARIANTS, _device_and_versions, prepare_model  # noqa: E402
from fp8_align import FP8Config  # noqa: E402
from fp8_align.megatron_ext.te_emulation import TE_FP32_SCALES_ENV_VAR  # noqa: E402

MODEL = "qwen3-8b-4l"
#: Every layer's K and V scale of the FP8-KV bitwise model (any valid scale: the time does not depend on it).
KV_SCALE = 0.05
WARMUP = 2


def timed(step: Callable[[], torch.Tensor], repeats: int, parameters: list[torch.nn.Parameter]) -> dict[str, float]:
    """Median / min / max seconds of `step()` + its backward over `repeats` runs after `WARMUP` (CUDA
    synchronized between the two: also the forward's median), and peak memory."""
    times, forward_times = [], []
    torch.cuda.reset_peak_memory_stats()
    for run in range(WARMUP + repeats):
        for p in parameters:
            p.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        forward_end = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        if run >= WARMUP:
            times.append(time.perf_counter() - start)
            forward_times.append(forward_end - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "forward_median_s": statistics.median(forward_times), "peak_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip


PROFILE_ROWS = 30


def profiled(step: Callable[[], torch.Tensor], parameters: list[torch.nn.Parameter]) -> dict[str, Any]:
    """One step of `step()` + backward under torch.profiler: wall seconds, summed kernel seconds
    (GPU busy time if kernels do not overlap) and the `PROFILE_ROWS` kernels of most self GPU time."""
    from torch.profiler import ProfilerActivity, profile

    for p in parameters:
        p.grad = None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step().backward()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return {"wall_s": wall, "kernel_s": sum(e.self_device_time_total for e in kernels) / 1e6,
            "kernels": [{"name": e.key[:160], "count": e.count, "self_ms": e.self_device_time_total / 1e3} for e in kernels[:PROFILE_ROWS]]}  # fmt: skip


def te_logprob_loss(gpt: Any, ids: torch.Tensor) -> torch.Tensor:
    """Sum of log p(token t | prefix) for t = 1..S-1 of each row of `ids` [B, S] through a TE GPTModel."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    logits = gpt(ids, positions, None)[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).sum()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="8x512,8x2048", help="B x S per measurement")
    parser.add_argument("--variant", choices=("fp8_pow2", "fp8"), default="fp8_pow2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fp8_align_megatron_cost"))
    parser.add_argument("--profile", action="store_true", help="also one profiled step per model and shape")
    args = parser.parse_args(argv)
    fp32_env = os.environ.get(TE_FP32_SCALES_ENV_VAR) == "1"
    if fp32_env != (args.variant == "fp8"):
        parser.error(f"--variant {args.variant}: TE's scales follow {TE_FP32_SCALES_ENV_VAR} (set it to 1 for fp8, unset for fp8_pow2)")
    from transformers import AutoModelForCausalLM

    from fp8_align.megatron_ext.bitwise import build_bitwise_gpt, token_logprobs
    from fp8_align.megatron_ext.hf_bridge import build_megatron_gpt

    args.work.mkdir(parents=True, exist_ok=True)
    path, _, _ = prepare_model(MODEL, args.work)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
    recipe = VARIANTS[args.variant]
    layers = hf.config.num_hidden_layers
    kv_scales = {layer: {"k_scale": KV_SCALE, "v_scale": KV_SCALE} for layer in range(layers)}
    models = {
        "bitwise_fp8": build_bitwise_gpt(hf, FP8Config(on_policy="bitwise", **recipe)),
        "bitwise_fp8_kv": build_bitwise_gpt(hf, FP8Config(on_policy="bitwise", kv_cache_dtype="fp8", **recipe), kv_scales=kv_scales),
        "bitwise_fp8_fp8_backward": build_bitwise_gpt(hf, FP8Config(on_policy="bitwise", bitwise_linear_backward="fp8", **recipe)),
        "bitwise_fp8_kv_fp8_backward": build_bitwise_gpt(
            hf, FP8Config(on_policy="bitwise", kv_cache_dtype="fp8", bitwise_linear_backward="fp8", **recipe), kv_scales=kv_scales
        ),
        "te_fp8": build_megatron_gpt(hf, FP8Config(**recipe)).train(),
        "te_bf16": build_megatron_gpt(hf, None).train(),
    }
    vocab = hf.config.vocab_size
    del hf
    rows = []
    for shape in args.shapes.split(","):
        batch, length = (int(x) for x in shape.split("x"))
        ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(batch * length)).cuda()
        sequences = ids.tolist()
        row: dict[str, Any] = {"model": MODEL, "variant": args.variant, "batch": batch, "tokens_per_sequence": length}
        for name, gpt in models.items():
            if name.startswith("bitwise"):
                step = lambda gpt=gpt: torch.cat(token_logprobs(gpt, sequences, [1] * batch)).sum()  # noqa: E731
            else:
                step = lambda gpt=gpt: te_logprob_loss(gpt, ids)  # noqa: E731
            try:
                row[name] = timed(step, args.repeats, list(gpt.parameters()))
                if args.profile:
                    row[name]["profile"] = profiled(step, list(gpt.parameters()))
            except Exception as error:  # noqa: BLE001  (a model that fails is a result; the others still run)
                row[name] = {"error": repr(error)[:500]}
        for name in ("bitwise_fp8", "bitwise_fp8_kv", "bitwise_fp8_fp8_backward", "bitwise_fp8_kv_fp8_backward"):
            if "median_s" in row[name] and "median_s" in row["te_fp8"]:
                row[f"{name}_over_te_fp8"] = row[name]["median_s"] / row["te_fp8"]["median_s"]
        if "median_s" in row["bitwise_fp8"] and "median_s" in row["te_bf16"]:
            row["bitwise_over_te_bf16"] = row["bitwise_fp8"]["median_s"] / row["te_bf16"]["median_s"]
        rows.append(row)
        print(json.dumps({k: ({m: v for m, v in x.items() if m != "profile"} if isinstance(x, dict) else x) for k, x in row.items()}), flush=True)
    import megatron.core
    import transformer_engine

    report = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), **_device_and_versions(),
              "megatron_core": megatron.core.__version__, "transformer_engine": transformer_engine.__version__, "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
