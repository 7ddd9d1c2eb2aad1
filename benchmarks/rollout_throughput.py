"""Rollout throughput on a Qwen3-8B-shaped random model: BF16 vs fp8_align vs vLLM's block FP8.

    python benchmarks/rollout_throughput.py --shapes short,long [--variants a,b] [--repeats short=3,long=1] --results DIR
        [--gpu-memory-utilization F] [--max-num-seqs N] [--attention-backend NAME] [--model-runner v1|v2]

Variants, each in its own process with cold compile/JIT caches (fresh VLLM_CACHE_ROOT,
TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), all on the same token-id prompts:

    bf16       LLM(model=BF16 checkpoint)
    fp8_align  LLM(model=BF16 checkpoint, quantization="fp8_align"),
               FP8Config(use_deep_gemm=False): FP32 scales, no BF16 layers, quantized on the
               fly while loading, CUTLASS block-FP8 GEMMs
    vllm_fp8   LLM(model=offline block-FP8 checkpoint): vLLM's own Fp8LinearMethod, written
               here from the same BF16 weights (`weight` e4m3 + `weight_scale_inv` FP32,
               quantization_config quant_method fp8, weight_block_size [128, 128]), with
               VLLM_USE_DEEP_GEMM=0: vLLM's CUTLASS block-FP8 kernel, FP32 scales
    fp8_align_kv   fp8_align + kv_cache_dtype="fp8": FP8 KV cache and, on Hopper with
               FlashAttention 3, FP8 attention (vLLM quantizes the query too). After the
               warm-up the K/V scales are calibrated by the engine
               (`fp8_align.vllm_plugin.kv.calibration.calibrate_kv_scales`, 8 prompts of the
               benchmark's prompt length; K and V: with an FP8 KV cache vLLM quantizes the query
               before attention, so q_scale is not calibrated) and that call is timed: the
               recalibration an RL loop runs every step, reported as a share of the timed
               rollout step.
    vllm_fp8_kv    vllm_fp8 + kv_cache_dtype="fp8" (vLLM's default scales, 1.0)

Both FP8 variants use CUTLASS so that they differ only in where the weights are quantized:
DeepGEMM JIT-compiles a kernel per M tiling at engine start (about 0.8 s per warm-up M value,
cold, on the H100 box), minutes for an 8B model, which would swamp the start-time comparison.

Per variant one engine serves every requested shape: it is sized for the largest (max_num_seqs =
most prompts, max_model_len = longest prompt + output), so each variant starts once. Engine
start (LLM constructor wall time, and vLLM's own "Model loading took" line), one warm-up
generate, then per shape (fp8_align_kv: the K/V calibration on that shape's prompts first)
`--repeats` timed generates of `batch` prompts x (`in` tokens in, `out` tokens out, ignore_eos,
temperature 1). Output tokens/s (median over repeats, each repeat kept) and the ratio to BF16
measured in the same run go to DIR/rollout_throughput_<shapes>.json.

Engine settings: gpu_memory_utilization 0.85, max_num_seqs = most prompts, vLLM's attention
backend and model runner; `--gpu-memory-utilization`, `--max-num-seqs`, `--attention-backend`
and `--model-runner v1|v2` change them for every variant of the call (results then go to a file
named after the changed settings, so ratios stay within one setting). Each variant also reports
its KV-cache capacity in tokens and vLLM's preemption count per timed generate.

The BF16 checkpoint (random init, bf16, seed 0) and the FP8 checkpoint are created under
--models on first use and reused while the machine lives.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# This folder holds `kernels.py`, which shadows the `kernels` package that transformers probes
# for (a circular import when vLLM loads transformers): take the folder off sys.path first.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

#: shape name -> (prompts, prompt tokens, generated tokens)
SHAPES = {"short": (256, 256, 512), "long": (512, 512, 2048)}
VARIANTS = ("bf16", "fp8_align", "vllm_fp8", "fp8_align_kv", "vllm_fp8_kv")
#: Prompts in the engine-side KV-scale calibration batch of `fp8_align_kv`.
CALIBRATION_PROMPTS = 8
QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
)  # fmt: skip
_FP8_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
_LOG_FIELDS = {  # vLLM 0.22 log lines -> seconds
    "model_load_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    "weights_load_s": r"Loading weights took ([\d.]+) seconds",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
}


# --------------------------------------------------------------------------- checkpoints
def ensure_bf16_checkpoint(path: Path) -> float | None:
    """Random-init Qwen3-8B-shaped model in bf16 (seed 0), saved with save_pretrained.

    Returns the seconds it took, or None when it already existed.
    """
    if (path / "config.json").exists():
        return None
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    start = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_8B, dtype="bfloat16"))
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(path, max_shard_size="4GB")
    del model
    torch.cuda.empty_cache()
    return time.perf_counter() - start


def ensure_vllm_fp8_checkpoint(bf16_path: Path, fp8_path: Path) -> float | None:
    """vLLM block-FP8 checkpoint from the BF16 one: decoder projections -> e4m3 `weight` +
    FP32 `weight_scale_inv` [ceil(N/128), ceil(K/128)] (fp8_align.quant numerics); the rest
    copied. Returns the seconds it took, or None when it already existed."""
    if (fp8_path / "config.json").exists():
        return None
    import torch
    from safetensors.torch import load_file, save_file

    from fp8_align.quant import quantize_weight_blockwise

    start = time.perf_counter()
    fp8_path.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for shard in sorted(bf16_path.glob("*.safetensors")):
        tensors = {}
        for name, tensor in load_file(shard, device="cuda").items():
            if _FP8_WEIGHT.match(name):
                codes, scale_inv = quantize_weight_blockwise(tensor)
                tensors[name] = codes.cpu()
                tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale_inv.cpu()
            else:
                tensors[name] = tensor.cpu()
        save_file(tensors, fp8_path / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
    config = json.loads((bf16_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (fp8_path / "config.json").write_text(json.dumps(config, indent=2))
    (fp8_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    for extra in bf16_path.glob("generation_config.json"):
        (fp8_path / extra.name).write_text(extra.read_text())
    torch.cuda.empty_cache()
    return time.perf_counter() - start


# --------------------------------------------------------------------------- one engine (worker)
def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, warm up, time each shape's generates; returns the measurements (worker process)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align.config import FP8Config
    from fp8_align.vllm_plugin import engine_kwargs

    shapes = spec["shapes"]
    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        gpu_memory_utilization=spec["gpu_memory_utilization"], max_model_len=max(s["prompt_len"] + s["new_tokens"] for s in shapes),
        max_num_seqs=spec["max_num_seqs"] or max(s["batch"] for s in shapes), kv_cache_dtype=spec["kv_cache_dtype"],
        disable_log_stats=False,  # for the preemption counter (llm.get_metrics)
    )  # fmt: skip
    if spec["attention_backend"]:
        kwargs["attention_backend"] = spec["attention_backend"]
    if spec["fp8_align"]:
        kwargs.update(engine_kwargs(FP8Config(use_deep_gemm=False)))
    start = time.perf_counter()
    llm = LLM(**kwargs)
    engine_start_s = time.perf_counter() - start
    cache_config = llm.llm_engine.vllm_config.cache_config
    warmup = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0)
    llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in shapes[0]["prompts"][:16]], warmup, use_tqdm=False)
    by_shape = {shape["name"]: _time_shape(llm, shape, spec["calibrate_kv"]) for shape in shapes}
    return {
        "engine_start_s": engine_start_s,
        "engine_kwargs": {k: v for k, v in kwargs.items() if k != "hf_overrides"},
        "kv_cache_tokens": cache_config.num_gpu_blocks * cache_config.block_size,
        "by_shape": by_shape,
    }


def _preemptions(llm: Any) -> int:
    """vLLM's cumulative preemption counter (a preempted request is recomputed later)."""
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def _time_shape(llm: Any, shape: dict[str, Any], calibrate_kv: bool) -> dict[str, Any]:
    """`shape["repeats"]` timed generates of the shape's prompts (after the K/V calibration when asked)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    batch, new_tokens = shape["batch"], shape["new_tokens"]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in shape["prompts"]]
    calibration: dict[str, Any] = {}
    if calibrate_kv:
        from fp8_align.vllm_plugin.kv.calibration import calibrate_kv_scales

        # K/V only: with an FP8 KV cache vLLM's GPU attention quantizes the query itself, before
        # any hook can see it, so q_scale keeps its value (see calibrate_kv_scales).
        calibrate_kv_scales(llm, shape["prompts"][:CALIBRATION_PROMPTS], include_q=False)  # untimed: first call
        start = time.perf_counter()
        result = calibrate_kv_scales(llm, shape["prompts"][:CALIBRATION_PROMPTS], include_q=False)
        calibration = {"kv_calibration_s": time.perf_counter() - start, "kv_calibration_tokens": result.tokens,
                       "kv_scales_layer0": result.scales[0]}  # fmt: skip
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=1.0)
    generate_s, preemptions = [], []
    for _ in range(shape["repeats"]):
        before = _preemptions(llm)
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        generate_s.append(time.perf_counter() - start)
        preemptions.append(_preemptions(llm) - before)
        output_tokens = sum(len(r.outputs[0].token_ids) for r in results)
        if output_tokens != batch * new_tokens:
            raise RuntimeError(f"expected {batch * new_tokens} output tokens, got {output_tokens}")
    median_s = statistics.median(generate_s)
    result = {
        "generate_s": generate_s,
        "generate_median_s": median_s,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / median_s,
        "output_tok_per_s_each": [output_tokens / s for s in generate_s],
        "preemptions_each": preemptions,
        "total_tok_per_s": (output_tokens + batch * shape["prompt_len"]) / median_s,
        **calibration,
    }
    if calibration:
        result["kv_calibration_share_of_step"] = calibration["kv_calibration_s"] / median_s
    return result


# --------------------------------------------------------------------------- driver
def _device_and_versions() -> dict[str, str]:
    import torch
    import transformers
    import triton
    import vllm

    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return {
        "device": smi,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "vllm": vllm.__version__,
    }


class VariantError(RuntimeError):
    """One variant's engine process failed; the message holds its log tail."""


