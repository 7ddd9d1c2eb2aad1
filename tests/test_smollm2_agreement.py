"""vLLM + fp8_align on a real trained model (SmolLM2-135M-Instruct) against the HF "training side".

One FP8 engine generates greedily; the same tokens are scored by HF transformers with
fp8_align's block-FP8 emulation (aligned) and in BF16 (misaligned).
"""

from __future__ import annotations

import pytest
import torch

from fp8_align import FP8Config
from fp8_align.error_bench.generate import run_generation
from fp8_align.hf_emulation import apply_fp8_emulation
from fp8_align.metrics import token_mult_prob_error
from fp8_align.error_bench.default_model import smollm2_checkpoint

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is 12 times 7? Answer briefly.",
    "A train travels 60 km in 1.5 hours. What is its average speed?",
    "Convert 3 kilometers to meters and explain in one sentence.",
    "If Tom has 5 apples and gives away 2, how many are left?",
]
NEW_TOKENS = 32


def _score(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Log-probs [len(completion)] (FP32) the HF model gives each completion token."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.fixture(scope="module")
def smollm2_fp8_run(tmp_path_factory):
    from transformers import AutoTokenizer

    checkpoint = smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for q in QUESTIONS
    ]
    run = run_generation(
        {"model": str(checkpoint), "fp8_config": {}, "prompts": prompts, "max_tokens": NEW_TOKENS,
         "llm_kwargs": {"gpu_memory_utilization": 0.25, "max_model_len": 512, "max_num_batched_tokens": 512, "compilation_config": {"mode": 0}}},
        tmp_path_factory.mktemp("smollm2") / "fp8.pt",
    )
    return checkpoint, run


def test_fp8_generation_agrees_with_aligned_training_side(smollm2_fp8_run):
    """Tolerance. The two sides share every FP8 code and scale of every linear (checked bit for
    bit in test_vllm_plugin.py) but not attention and norm kernels: on this harness BF16 vLLM vs
    BF16 HF measured a token multiplicative probability error of ~1.02-1.03. FP8 activation
    rounding amplifies such upstream differences (a perturbation near a rounding boundary moves
    a code a whole E4M3 step, 2**-4 relative, 16x a BF16 step); measured ~1.08 here. We require
    <= 1.15 (about twice the measured excess over 1) and that the aligned training side is
    closer to generation than the misaligned BF16 one."""
    from transformers import AutoModelForCausalLM

    checkpoint, run = smollm2_fp8_run
    aligned = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    assert len(apply_fp8_emulation(aligned, FP8Config())) == 30 * 7
    misaligned = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    gen = torch.tensor([out["logprobs"] for out in run["outputs"]])
    train_aligned = torch.stack([_score(aligned, o["prompt_ids"], o["token_ids"]) for o in run["outputs"]])
    train_misaligned = torch.stack([_score(misaligned, o["prompt_ids"], o["token_ids"]) for o in run["outputs"]])
    mask = torch.ones_like(gen, dtype=torch.bool)
    err_aligned = float(token_mult_prob_error(train_aligned, gen, mask))
    err_misaligned = float(token_mult_prob_error(train_misaligned, gen, mask))
    assert gen.shape == (len(QUESTIONS), NEW_TOKENS)
    assert err_aligned <= 1.15, err_aligned
    assert err_aligned < err_misaligned, (err_aligned, err_misaligned)
