"""One variant of the rollout benchmark: its engine process, its settings, and what it measures."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.rollout.checkpoints import MODELS, is_moe
from fp8_align.bitwise import TENSOR_PARALLEL_SIZES as BITWISE_TENSOR_PARALLEL_SIZES

#: shape name -> (prompts, prompt tokens, generated tokens)
SHAPES = {"short": (256, 256, 512), "long": (512, 512, 2048)}
VARIANTS = ("bf16", "fp8_align", "vllm_fp8", "fp8_align_kv", "vllm_fp8_kv", "fp8_align_kv_xqa", "fp8_align_dg", "fp8_align_kv_xqa_dg",
            "vllm_fp8_dg", "vllm_fp8_kv_dg", "fp8_align_kv_dg", "vllm_fp8_online_kv_dg", "fp8_align_kv_auto_dg", "fp8_align_bitwise",
            "fp8_align_bitwise_kv")  # fmt: skip
#: vLLM's online block-FP8 method (BF16 checkpoint quantized at load), vLLM 0.25+.
VLLM_ONLINE_BLOCK_FP8 = "fp8_per_block"
#: Prompts in the engine-side KV-scale calibration batch of `fp8_align_kv`.
CALIBRATION_PROMPTS = 8
#: The benchmark's command line; its hidden `--worker SPEC RESULT` runs `run_engine` in a fresh process.
SCRIPT = Path(__file__).resolve().parents[1] / "rollout_throughput.py"
_LOG_FIELDS = {  # vLLM 0.22 and fp8_align log lines -> seconds, GiB, MiB
    "model_load_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    "weights_load_s": r"Loading weights took ([\d.]+) seconds",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "model_memory_gib": r"Model loading took ([\d.]+) GiB",
    "fp8_align_load_bf16_peak_mib": r"held at most ([\d.]+) MiB of BF16 weights at once",
    "load_device_peak_gib": r"the device's peak allocation so far: ([\d.]+) GiB",
}

#: fp8_align's DeepGEMM warm-up line -> (the vLLM process prefix, e.g. "(Worker_TP1 pid=7) ", or "", seconds)
_DEEPGEMM_WARMUP = re.compile(r"^(\(\S+ pid=\d+\) )?.*fp8_align: DeepGEMM warm-up N=\d+ K=\d+: \d+ M values in ([\d.]+) s", re.MULTILINE)


class VariantError(RuntimeError):
    """One variant's engine process failed; the message holds its log tail."""


# --------------------------------------------------------------------------- one engine (worker)
def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, warm up, time each shape's generates; returns the measurements (worker process)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    shapes = spec["shapes"]
    kwargs = llm_kwargs(spec)
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


