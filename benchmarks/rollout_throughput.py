"""Rollout throughput on a random Qwen3-8B- or Qwen3-30B-A3B-shaped model: BF16 vs fp8_align vs vLLM's block FP8.

    python benchmarks/rollout_throughput.py --shapes short,long [--variants a,b] [--repeats short=3,long=1] --results DIR
        [--model qwen3-8b|qwen3-30b-a3b] [--merge REPORT.json]
        [--gpu-memory-utilization F] [--max-num-seqs N] [--attention-backend NAME] [--model-runner v1|v2]

Variants, each in its own process with cold compile/JIT caches (fresh VLLM_CACHE_ROOT,
TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), all on the same token-id prompts (no tokenizer:
skip_tokenizer_init):

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
    fp8_align_kv_xqa   fp8_align_kv with FP8Config(kv_decode_kernel="xqa"): pure-decode batches
               read the FP8 cache with FlashInfer's XQA kernel instead of FA3 (vLLM 0.22 on
               Hopper; the XQA module prebuilt and installed as docs/xqa_decode.md says)
    fp8_align_dg, fp8_align_kv_xqa_dg   the same with DeepGEMM linears: FP8Config(use_deep_gemm=True),
               VLLM_USE_DEEP_GEMM=1 in the engine process, and DG_JIT_CACHE_DIR=--deepgemm-cache
               when given (a cache filled ahead by `fp8-align prepare-deepgemm`; without it each
               engine compiles its ~1,700 kernels cold, one by one)

fp8_align and vllm_fp8 both use CUTLASS so that they differ only in where the weights are
quantized: DeepGEMM JIT-compiles a kernel per warm-up M value at engine start (about 0.8 s each,
cold, on the H100 box), minutes for an 8B model, which would swamp the start-time comparison;
the _dg variants measure DeepGEMM with its JIT cache prepared ahead.

Models (`--model`):

    qwen3-8b       (default) hidden 4096, 36 layers, 32 heads, 8 KV heads: a random BF16 checkpoint
                   (seed 0) and the offline FP8 one are written under --models on first use and
                   reused while the machine lives.
    qwen3-30b-a3b  Qwen3MoeForCausalLM as Qwen/Qwen3-30B-A3B's config.json: hidden 2048, 48 layers,
                   32 heads, 4 KV heads, 128 experts of 768, 8 per token; 30.5 B parameters, 61 GB
                   in BF16, too large to write twice on the box's 64 GiB disk in the time of a call.
                   Every variant loads vLLM's dummy weights (load_format="dummy"): each
                   "checkpoint" is a folder with only config.json, the offline FP8 one with
                   quantization_config {quant_method fp8, activation_scheme dynamic,
                   weight_block_size [128, 128], modules_to_not_convert: lm_head and the 48 routers,
                   as in Qwen's own FP8 release and as fp8_align keeps them}. vLLM fills every
                   parameter with uniform(-1e-3, 1e-3) (FP8 ones drawn in fp16 and cast, so
                   vllm_fp8's e4m3 weights are nearly all 0: below e4m3's smallest subnormal);
                   fp8_align's BF16 parameters get the same fill and are quantized by fp8_align
                   after loading. Weights and routing are random, which is fine for throughput
                   (fixed lengths, ignore_eos; kernel time does not depend on the values) and
                   meaningless for output quality. The routed experts of both FP8 variants run
                   vLLM's Triton block-FP8 fused-MoE kernel (VLLM_USE_DEEP_GEMM=0), and both FP8
                   variants' engine processes get VLLM_USE_DEEP_GEMM_E8M0=0: vLLM's MoE
                   activation-scale rounding is process-global, fp8_align with FP32 scales
                   refuses to start under E8M0 rounding, and vLLM's own path is given the same
                   rounding. Each variant's `moe_backend` is read from vLLM's log.

Per variant one engine serves every requested shape: it is sized for the largest (max_num_seqs =
most prompts, max_model_len = longest prompt + output), so each variant starts once. Engine
start (LLM constructor wall time, and vLLM's own "Model loading took" line), one warm-up
generate, then per shape (fp8_align_kv: the K/V calibration on that shape's prompts first)
`--repeats` timed generates of `batch` prompts x (`in` tokens in, `out` tokens out, ignore_eos,
temperature 1). Output tokens/s (median over repeats, each repeat kept) and the ratio to BF16
measured in the same run go to DIR/rollout_throughput[_<model>]_<shapes>.json.

Engine settings: gpu_memory_utilization 0.85, max_num_seqs = most prompts, vLLM's attention
backend and model runner; `--gpu-memory-utilization`, `--max-num-seqs`, `--attention-backend`
and `--model-runner v1|v2` change them for every variant of the call (results then go to a file
named after the changed settings, so ratios stay within one setting). Each variant also reports
its KV-cache capacity in tokens and vLLM's preemption count per timed generate.

One run over several calls (a call may last 10 minutes: one variant per call): variants already
in the report are kept and skipped, the others measured and added. The report is the one this
machine wrote under --work, or with `--merge REPORT.json` an earlier call's report (e.g. its
--results copy, brought back from another machine of the same kind). Either is refused unless it
has this call's GPU name and driver, software versions, model, shapes and engine settings. Each
variant records when, on which GPU (`run.gpu_uuid`, host) and by which command it was measured;
`variants_on_one_gpu` says whether the ratios come from one GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

# This folder holds `kernels.py`, which shadows the `kernels` package that transformers probes
# for (a circular import when vLLM loads transformers): take the folder off sys.path first.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

#: shape name -> (prompts, prompt tokens, generated tokens)
SHAPES = {"short": (256, 256, 512), "long": (512, 512, 2048)}
VARIANTS = ("bf16", "fp8_align", "vllm_fp8", "fp8_align_kv", "vllm_fp8_kv", "fp8_align_kv_xqa", "fp8_align_dg", "fp8_align_kv_xqa_dg")
#: Prompts in the engine-side KV-scale calibration batch of `fp8_align_kv`.
CALIBRATION_PROMPTS = 8
#: Report fields that must be equal for variants measured in different calls to share a report.
SAME_RUN_FIELDS = ("device", "torch", "cuda", "triton", "transformers", "vllm", "model", "engine_settings", "shapes")
QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
)  # fmt: skip
#: Qwen/Qwen3-30B-A3B's config.json (all but transformers_version): written as is for vLLM.
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False, attention_dropout=0.0,
    bos_token_id=151643, eos_token_id=151645, decoder_sparse_step=1, head_dim=128, hidden_act="silu", hidden_size=2048,
    initializer_range=0.02, intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[],
    moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128, num_experts_per_tok=8,
    num_hidden_layers=48, num_key_value_heads=4, output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None,
    rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False,
    torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=151936,
)  # fmt: skip


class ModelShape(NamedTuple):
    """A model the benchmark runs: its Hugging Face config and where vLLM gets the weights."""

    config: dict[str, Any]
    #: "auto": random checkpoints written here; "dummy": config.json only, vLLM's dummy weights
    load_format: str
    init: str
    #: extra `vllm.LLM` arguments for every variant of this model
    llm_kwargs: dict[str, Any] = {}


DEFAULT_MODEL = "qwen3-8b"
MODELS = {
    DEFAULT_MODEL: ModelShape(QWEN3_8B, "auto", "random, bf16, torch.manual_seed(0)"),
    "qwen3-30b-a3b": ModelShape(
        QWEN3_30B_A3B, "dummy", "vLLM dummy weights: every parameter uniform(-1e-3, 1e-3) (FP8 ones drawn in fp16, cast)",
        # vLLM 0.22 picks FlashInfer CUTLASS for BF16 experts on Hopper, which JIT-compiles (no nvcc
        # on the box: the engine hung in its profile run); all variants use vLLM's Triton fused MoE.
        {"moe_backend": "triton"},
    ),
}
#: quantization_config of vLLM's offline block-FP8 checkpoints.
VLLM_FP8_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
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
    config["quantization_config"] = VLLM_FP8_QUANTIZATION
    (fp8_path / "config.json").write_text(json.dumps(config, indent=2))
    (fp8_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    for extra in bf16_path.glob("generation_config.json"):
        (fp8_path / extra.name).write_text(extra.read_text())
    torch.cuda.empty_cache()
    return time.perf_counter() - start


def vllm_fp8_quantization_config(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM block-FP8 quantization_config for `config`; an MoE keeps lm_head and its routers BF16
    (`modules_to_not_convert`, as Qwen's FP8 releases do and fp8_align does)."""
    if "num_experts" not in config:
        return VLLM_FP8_QUANTIZATION
    routers = [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])]
    return {**VLLM_FP8_QUANTIZATION, "modules_to_not_convert": ["lm_head", *routers]}


