"""Rollout throughput on a random Qwen3-8B- or Qwen3-30B-A3B-shaped model: BF16 vs fp8_align vs vLLM's block FP8.

    python benchmarks/rollout_throughput.py --shapes short,long [--variants a,b] [--repeats short=3,long=1] --results DIR
        [--model qwen3-8b|qwen3-30b-a3b|moonlight-16b-a3b] [--merge REPORT.json]
        [--gpu-memory-utilization F] [--max-num-seqs N] [--attention-backend NAME] [--model-runner v1|v2]
        [--tensor-parallel-size N] [--gpus G]

This file is the command line; benchmarks/rollout/ holds the models and their checkpoints
(`checkpoints`), one variant's engine process (`runner`) and the report (`report`).

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
               FlashAttention 3, FP8 attention (vLLM quantizes the query too), decoded by FA3
               (FP8Config(kv_decode_kernel="backend"): the default "auto" would take XQA). After the
               warm-up the K/V scales are calibrated by the engine
               (`fp8_align.vllm_plugin.calibrate_kv_scales`, 8 prompts of the
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
               engine compiles its ~1,700 kernels cold, one by one). On an MoE model the routed
               experts run DeepGEMM's grouped GEMM too (moe_backend="deep_gemm", vLLM's
               TritonOrDeepGemmExperts: Triton below 128 tokens), its kernels compiled by vLLM's
               own warm-up into the same cache
    vllm_fp8_dg, vllm_fp8_kv_dg   vllm_fp8 / vllm_fp8_kv on DeepGEMM the same way (vLLM's block-FP8
               linears and, on an MoE model, experts); where FlashInfer may not JIT-compile
               (FLASHINFER_DISABLE_JIT set) for every M (VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0:
               vLLM would send small M to FlashInfer's block-scale GEMM, a JIT-compiled module);
               the backend (FA3 by default) decodes the FP8 cache
    fp8_align_kv_dg   fp8_align_kv on DeepGEMM: the attention backend decodes the FP8 cache (with
               --attention-backend FLASHINFER on vLLM 0.25+, FlashInfer's XQA on Hopper)
    vllm_fp8_online_kv_dg   vLLM's online block FP8 (quantization="fp8_per_block", vLLM 0.25+, the
               BF16 checkpoint quantized at load) + FP8 KV, on DeepGEMM as vllm_fp8_kv_dg
    fp8_align_kv_auto_dg   fp8_align_kv_dg with FP8Config's default decode (kv_cache_dtype="fp8",
               kv_decode_kernel="auto"): what a user gets; on vLLM 0.25 / Hopper with the backend
               left to the engine (--attention-backend auto for it) fp8_align picks FLASHINFER

    fp8_align_bitwise, fp8_align_bitwise_kv   FP8Config(on_policy="bitwise"): the bitwise engine
               (vLLM 0.22: batch-invariant mode, TRITON_ATTN, fp8_align's fixed-tile GEMMs and
               operators), with a BF16 cache or (_kv) an E4M3 cache whose K/V scales are calibrated
               as fp8_align_kv's; what an RL loop with exact log-probs runs

fp8_align and vllm_fp8 both use CUTLASS so that they differ only in where the weights are
quantized: DeepGEMM JIT-compiles a kernel per warm-up M value at engine start, minutes for an
8B model with a cold cache, which would swamp the start-time comparison; the _dg variants measure
DeepGEMM with its JIT cache prepared ahead.

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
    moonlight-16b-a3b  DeepseekV3ForCausalLM with Moonlight-16B-A3B's shape (MLA without q LoRA,
                   kv_lora_rank 512 + rope 64, 27 layers, layer 0 dense, 64 routed experts of
                   1408 + 2 shared, top-6; 15.96 B parameters), dummy weights and MoE settings as
                   qwen3-30b-a3b; vLLM picks the MLA attention backend. fp8_align's FP8 KV and
                   XQA variants do not apply to MLA (run bf16, fp8_align[_dg], vllm_fp8[_dg]).

Per variant one engine serves every requested shape: it is sized for the largest (max_num_seqs =
most prompts, max_model_len = longest prompt + output), so each variant starts once. Engine
start (LLM constructor wall time, and vLLM's own "Model loading took" line), one warm-up
generate, then per shape (fp8_align_kv: the K/V calibration on that shape's prompts first)
`--repeats` timed generates of `batch` prompts x (`in` tokens in, `out` tokens out, ignore_eos,
temperature 1). Output tokens/s (median over repeats, each repeat kept) and the ratio to BF16
measured in the same run go to DIR/rollout_throughput[_<model>]_<shapes>.json.

Engine settings: gpu_memory_utilization 0.85, max_num_seqs = most prompts, vLLM's attention
backend, page size and layout and model runner; `--gpu-memory-utilization`, `--max-num-seqs`,
`--attention-backend`, `--block-size`, `--kv-cache-layout` and `--model-runner v1|v2` change them
for every variant of the call (results then go to a file
named after the changed settings, so ratios stay within one setting). `--attention-backend
FLASHINFER,bf16=auto` gives named variants their own backend: vLLM's FP8-KV decode on FlashInfer
(XQA on Hopper) against BF16 on vLLM's default backend, each variant at its fastest. Each variant also reports
its KV-cache capacity in tokens and vLLM's preemption count per timed generate.

One run over several calls (a call may last 10 minutes: one variant per call): variants already
in the report are kept and skipped, the others measured and added. The report is the one this
machine wrote under --work, or with `--merge REPORT.json` an earlier call's report (e.g. its
--results copy, brought back from another machine of the same kind). Either is refused unless it
has this call's GPU name and driver, software versions, model, shapes and engine settings. Each
variant records when, on which GPU (`run.gpu_uuid`, host) and by which command it was measured;
`variants_on_one_gpu` says whether the ratios come from one GPU.

`--gpus N` measures up to N variants at once on a host with several GPUs of one kind, each engine
on its own GPU (CUDA_VISIBLE_DEVICES=i, `run.gpu_index`; i from the caller's CUDA_VISIBLE_DEVICES
list of host indices where set, e.g. 1,3): the same run in about 1/N of the time
(device time is counted per machine, not per GPU). Ratios then compare GPUs of one machine, and
engines starting side by side share the host's CPUs while they compile (engine start times are
less comparable than throughput).

`--tensor-parallel-size N` (default 1) splits every variant's engine over N GPUs (vLLM's
tensor_parallel_size, multiprocessing executor; recorded in the report's engine_settings and name,
so --merge refuses another size). `--gpus G` (default N) then runs G/N variants at once, each on
the next N GPUs of the list (CUDA_VISIBLE_DEVICES=i,j; `run.gpu_index` the list, `run.gpu_uuid`
their uuids); a G that N does not divide is refused, and so are the bitwise variants at an N their
engine refuses (`fp8_align.bitwise.TENSOR_PARALLEL_SIZES`). The K/V calibration takes each layer's amax over the ranks
(`calibrate_kv_scales`); a `_dg` variant's DeepGEMM cache needs the per-rank shapes
(`fp8-align prepare-deepgemm --tensor-parallel-size N`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections import deque
from pathlib import Path

# This folder holds `kernels.py`, which shadows the `kernels` package that transformers probes
# for (a circular import when vLLM loads transformers): take the folder off sys.path first; the
# repository root goes on it for the benchmark's own modules (benchmarks/rollout/).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.rollout import checkpoints, report, runner  # noqa: E402


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="short", help=f"comma-separated, from {', '.join(runner.SHAPES)}; one engine per variant serves all")
    parser.add_argument("--variants", default=",".join(runner.VARIANTS))
    parser.add_argument("--repeats", default="1", help="timed generates per shape (median reported): N, or short=N,long=M")
    parser.add_argument("--model", choices=list(checkpoints.MODELS), default=checkpoints.DEFAULT_MODEL, help="model shape (see the module doc)")
    parser.add_argument("--merge", type=Path, metavar="REPORT",
                        help="add the variants to this earlier report (refused unless device, software and setup match) "
                             "instead of this machine's report under --work")  # fmt: skip
    parser.add_argument("--attention-backend",
                        help="vLLM attention backend for every variant (default: vLLM's choice); NAME,VARIANT=NAME2,... "
                             "gives those variants NAME2 ('auto': vLLM's choice), e.g. FLASHINFER,bf16=auto")  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--max-num-seqs", type=int, help="default: the most prompts of the requested shapes")
    parser.add_argument("--block-size", type=int, help="KV-cache page size in tokens (vLLM's block_size; default: vLLM's choice)")
    parser.add_argument("--kv-cache-layout", choices=["NHD", "HND"],
                        help="KV-cache page layout (VLLM_KV_CACHE_LAYOUT; default: the backend's, NHD on Hopper)")  # fmt: skip
    parser.add_argument("--model-runner", choices=["v1", "v2"],
                        help="force vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER); default: vLLM's choice, which in "
                             "0.22 is V2 for an unquantized Qwen3 and V1 for every quantized model")  # fmt: skip
    parser.add_argument("--deepgemm-cache", type=Path, metavar="DIR",
                        help="DeepGEMM JIT cache of the _dg variants, filled ahead by `fp8-align prepare-deepgemm` "
                             "(default: each engine's own fresh cache, compiled cold)")  # fmt: skip
    parser.add_argument("--gpus", type=int,
                        help="measure up to N / tensor-parallel-size variants at once, each engine on its own GPUs of this host "
                             "(GPU i: CUDA_VISIBLE_DEVICES=i); default: the tensor-parallel size (1: one after another on the "
                             "environment's GPUs)")  # fmt: skip
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs of each variant's engine (vLLM's tensor_parallel_size, multiprocessing executor; default 1)")  # fmt: skip
    parser.add_argument("--models", type=Path, default=Path("/root/models"))
    parser.add_argument("--work", type=Path, default=Path("/root/rollout_work"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    return parser


def _gpu_ids(requested: int) -> list[int]:
    """The host indices of the GPUs this call may use: CUDA_VISIBLE_DEVICES's list when set (host
    indices, as the box's chains set it), else every GPU of the host when more than one is
    `requested`, else [] (the environment's GPU, index unknown)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if not all(v.isdigit() for v in visible):
            raise SystemExit(f"CUDA_VISIBLE_DEVICES={','.join(visible)}: give host GPU indices (e.g. 1,3), not uuids")
        return [int(v) for v in visible]
    return list(range(len(report.nvidia_smi("uuid").splitlines()))) if requested > 1 else []


def _checked_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str], dict[str, int]]:
    """Shapes, variants and repeats per shape from the arguments (parser.error on unknown names)."""
    shape_names, variants = args.shapes.split(","), args.variants.split(",")
    for name in shape_names:
        if name not in runner.SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {', '.join(runner.SHAPES)}")
    for name in variants:
        if name not in runner.VARIANTS:
            parser.error(f"unknown variant {name!r}; choose from {', '.join(runner.VARIANTS)}")
    try:
        runner.attention_backends(args.attention_backend)
        return shape_names, variants, _parse_repeats(args.repeats, shape_names)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        spec_path, result_path = args.worker
        Path(result_path).write_text(json.dumps(runner.run_engine(json.loads(Path(spec_path).read_text()))))
        return 0

    shape_names, variants, repeats = _checked_names(parser, args)
    if any(v.startswith("vllm_fp8_online") for v in variants):
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

        if runner.VLLM_ONLINE_BLOCK_FP8 not in QUANTIZATION_METHODS:
            parser.error(f"the vllm_fp8_online variants need vLLM's quantization={runner.VLLM_ONLINE_BLOCK_FP8!r} (vLLM 0.25+); "
                         "this vLLM does not have it")  # fmt: skip
    tp = args.tensor_parallel_size
    gpu_count = tp if args.gpus is None else args.gpus
    if tp < 1 or gpu_count < 1:
        parser.error("--gpus and --tensor-parallel-size must be 1 or more")
    if gpu_count % tp:
        parser.error(f"--gpus {gpu_count} with --tensor-parallel-size {tp}: each variant's engine takes {tp} GPUs; give a multiple of {tp}")
    refused = runner.refused_at(tp, variants)
    if refused:
        parser.error(f"--tensor-parallel-size {tp}: {', '.join(refused)} run FP8Config(on_policy='bitwise'), whose engine takes "
                     f"tensor_parallel_size {' or '.join(map(str, runner.BITWISE_TENSOR_PARALLEL_SIZES))} only")  # fmt: skip
    gpu_ids = _gpu_ids(gpu_count)
    if gpu_count > 1 and gpu_count > len(gpu_ids):
        parser.error(f"--gpus {gpu_count}: {len(gpu_ids)} GPU(s) to use here ({gpu_ids})")
    settings = {"attention_backend": args.attention_backend, "gpu_memory_utilization": args.gpu_memory_utilization,
                "max_num_seqs": args.max_num_seqs, "model_runner": args.model_runner, "block_size": args.block_size,
                "kv_cache_layout": args.kv_cache_layout, "tensor_parallel_size": tp}  # fmt: skip
    name = report.results_name(args.model, shape_names, settings)
    state_path = args.work / name
    header = report.report_header(args.model, shape_names, repeats, settings)
    # Variants already measured (an earlier call on this machine, or --merge) are kept, so one
    # run can be completed over several calls; every variant shares model and prompts.
    if args.merge and not args.merge.exists():
        parser.error(f"--merge {args.merge}: no such file")
    earlier = args.merge or (state_path if state_path.exists() else None)
    try:
        results = report.load_report(earlier, header) if earlier else None
    except report.MergeError as exc:
        parser.error(str(exc))
    bf16_dir, fp8_dir = checkpoints.checkpoint_dirs(args.model, args.models)
    created = checkpoints.prepare_checkpoints(args.model, bf16_dir, fp8_dir)
    results = results or {**header, **created, "variants": {}}
    args.work.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    shapes = runner.make_shapes(shape_names, repeats, checkpoints.MODELS[args.model].config["vocab_size"])
    pending = deque(v for v in variants if "by_shape" not in results["variants"].get(v, {}))
    for variant in variants:
        if variant not in pending:
            print(f"{variant}: kept from {earlier}", flush=True)
    failed: list[str] = []
    lock = threading.Lock()

    # the one host GPU a single-GPU call was given (CUDA_VISIBLE_DEVICES=2: [2]), recorded with each run
    only_gpu = gpu_ids if len(gpu_ids) == 1 else None

    def measure_on(gpus: list[int] | None) -> None:
        """Measure pending variants one after another on the host's GPUs `gpus`, one engine's
        (None: the environment's GPUs)."""
        while True:
            with lock:
                if not pending:
                    return
                variant = pending.popleft()
            run = report.run_info(results["device"], gpus if gpus is not None else only_gpu)
            spec = runner.variant_spec(variant, args.model, bf16_dir, fp8_dir, shapes, settings, args.deepgemm_cache,
                                       flashinfer_jit=not os.environ.get("FLASHINFER_DISABLE_JIT"))  # fmt: skip
            if gpus is not None:
                spec["env"] = {**spec["env"], "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            try:
                result = runner.run_variant(variant, spec, args.work / variant)
            except runner.VariantError as exc:  # recorded in the report and in the exit status
                result = {"error": str(exc)}
                with lock:
                    failed.append(variant)
            with lock:
                results["variants"][variant] = {**result, "run": run}
                report.save(results, [state_path, args.results / name])
                print(json.dumps({variant: results["variants"][variant]})[:3000], flush=True)

    if gpu_count == 1:
        measure_on(None)
    else:  # one thread per engine, each on the next `tp` GPUs
        threads = [threading.Thread(target=measure_on, args=(gpu_ids[i : i + tp],)) for i in range(0, gpu_count, tp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    # The report's order: variants of earlier calls, then this call's as asked (not as they finished).
    order = [v for v in results["variants"] if v not in variants] + [v for v in variants if v in results["variants"]]
    results["variants"] = {v: results["variants"][v] for v in order}
    report.save(results, [state_path, args.results / name])
    report.print_table(results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
