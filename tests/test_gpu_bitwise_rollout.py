"""Bitwise on-policy under the conditions a real rollout meets (GPU, vLLM 0.22, SmolLM2-135M-Instruct
from benchmarks/box/gpu_model_setup.sh), with the BF16 and with the FP8 KV cache:

- prompts longer than the engine's token budget per step (`max_num_batched_tokens`), so each is
  prefilled in chunks over several steps (chunked prefill);
- a KV cache far too small for the batch, so requests are preempted and recomputed later
  (vLLM's preemption counter must move);
- eight samples per prompt (`n=8`) with top-p and top-k, each request with its own seed;
- completions of 1,100 tokens (EOS ignored).

With the FP8 cache the engine first calibrates its K/V scales on the prompts (`calibrate_kv_scales`),
and the trainer reads them back from the engine (`engine_kv_scales`), as an RL loop does every step.
Every generated token's engine log-prob must equal `BitwiseForward`'s, bit for bit. The whole-engine
proof across batch sizes is benchmarks/on_policy_bitwise.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fp8_align import FP8Config

pytestmark = pytest.mark.gpu

#: Tokens the engine computes per step: every prompt below is longer, so it is prefilled in chunks.
TOKEN_BUDGET = 256
PROMPT_LEN = 600
COMPLETION_LEN = 1100
SAMPLES = 8
PROMPTS = 4
#: KV-cache size in tokens: a sixth of what the 32 sequences of PROMPT_LEN + COMPLETION_LEN need.
CACHE_TOKENS = 9000
#: SmolLM2-135M: 30 layers x 3 KV heads x head size 64, K and V.
KV_ELEMENTS_PER_TOKEN = 30 * 3 * 64 * 2


def _prompts(path: Any) -> list[list[int]]:
    """PROMPTS prompts of PROMPT_LEN tokens, each a run of the packaged chat prompts (tokenized
    with the model's chat template) from a different start."""
    import json

    from fp8_align.error_bench.prompts import default_prompts_path, read_prompt_records, tokenize_prompts

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    stream = [t for chat in tokenize_prompts(read_prompt_records(default_prompts_path()), path, vocab) for t in chat]
    return [stream[i * 97 : i * 97 + PROMPT_LEN] for i in range(PROMPTS)]


@pytest.fixture(scope="module", params=["auto", "fp8"])
def rollout(request: pytest.FixtureRequest, vllm_runner: Any) -> Iterator[dict[str, Any]]:
    """One bitwise engine per KV-cache dtype: its rollout of every prompt (n=8, top-p/top-k), the
    preemptions it counted, and the K/V scales it generated with (FP8 cache: calibrated first)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align.error_bench.default_model import smollm2_checkpoint
    from fp8_align.vllm_plugin import calibrate_kv_scales, engine_kv_scales

    kv_cache_dtype = request.param
    path = smollm2_checkpoint()
    prompts = _prompts(path)
    cfg = FP8Config(on_policy="bitwise", kv_cache_dtype=kv_cache_dtype)
    cache_bytes = CACHE_TOKENS * KV_ELEMENTS_PER_TOKEN * (1 if kv_cache_dtype == "fp8" else 2)
    with vllm_runner(
        path, cfg, env={"VLLM_BATCH_INVARIANT": "1"}, max_model_len=PROMPT_LEN + COMPLETION_LEN, max_num_seqs=64,
        max_num_batched_tokens=TOKEN_BUDGET, kv_cache_memory_bytes=cache_bytes, gpu_memory_utilization=0.3, disable_log_stats=False,
    ) as runner:  # fmt: skip
        llm = runner.llm
        scales = None
        if kv_cache_dtype == "fp8":
            calibrate_kv_scales(llm, [p[:200] for p in prompts], include_q=False)
            scales = engine_kv_scales(llm)
        before = _preemptions(llm)
        params = [
            SamplingParams(n=SAMPLES, temperature=1.0, top_p=0.9, top_k=50, max_tokens=COMPLETION_LEN, ignore_eos=True, logprobs=0,
                           seed=100 + i, detokenize=False)
            for i in range(len(prompts))
        ]  # fmt: skip
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        yield {
            "kv_cache_dtype": kv_cache_dtype, "cfg": cfg, "path": path, "prompts": prompts, "outputs": outputs,
            "preemptions": _preemptions(llm) - before, "scales": scales,
        }  # fmt: skip


def _preemptions(llm: Any) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_the_rollout_met_every_condition(rollout: dict[str, Any]) -> None:
    """Chunked prefill (prompts over the token budget), preemptions, 8 distinct samples per prompt,
    1,100-token completions; with the FP8 cache, calibrated scales that are not vLLM's default 1.0."""
    assert PROMPT_LEN > TOKEN_BUDGET and all(len(p) == PROMPT_LEN for p in rollout["prompts"])
    assert rollout["preemptions"] > 0
    for out in rollout["outputs"]:
        completions = [tuple(c.token_ids) for c in out.outputs]
        assert len(completions) == SAMPLES and len(set(completions)) == SAMPLES
        assert all(len(c) == COMPLETION_LEN for c in completions)
    if rollout["scales"] is not None:
        assert all(s["k_scale"] != 1.0 and s["v_scale"] != 1.0 for s in rollout["scales"].values())


def test_every_token_is_the_trainers_bit_for_bit(rollout: dict[str, Any]) -> None:
    """BitwiseForward on the engine's sequences (4 per call) gives every generated token's engine
    log-prob exactly; printed for the results log: tokens compared, preemptions."""
    from transformers import AutoModelForCausalLM

    from fp8_align.hf_training import BitwiseForward

    model = AutoModelForCausalLM.from_pretrained(rollout["path"], dtype=torch.bfloat16).cuda().eval()
    trainer = BitwiseForward(model, rollout["cfg"], kv_scales=rollout["scales"])
    sequences, prompt_lens, engine = [], [], []
    for prompt, out in zip(rollout["prompts"], rollout["outputs"]):
        for completion in out.outputs:
            tokens = list(completion.token_ids)
            sequences.append(prompt + tokens)
            prompt_lens.append(len(prompt))
            engine.append([step[t].logprob for step, t in zip(completion.logprobs, tokens)])
    differing, tokens, worst = 0, 0, 0.0
    with torch.no_grad():
        for start in range(0, len(sequences), 4):
            part = slice(start, start + 4)
            for got, want in zip(trainer.token_logprobs(sequences[part], prompt_lens[part]), engine[part]):
                want_t = torch.tensor(want, dtype=torch.float32)
                diff = (got.cpu() - want_t).abs()
                differing += int((diff != 0).sum())
                tokens += diff.numel()
                worst = max(worst, float(diff.max()))
    print(f"kv_cache_dtype={rollout['kv_cache_dtype']}: {tokens} tokens, {differing} differing, max |dlogp| {worst}, "
          f"{rollout['preemptions']} preemptions")  # fmt: skip
    assert tokens == PROMPTS * SAMPLES * COMPLETION_LEN
    assert differing == 0 and worst == 0.0