def write_dummy_checkpoints(config: dict[str, Any], bf16_path: Path, fp8_path: Path) -> None:
    """config.json-only model folders for load_format="dummy": `config` as is, and with vLLM's
    block-FP8 quantization_config."""
    for path, extra in ((bf16_path, {}), (fp8_path, {"quantization_config": vllm_fp8_quantization_config(config)})):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**config, **extra}, indent=2))


def checkpoint_dirs(model: str, models: Path) -> tuple[Path, Path]:
    """The BF16 and the offline-FP8 model folders of `model` under `models`."""
    stem = model.replace("-", "_") + ("_dummy" if MODELS[model].load_format == "dummy" else "_random")
    return models / f"{stem}_bf16", models / f"{stem}_vllm_fp8"


def prepare_checkpoints(model: str, bf16_path: Path, fp8_path: Path) -> dict[str, float | None]:
    """Write `model`'s folders (random checkpoints when missing, or config.json only for dummy
    weights); returns the checkpoint-creation seconds by report field (None: reused)."""
    if MODELS[model].load_format == "dummy":
        write_dummy_checkpoints(MODELS[model].config, bf16_path, fp8_path)
        return {}
    return {
        "create_bf16_checkpoint_s": ensure_bf16_checkpoint(bf16_path),
        "create_vllm_fp8_checkpoint_s": ensure_vllm_fp8_checkpoint(bf16_path, fp8_path),
    }


