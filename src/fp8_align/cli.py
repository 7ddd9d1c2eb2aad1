"""The `fp8-align` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fp8_align.config import FP8ConfigError
from fp8_align.doctor import build_report, format_report
from fp8_align.error_bench.error import (
    TRAINING_SIDES,
    VARIANTS,
    BenchInputError,
    BenchSettings,
    default_variants,
    parse_variants,
    resolve_device,
    run_bench_error,
)
from fp8_align.error_bench.generate import GenerationError
from fp8_align.error_bench.prompts import PromptFileError
from fp8_align.vllm_plugin.kernels.deepgemm.cache import prepare_deepgemm_cache
from fp8_align.vllm_plugin.kernels.deepgemm.inventory import (
    DEFAULT_MAX_BATCHED_TOKENS,
    ExpertShape,
    decoder_linear_shapes,
    expert_shapes,
    parse_shapes,
    trainer_linear_shapes,
    unique_weight_shapes,
)


def _doctor(args: argparse.Namespace) -> int:
    report = build_report()
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0


def _bench_error(args: argparse.Namespace) -> int:
    # rich (the `bench` extra) is needed by this command only: `fp8-align doctor` runs without it
    from rich.console import Console
    from rich.progress import track

    from fp8_align.error_bench.report import results_table, write_outputs

    console = Console(stderr=True, log_path=False)
    try:
        settings = BenchSettings(
            out_dir=args.out,
            model=args.model,
            prompts=args.prompts,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            variants=parse_variants(args.variants, resolve_device(args.device)) if args.variants else default_variants(resolve_device(args.device)),
            seed=args.seed,
            device=args.device,
            vllm_compile=args.vllm_compile,
            layer_attribution_prompts=args.layer_attribution,
            training_side=args.training_side,
            command=tuple(args.command_line),
        )
        doc = run_bench_error(
            settings,
            say=lambda text: console.log(text),
            status=console.status,
            progress=lambda items, total: track(items, total=total, description="layers", console=console),
        )
    except (BenchInputError, PromptFileError, FP8ConfigError) as exc:
        console.print(f"[red]error:[/] {exc}", soft_wrap=True)
        return 2
    except GenerationError as exc:
        console.print(f"[red]vLLM generation failed:[/] {exc}", soft_wrap=True)
        return 1
    written = write_outputs(doc, args.out, plots=not args.no_plots)
    if not args.json_only:
        # When piped, rich assumes 80 columns; the table needs about 110.
        Console(width=None if sys.stdout.isatty() else 120).print(results_table(doc))
    console.print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _prepare_deepgemm(args: argparse.Namespace) -> int:
    try:
        if (args.model is None) == (args.shapes is None):
            raise ValueError("give one of --model and --shapes")
        if args.trainer and args.model is None:
            raise ValueError("--trainer adds the shapes of --model's trainer: give --model")
        experts: list[ExpertShape] = []
        if args.shapes is not None:
            shapes = parse_shapes(args.shapes)
        else:
            config = json.loads((args.model / "config.json").read_text())
            config = config.get("text_config", config)
            shapes = decoder_linear_shapes(config, args.tensor_parallel_size)
            experts = expert_shapes(config, args.tensor_parallel_size)
            if args.trainer:
                shapes = unique_weight_shapes([*shapes, *trainer_linear_shapes(config)])
        report = prepare_deepgemm_cache(shapes, args.max_num_batched_tokens, args.jobs, args.cache_dir, args.device, experts)
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    print(f"engines started with DG_JIT_CACHE_DIR={report['cache_dir']} load these kernels instead of compiling them", file=sys.stderr)
    return 0


def _add_prepare_deepgemm(sub: argparse._SubParsersAction) -> None:
    prep = sub.add_parser(
        "prepare-deepgemm",
        help="fill DeepGEMM's JIT cache for a model's FP8 linears ahead of engine start (CUDA, SM90, vLLM)",
        description="Compile the DeepGEMM kernels an fp8_align engine warms up at start (one per [N, K] and M), "
        "in parallel processes, into DG_JIT_CACHE_DIR (default: vLLM's $VLLM_CACHE_ROOT/deep_gemm). Run it once "
        "per GPU model and vLLM version, on the GPU model the engines use; start the engines with the same "
        "DG_JIT_CACHE_DIR (or VLLM_CACHE_ROOT).",
    )
    prep.add_argument("--model", type=Path, help="checkpoint directory: the linear shapes come from its config.json (dense, Qwen3-MoE, Mixtral, MLA without q "
                      "LoRA), and of an MoE model the routed experts' grouped-GEMM kernels (moe_backend='deep_gemm') too")
    prep.add_argument("--shapes", help="comma-separated NxK of each linear per rank instead of --model (e.g. 6144x4096,4096x4096)")
    prep.add_argument("--trainer", action="store_true", help="also the kernels of a Hugging Face trainer of --model whose FP8 linears run the "
                      "engine's GEMM (apply_fp8_training(forward_kernel='engine'): unstacked q/k/v and gate/up projections; dense models)")
    prep.add_argument("--tensor-parallel-size", type=int, default=1, help="shapes per rank of this tensor-parallel size (default 1)")
    prep.add_argument(
        "--max-num-batched-tokens", type=int, default=DEFAULT_MAX_BATCHED_TOKENS,
        help=f"the engines' max_num_batched_tokens, or more (default {DEFAULT_MAX_BATCHED_TOKENS}: vLLM's LLM() default on H100/H200)",
    )  # fmt: skip
    prep.add_argument("--jobs", type=int, default=None, help="compile processes (default: one per CPU core, at most 16, within half the GPU's free memory)")
    prep.add_argument("--device", type=int, default=0, help="CUDA device index to compile on (default 0)")
    prep.add_argument("--cache-dir", type=Path, default=None, help="DeepGEMM JIT cache (default: DG_JIT_CACHE_DIR, else vLLM's)")
    prep.add_argument("--json", type=Path, default=None, help="also write the report here")
    prep.set_defaults(func=_prepare_deepgemm)


def _add_bench_error(sub: argparse._SubParsersAction) -> None:
    defaults = BenchSettings(out_dir=Path("fp8_align_out/bench_error"))

    bench = sub.add_parser(
        "bench-error",
        help="token-probability error of vLLM BF16/FP8 generation vs a BF16/FP8 training-side forward",
        description="Generate with real vLLM (greedy and sampled) per variant, score the tokens with an HF "
        "forward in BF16 and in fp8_align's block-FP8 emulation, and report token_mult_prob_error, KL and "
        "max |dlogp| per pair. Variants: "
        + "; ".join(f"{v.name} = {v.description}" for v in VARIANTS.values()),
    )
    bench.add_argument("--model", type=Path, help="HF checkpoint directory (default: SmolLM2-135M-Instruct, converted once)")
    bench.add_argument("--prompts", type=Path, help='JSONL, one {"messages": [...]} or {"prompt_token_ids": [...]} per line (default: the shipped set)')
    bench.add_argument("--num-prompts", type=int, default=defaults.num_prompts, help=f"use the first N prompts (default {defaults.num_prompts})")
    bench.add_argument(
        "--max-new-tokens", type=int, default=defaults.max_new_tokens,
        help=f"new tokens per completion at most (default {defaults.max_new_tokens})",
    )
    bench.add_argument(
        "--variants", default=None,
        help=f"comma-separated from {', '.join(VARIANTS)}, or 'all' (default {','.join(default_variants('cpu'))} on CPU, "
        f"{','.join(default_variants('cuda'))} on CUDA; one vLLM engine each)",
    )
    bench.add_argument("--seed", type=int, default=defaults.seed, help=f"vLLM engine and sampling seed (default {defaults.seed})")
    bench.add_argument("--out", type=Path, default=defaults.out_dir, help=f"output directory (default ./{defaults.out_dir})")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when available, else cpu")
    bench.add_argument(
        "--vllm-compile", choices=("auto", "on", "off"), default="auto",
        help="vLLM torch.compile (auto: off on CPU, where eager engines start in ~30 s instead of 80+ s; on for CUDA)",
    )
    bench.add_argument(
        "--layer-attribution", type=int, default=defaults.layer_attribution_prompts, metavar="N",
        help="error of FP8 in each decoder layer alone, on the first FP8 variant's first N greedy completions "
        f"(one HF forward per layer; default {defaults.layer_attribution_prompts}, 0 = off)",
    )
    bench.add_argument(
        "--training-side", default=defaults.training_side,
        help=f"comma-separated from {', '.join(TRAINING_SIDES)}. hf: HF transformers forward (BF16 and fp8_align's FP8 "
        "emulation), always scored; megatron-te: also megatron-core GPT with TransformerEngine layers, BF16 and TE "
        "block FP8 (needs megatron-core + TE and a CUDA GPU; TE's scale rounding follows "
        "NVTE_FP8_BLOCK_SCALING_FP32_SCALES); engine-kernels: also the HF model with the vLLM plugin's GPU GEMMs in its "
        "FP8 linears (CUDA)",
    )
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    bench.add_argument("--json-only", action="store_true", help="do not print the table (the JSON and markdown are still written)")
    bench.set_defaults(func=_bench_error)


def build_parser() -> argparse.ArgumentParser:
    """Argument parser with one sub-command per job."""
    parser = argparse.ArgumentParser(prog="fp8-align", description="Aligned block-FP8 for RL of language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="report what this environment can run of the FP8 recipe")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(func=_doctor)
    _add_bench_error(sub)
    _add_prepare_deepgemm(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fp8-align` console script."""
    args = build_parser().parse_args(argv)
    args.command_line = ["fp8-align", *(sys.argv[1:] if argv is None else argv)]
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