def llm_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """The `vllm.LLM` keyword arguments of one variant's engine from its spec; a spec with
    tensor_parallel_size N > 1 splits the model over N GPUs with vLLM's multiprocessing executor."""
    from fp8_align.config import FP8Config
    from fp8_align.vllm_plugin import engine_kwargs

    shapes = spec["shapes"]
    kwargs: dict[str, Any] = dict(
        model=spec["model"], load_format=spec["load_format"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        gpu_memory_utilization=spec["gpu_memory_utilization"], max_model_len=max(s["prompt_len"] + s["new_tokens"] for s in shapes),
        max_num_seqs=spec["max_num_seqs"] or max(s["batch"] for s in shapes), kv_cache_dtype=spec["kv_cache_dtype"],
        disable_log_stats=False,  # for the preemption counter (llm.get_metrics)
    )  # fmt: skip
    kwargs.update(spec.get("llm_kwargs", {}))
    if spec["attention_backend"]:
        kwargs["attention_backend"] = spec["attention_backend"]
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if (spec.get("tensor_parallel_size") or 1) > 1:
        kwargs.update(tensor_parallel_size=spec["tensor_parallel_size"], distributed_executor_backend="mp")
    if spec["fp8_align"]:
        kwargs.update(engine_kwargs(FP8Config(**spec["fp8_config"])))
    return kwargs


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
        from fp8_align.vllm_plugin import calibrate_kv_scales

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


# --------------------------------------------------------------------------- driver side
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
    env.update(spec["env"])
    if spec["model_runner"]:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if spec["model_runner"] == "v2" else "0"
    spec_path, result_path, log_path = work / f"{name}.spec.json", work / f"{name}.result.json", work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--worker", str(spec_path), str(result_path)], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise VariantError(f"variant {name} failed ({proc.returncode}); log tail:\n{text[-4000:]}")
    result = {**json.loads(result_path.read_text()), **read_engine_log(text)}
    result["extra_env"] = spec["env"]
    return result


def read_engine_log(text: str) -> dict[str, Any]:
    """What a variant's engine log says: `_LOG_FIELDS` (None where the line is missing), the
    attention backend vLLM chose (none logged when one was asked for), the decode kernel vLLM's
    FLASHINFER backend resolved (`xqa` on Hopper with an FP8 cache), model runner, fp8_align's
    DeepGEMM warm-up seconds (summed per engine process, the longest of a tensor-parallel engine's
    ranks) and GEMM kernels, and the MoE backend and config files. With tensor parallelism the
    `_LOG_FIELDS` are the first rank's line to match (memory per GPU)."""
    result: dict[str, Any] = {}
    for field, pattern in _LOG_FIELDS.items():
        match = re.search(pattern, text)
        result[field] = float(match.group(1)) if match else None
    result["attention_backend"] = sorted(set(re.findall(r"Using (\w+) attention backend", text)))
    result["flashinfer_decode_backend"] = sorted(set(re.findall(r"FlashInfer resolved query dtypes: .*?decode_backend=([\w-]+)", text)))
    result["model_runner"] = "v2" if "Using V2 Model Runner" in text else "v1"
    warmups: dict[str, float] = {}  # per engine process: tensor-parallel ranks warm up side by side
    for process, seconds in _DEEPGEMM_WARMUP.findall(text):
        warmups[process] = warmups.get(process, 0.0) + float(seconds)
    result["fp8_align_deepgemm_warmup_s"] = max(warmups.values()) if warmups else None
    result["fp8_align_kernels"] = sorted(set(re.findall(r"fp8_align: model\.layers\.\S+ \[[^\]]*\]\] -> (\w+)", text)))
    result["moe_backend"] = sorted(set(re.findall(r"Using (.+?) (?:Unquantized|Fp8) MoE backend", text)))
    result["moe_config_files"] = sorted({Path(f).name for f in re.findall(r"Using configuration from (\S+) for MoE layer", text)})
    return result


def variant_env(model: str, variant: str) -> dict[str, str]:
    """Environment of one variant's engine process on top of run_variant's common one: FP32
    activation-scale rounding for both FP8 paths of an MoE (VLLM_USE_DEEP_GEMM_E8M0=0)."""
    if is_moe(MODELS[model].config) and variant != "bf16":
        return {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    return {}


def variant_spec(
    variant: str, model: str, bf16_path: Path, fp8_path: Path, shapes: list[dict[str, Any]], settings: dict[str, Any],
    deepgemm_cache: Path | None = None, flashinfer_jit: bool = False,
) -> dict[str, Any]:
    """What one variant's engine process runs (its spec file, read by run_engine and run_variant).
    `_dg` variants run DeepGEMM linears with DG_JIT_CACHE_DIR=`deepgemm_cache` (None: cold), and
    on an MoE model DeepGEMM's grouped GEMM for the routed experts (moe_backend "deep_gemm").
    `vllm_fp8_online*` load the BF16 checkpoint with quantization="fp8_per_block".
    `flashinfer_jit`: FlashInfer may compile modules in the engine process (FLASHINFER_DISABLE_JIT
    unset); without it vLLM's `_dg` variants run DeepGEMM for every M (see below)."""
    deep_gemm = variant.endswith("_dg")
    online = variant.startswith("vllm_fp8_online")
    env = variant_env(model, variant)
    if settings.get("kv_cache_layout"):
        env["VLLM_KV_CACHE_LAYOUT"] = settings["kv_cache_layout"]
    llm_kwargs = dict(MODELS[model].llm_kwargs)
    if online:
        llm_kwargs["quantization"] = VLLM_ONLINE_BLOCK_FP8
    if deep_gemm:
        env["VLLM_USE_DEEP_GEMM"] = "1"
        if deepgemm_cache is not None:
            env["DG_JIT_CACHE_DIR"] = str(deepgemm_cache)
        if is_moe(MODELS[model].config):
            llm_kwargs["moe_backend"] = "deep_gemm"
        if variant.startswith("vllm_fp8") and not flashinfer_jit:
            # vLLM's block-FP8 linears would send small M to FlashInfer's SM90 block-scale GEMM, a
            # module FlashInfer JIT-compiles: DeepGEMM for every M where FlashInfer cannot compile.
            env["VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER"] = "0"
    return {
        "model": str(fp8_path if variant.startswith("vllm_fp8") and not online else bf16_path), "load_format": MODELS[model].load_format,
        "fp8_align": variant.startswith("fp8_align"), "kv_cache_dtype": "fp8" if "_kv" in variant else "auto",
        "fp8_config": {"use_deep_gemm": deep_gemm, **_kv_decode_config(variant)},
        "calibrate_kv": variant.startswith("fp8_align") and "_kv" in variant, "env": env, "shapes": shapes,
        "llm_kwargs": llm_kwargs, **settings, "attention_backend": attention_backend_of(settings.get("attention_backend"), variant),
    }  # fmt: skip


def _kv_decode_config(variant: str) -> dict[str, str]:
    """The FP8Config KV-decode fields of an fp8_align variant: `_xqa` asks for XQA (0.22's route),
    `_auto` is what a user gets by default (an FP8 cache, kv_decode_kernel "auto": on vLLM 0.25 /
    Hopper fp8_align picks FLASHINFER where the engine's backend is unset), `_bitwise` runs
    FP8Config(on_policy="bitwise") (TRITON_ATTN's one kernel decodes, over an E4M3 cache with
    `_bitwise_kv`), the others keep the attention backend's own decode."""
    if "_bitwise" in variant:
        return {"on_policy": "bitwise", "kv_cache_dtype": "fp8" if "_kv" in variant else "auto"}
    if "_xqa" in variant:
        return {"kv_cache_dtype": "fp8", "kv_decode_kernel": "xqa"}
    if "_auto" in variant:
        return {"kv_cache_dtype": "fp8", "kv_decode_kernel": "auto"}
    return {"kv_decode_kernel": "backend"}


def refused_at(tensor_parallel_size: int, variants: list[str]) -> list[str]:
    """The `variants` whose engine refuses `tensor_parallel_size` (the bitwise ones beyond
    BITWISE_TENSOR_PARALLEL_SIZES), to be refused before any engine starts."""
    return [v for v in variants if "_bitwise" in v and tensor_parallel_size not in BITWISE_TENSOR_PARALLEL_SIZES]


def attention_backends(setting: str | None) -> dict[str, str | None]:
    """--attention-backend parsed: None (vLLM's choice for every variant), "NAME" (every variant), or
    "NAME,VARIANT=NAME2,..." (NAME2 for those variants; "auto" is vLLM's choice). Returns
    {"*": default, variant: override, ...}; ValueError on an unknown variant or a second default."""
    backends: dict[str, str | None] = {"*": None}
    for i, item in enumerate((setting or "").split(",") if setting else []):
        variant, sep, name = item.rpartition("=")
        if not sep and i > 0:
            raise ValueError(f"--attention-backend {setting!r}: only the first item may name the backend of every variant")
        if sep and variant not in VARIANTS:
            raise ValueError(f"--attention-backend {setting!r}: unknown variant {variant!r}")
        backends[variant if sep else "*"] = None if name == "auto" else name
    return backends


def attention_backend_of(setting: str | None, variant: str) -> str | None:
    """The attention backend of `variant`'s engine under --attention-backend `setting` (None: vLLM's choice)."""
    backends = attention_backends(setting)
    return backends.get(variant, backends["*"])


def make_shapes(shape_names: list[str], repeats: dict[str, int], vocab_size: int) -> list[dict[str, Any]]:
    """Each shape's sizes and random token-id prompts (seed 0), as the engine processes get them."""
    import torch

    shapes = []
    for name in shape_names:
        batch, prompt_len, new_tokens = SHAPES[name]
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, vocab_size, (batch, prompt_len), generator=g).tolist()
        shapes.append({"name": name, "prompts": prompts, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
                       "repeats": repeats[name]})  # fmt: skip
    return shapes