# --------------------------------------------------------------------------- one engine (worker)
def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, warm up, time each shape's generates; returns the measurements (worker process)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

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
    if spec["fp8_align"]:
        kwargs.update(engine_kwargs(FP8Config(**spec["fp8_config"])))
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
def _nvidia_smi(fields: str) -> str:
    """`nvidia-smi --query-gpu=FIELDS` as CSV without header."""
    return subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True, check=True
    ).stdout.strip()


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _device_and_versions() -> dict[str, str]:
    import torch
    import transformers
    import triton
    import vllm

    return {
        "device": _nvidia_smi("name,driver_version"),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "vllm": vllm.__version__,
    }


class VariantError(RuntimeError):
    """One variant's engine process failed; the message holds its log tail."""


class MergeError(ValueError):
    """An earlier report that this call's variants may not join (another device, software or setup)."""


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
    result["moe_backend"] = sorted(set(re.findall(r"Using (.+?) (?:Unquantized|Fp8) MoE backend", text)))
    result["moe_config_files"] = sorted({Path(f).name for f in re.findall(r"Using configuration from (\S+) for MoE layer", text)})
    result["extra_env"] = spec["env"]
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


def variant_env(model: str, variant: str) -> dict[str, str]:
    """Environment of one variant's engine process on top of run_variant's common one: FP32
    activation-scale rounding for both FP8 paths of an MoE (VLLM_USE_DEEP_GEMM_E8M0=0)."""
    if "num_experts" in MODELS[model].config and variant != "bf16":
        return {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    return {}


def variant_spec(
    variant: str, model: str, bf16_path: Path, fp8_path: Path, shapes: list[dict[str, Any]], settings: dict[str, Any],
    deepgemm_cache: Path | None = None,
) -> dict[str, Any]:
    """What one variant's engine process runs (its spec file, read by run_engine and run_variant).
    `_dg` variants run DeepGEMM linears with DG_JIT_CACHE_DIR=`deepgemm_cache` (None: cold)."""
    deep_gemm = variant.endswith("_dg")
    env = variant_env(model, variant)
    if deep_gemm:
        env["VLLM_USE_DEEP_GEMM"] = "1"
        if deepgemm_cache is not None:
            env["DG_JIT_CACHE_DIR"] = str(deepgemm_cache)
    return {
        "model": str(fp8_path if variant.startswith("vllm_fp8") else bf16_path), "load_format": MODELS[model].load_format,
        "fp8_align": variant.startswith("fp8_align"), "kv_cache_dtype": "fp8" if "_kv" in variant else "auto",
        "fp8_config": {"use_deep_gemm": deep_gemm, **({"kv_cache_dtype": "fp8", "kv_decode_kernel": "xqa"} if "_xqa" in variant else {})},
        "calibrate_kv": variant.startswith("fp8_align_kv"), "env": env, "shapes": shapes,
        "llm_kwargs": MODELS[model].llm_kwargs, **settings,
    }  # fmt: skip


def results_name(model: str, shape_names: list[str], settings: dict[str, Any]) -> str:
    """Report file name: the model unless it is the default, the shapes, and the engine settings
    changed from the defaults (ratios only within one model and setting)."""
    tag = "".join(f"_{key}_{value}" for key, value in settings.items() if value not in (None, 0.85))
    prefix = "rollout_throughput" if model == DEFAULT_MODEL else f"rollout_throughput_{model}"
    return f"{prefix}_{'_'.join(shape_names)}{tag.lower()}.json"


def report_header(model: str, shape_names: list[str], repeats: dict[str, int], settings: dict[str, Any]) -> dict[str, Any]:
    """This call's report fields other than the variants (device and versions included), as they
    read back from a report file."""
    shape = MODELS[model]
    gemm = ("CUTLASS in every FP8 variant (VLLM_USE_DEEP_GEMM=0, FP8Config(use_deep_gemm=False)) but the _dg ones: "
            "DeepGEMM (VLLM_USE_DEEP_GEMM=1, FP8Config(use_deep_gemm=True))")
    if "num_experts" in shape.config:
        gemm += "; routed experts: vLLM's Triton block-FP8 fused MoE (each variant's moe_backend), VLLM_USE_DEEP_GEMM_E8M0=0"
    header = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": _utc_now(),
        **_device_and_versions(),
        "model": {"name": model, "config": shape.config, "load_format": shape.load_format, "init": shape.init},
        "engine_settings": settings,
        "fp8_gemm_backend": gemm,
        "shapes": {name: {**dict(zip(("prompts", "prompt_tokens", "new_tokens"), SHAPES[name])), "repeats": repeats[name]}
                   for name in shape_names},
    }  # fmt: skip
    return json.loads(json.dumps(header))