def run_variant(name: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run one variant in a fresh process with cold caches; measurements + parsed log timings."""
    work.mkdir(parents=True, exist_ok=True)
    caches = work / "cache"
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(caches / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
        "VLLM_USE_DEEP_GEMM": "0",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # calibrate_kv_scales uses collective_rpc
    }
    if spec["model_runner"]:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if spec["model_runner"] == "v2" else "0"
    spec_path, result_path, log_path = work / f"{name}.spec.json", work / f"{name}.result.json", work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", str(spec_path), str(result_path)], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise VariantError(f"variant {name} failed ({proc.returncode}); log tail:\n{text[-4000:]}")
    result = json.loads(result_path.read_text())
    for field, pattern in _LOG_FIELDS.items():
        match = re.search(pattern, text)
        result[field] = float(match.group(1)) if match else None
    result["attention_backend"] = sorted(set(re.findall(r"Using (\w+) attention backend", text)))
    result["model_runner"] = "v2" if "Using V2 Model Runner" in text else "v1"
    warmups = re.findall(r"fp8_align: DeepGEMM warm-up N=\d+ K=\d+: \d+ M values in ([\d.]+) s", text)
    result["fp8_align_deepgemm_warmup_s"] = sum(map(float, warmups)) if warmups else None
    result["fp8_align_kernels"] = sorted(set(re.findall(r"fp8_align: model\.layers\.\S+ \[[^\]]*\]\] -> (\w+)", text)))
    return result


def _parse_repeats(text: str, shapes: list[str]) -> dict[str, int]:
    """Timed generates per shape from --repeats: "3" (every shape) or "short=3,long=1" (missing: 1)."""
    if "=" not in text:
        return dict.fromkeys(shapes, int(text))
    repeats = dict.fromkeys(shapes, 1)
    for item in text.split(","):
        name, _, count = item.partition("=")
        if name not in shapes:
            raise ValueError(f"--repeats names shape {name!r}, not one of {shapes}")
        repeats[name] = int(count)
    return repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="short", help=f"comma-separated, from {', '.join(SHAPES)}; one engine per variant serves all")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", default="1", help="timed generates per shape (median reported): N, or short=N,long=M")
    parser.add_argument("--attention-backend", help="vLLM attention backend for every variant (default: vLLM's choice)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--max-num-seqs", type=int, help="default: the most prompts of the requested shapes")
    parser.add_argument("--model-runner", choices=["v1", "v2"],
                        help="force vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER); default: vLLM's choice, which in "
                             "0.22 is V2 for an unquantized Qwen3 and V1 for every quantized model")  # fmt: skip
    parser.add_argument("--models", type=Path, default=Path("/root/models"))
    parser.add_argument("--work", type=Path, default=Path("/root/rollout_work"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec_path, result_path = args.worker
        Path(result_path).write_text(json.dumps(run_engine(json.loads(Path(spec_path).read_text()))))
        return 0

    import torch

    shape_names = args.shapes.split(",")
    for name in shape_names:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    for name in args.variants.split(","):
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    try:
        repeats = _parse_repeats(args.repeats, shape_names)
    except ValueError as exc:
        parser.error(str(exc))
    bf16_dir, fp8_dir = args.models / "qwen3_8b_random_bf16", args.models / "qwen3_8b_random_vllm_fp8"
    args.work.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    # Variants already measured on this machine (an earlier call of this script) are kept, so
    # one run can be completed over several calls; every variant shares model and prompts.
    settings = {"attention_backend": args.attention_backend, "gpu_memory_utilization": args.gpu_memory_utilization,
                "max_num_seqs": args.max_num_seqs, "model_runner": args.model_runner}  # fmt: skip
    # engine settings other than the defaults name the file: ratios only within one setting
    tag = "".join(f"_{key}_{value}" for key, value in settings.items() if value not in (None, 0.85))
    state_path = args.work / f"rollout_throughput_{'_'.join(shape_names)}{tag.lower()}.json"
    if state_path.exists():
        report = json.loads(state_path.read_text())
    else:
        report = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **_device_and_versions(),
            "model": {"config": QWEN3_8B, "init": "random, bf16, torch.manual_seed(0)"},
            "engine_settings": settings,
            "fp8_gemm_backend": "CUTLASS in both FP8 variants (VLLM_USE_DEEP_GEMM=0, FP8Config(use_deep_gemm=False))",
            "shapes": {name: dict(zip(("prompts", "prompt_tokens", "new_tokens"), SHAPES[name]), repeats=repeats[name]) for name in shape_names},
            "create_bf16_checkpoint_s": ensure_bf16_checkpoint(bf16_dir),
            "create_vllm_fp8_checkpoint_s": ensure_vllm_fp8_checkpoint(bf16_dir, fp8_dir),
            "variants": {},
        }
    shapes = []
    for name in shape_names:
        batch, prompt_len, new_tokens = SHAPES[name]
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, QWEN3_8B["vocab_size"], (batch, prompt_len), generator=g).tolist()
        shapes.append({"name": name, "prompts": prompts, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
                       "repeats": repeats[name]})  # fmt: skip
    failed = []
    for name in args.variants.split(","):
        if "by_shape" in report["variants"].get(name, {}):
            continue
        spec = {
            "model": str(fp8_dir if name.startswith("vllm_fp8") else bf16_dir), "fp8_align": name.startswith("fp8_align"),
            "kv_cache_dtype": "fp8" if name.endswith("_kv") else "auto", "calibrate_kv": name == "fp8_align_kv",
            "shapes": shapes, **settings,
        }  # fmt: skip
        try:
            report["variants"][name] = run_variant(name, spec, args.work / name)
        except VariantError as exc:  # recorded in the report and in the exit status
            report["variants"][name] = {"error": str(exc)}
            failed.append(name)
        _add_ratios(report)
        for path in (state_path, args.results / state_path.name):
            path.write_text(json.dumps(report, indent=2))
        print(json.dumps({name: report["variants"][name]})[:3000], flush=True)
    _print_table(report)
    return 1 if failed else 0


def _add_ratios(report: dict[str, Any]) -> None:
    """Per shape: each variant's throughput over BF16's, and fp8_align over vLLM's own FP8 path."""
    variants = {name: r for name, r in report["variants"].items() if "by_shape" in r}
    if "fp8_align" in variants and "vllm_fp8" in variants:
        report["fp8_align_extra_engine_start_vs_vllm_fp8_s"] = (
            variants["fp8_align"]["engine_start_s"] - variants["vllm_fp8"]["engine_start_s"]
        )
    report["ratios"] = {}
    for shape in report["shapes"]:
        ratios: dict[str, float] = {}
        tok_s = {name: r["by_shape"][shape]["output_tok_per_s"] for name, r in variants.items()}
        if "bf16" in tok_s:
            for name, value in tok_s.items():
                ratios[f"{name}_vs_bf16"] = value / tok_s["bf16"]
        for ours, theirs in (("fp8_align", "vllm_fp8"), ("fp8_align_kv", "vllm_fp8_kv")):
            if ours in tok_s and theirs in tok_s:
                ratios[f"{ours}_vs_{theirs}"] = tok_s[ours] / tok_s[theirs]
        report["ratios"][shape] = ratios


def _print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['device']} vllm {report['vllm']}")
    print(f"{'shape':<6} {'variant':<13} {'out tok/s':>10} {'vs bf16':>8} {'start s':>8} {'load s':>7} {'repeats':>8}")
    for shape in report["shapes"]:
        for name, r in report["variants"].items():
            if "error" in r:
                print(f"{shape:<6} {name:<13} FAILED")
                continue
            timed, load = r["by_shape"][shape], r.get("model_load_s")
            ratio = report["ratios"].get(shape, {}).get(f"{name}_vs_bf16", float("nan"))
            print(
                f"{shape:<6} {name:<13} {timed['output_tok_per_s']:>10.0f} {ratio:>8.3f} {r['engine_start_s']:>8.1f} "
                f"{load if load is not None else float('nan'):>7.1f} {len(timed['generate_s']):>8}"
            )


if __name__ == "__main__":
    sys.exit(main())