def load_report(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    """The report of earlier calls at `path`, to add this call's variants to. MergeError unless it
    has this call's GPU name and driver, software versions, model, shapes and engine settings."""
    report = json.loads(path.read_text())
    differ = [
        f"{field}: {str(report.get(field))[:200]} there, {str(header[field])[:200]} here"
        for field in SAME_RUN_FIELDS
        if report.get(field) != header[field]
    ]
    if differ:
        raise MergeError(f"{path} holds another run, its variants' ratios would not compare; " + "; ".join(differ))
    return report


def run_info(device: str) -> dict[str, str]:
    """When, where and by which command a variant is measured."""
    return {
        "started_utc": _utc_now(), "device": device, "gpu_uuid": _nvidia_smi("uuid"), "host": socket.gethostname(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }  # fmt: skip


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="short", help=f"comma-separated, from {', '.join(SHAPES)}; one engine per variant serves all")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", default="1", help="timed generates per shape (median reported): N, or short=N,long=M")
    parser.add_argument("--model", choices=list(MODELS), default=DEFAULT_MODEL, help="model shape (see the module doc)")
    parser.add_argument("--merge", type=Path, metavar="REPORT",
                        help="add the variants to this earlier report (refused unless device, software and setup match) "
                             "instead of this machine's report under --work")  # fmt: skip
    parser.add_argument("--attention-backend", help="vLLM attention backend for every variant (default: vLLM's choice)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--max-num-seqs", type=int, help="default: the most prompts of the requested shapes")
    parser.add_argument("--model-runner", choices=["v1", "v2"],
                        help="force vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER); default: vLLM's choice, which in "
                             "0.22 is V2 for an unquantized Qwen3 and V1 for every quantized model")  # fmt: skip
    parser.add_argument("--deepgemm-cache", type=Path, metavar="DIR",
                        help="DeepGEMM JIT cache of the _dg variants, filled ahead by `fp8-align prepare-deepgemm` "
                             "(default: each engine's own fresh cache, compiled cold)")  # fmt: skip
    parser.add_argument("--models", type=Path, default=Path("/root/models"))
    parser.add_argument("--work", type=Path, default=Path("/root/rollout_work"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    return parser


def _checked_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str], dict[str, int]]:
    """Shapes, variants and repeats per shape from the arguments (parser.error on unknown names)."""
    shape_names, variants = args.shapes.split(","), args.variants.split(",")
    for name in shape_names:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    for name in variants:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    try:
        return shape_names, variants, _parse_repeats(args.repeats, shape_names)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        spec_path, result_path = args.worker
        Path(result_path).write_text(json.dumps(run_engine(json.loads(Path(spec_path).read_text()))))
        return 0

    shape_names, variants, repeats = _checked_names(parser, args)
    settings = {"attention_backend": args.attention_backend, "gpu_memory_utilization": args.gpu_memory_utilization,
                "max_num_seqs": args.max_num_seqs, "model_runner": args.model_runner}  # fmt: skip
    name = results_name(args.model, shape_names, settings)
    state_path = args.work / name
    header = report_header(args.model, shape_names, repeats, settings)
    # Variants already measured (an earlier call on this machine, or --merge) are kept, so one
    # run can be completed over several calls; every variant shares model and prompts.
    if args.merge and not args.merge.exists():
        parser.error(f"--merge {args.merge}: no such file")
    earlier = args.merge or (state_path if state_path.exists() else None)
    try:
        report = load_report(earlier, header) if earlier else None
    except MergeError as exc:
        parser.error(str(exc))
    bf16_dir, fp8_dir = checkpoint_dirs(args.model, args.models)
    created = prepare_checkpoints(args.model, bf16_dir, fp8_dir)
    report = report or {**header, **created, "variants": {}}
    args.work.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    shapes = make_shapes(shape_names, repeats, MODELS[args.model].config["vocab_size"])
    failed = []
    for variant in variants:
        if "by_shape" in report["variants"].get(variant, {}):
            print(f"{variant}: kept from {earlier}", flush=True)
            continue
        run = run_info(report["device"])
        spec = variant_spec(variant, args.model, bf16_dir, fp8_dir, shapes, settings, args.deepgemm_cache)
        try:
            result = run_variant(variant, spec, args.work / variant)
        except VariantError as exc:  # recorded in the report and in the exit status
            result = {"error": str(exc)}
            failed.append(variant)
        report["variants"][variant] = {**result, "run": run}
        _save(report, [state_path, args.results / name])
        print(json.dumps({variant: report["variants"][variant]})[:3000], flush=True)
    _save(report, [state_path, args.results / name])
    _print_table(report)
    return 1 if failed else 0


def _save(report: dict[str, Any], paths: list[Path]) -> None:
    """Recompute the ratios and write the report to every path."""
    _add_ratios(report)
    for path in paths:
        path.write_text(json.dumps(report, indent=2))


def _add_ratios(report: dict[str, Any]) -> None:
    """Per shape: each variant's throughput over BF16's, and fp8_align over vLLM's own FP8 path;
    whether every measured variant ran on one GPU (one machine: --merge may join two of a kind)."""
    variants = {name: r for name, r in report["variants"].items() if "by_shape" in r}
    report["variants_on_one_gpu"] = len({r.get("run", {}).get("gpu_uuid") for r in variants.values()}) <= 1
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
        for ours, theirs in (("fp8_align", "vllm_fp8"), ("fp8_align_kv", "vllm_fp8_kv"), ("fp8_align_kv_xqa", "vllm_fp8_kv"),
                             ("fp8_align_kv_xqa", "fp8_align_kv"), ("fp8_align_dg", "fp8_align"), ("fp8_align_dg", "vllm_fp8"),
                             ("fp8_align_kv_xqa_dg", "vllm_fp8_kv"), ("fp8_align_kv_xqa_dg", "fp8_align_kv_xqa")):
            if ours in tok_s and theirs in tok_s:
                ratios[f"{ours}_vs_{theirs}"] = tok_s[ours] / tok_s[theirs]
        report["ratios"][shape] = ratios


def _print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['device']} vllm {report['vllm']}, variants on one GPU: {report['variants_on_one_gpu']}")
    print(f"{'shape':<6} {'variant':<20} {'out tok/s':>10} {'vs bf16':>8} {'start s':>8} {'load s':>7} {'repeats':>8}")
    for shape in report["shapes"]:
        for name, r in report["variants"].items():
            if "error" in r:
                print(f"{shape:<6} {name:<20} FAILED")
                continue
            timed, load = r["by_shape"][shape], r.get("model_load_s")
            ratio = report["ratios"].get(shape, {}).get(f"{name}_vs_bf16", float("nan"))
            print(
                f"{shape:<6} {name:<20} {timed['output_tok_per_s']:>10.0f} {ratio:>8.3f} {r['engine_start_s']:>8.1f} "
                f"{load if load is not None else float('nan'):>7.1f} {len(timed['generate_s']):>8}"
            )


if __name__ == "__main__":
    sys.exit(main())
