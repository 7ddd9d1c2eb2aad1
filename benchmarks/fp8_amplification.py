"""FP8 re-rounding amplifies BF16-level differences of the non-GEMM operators (issue #17's residual), CPU.

    python -m benchmarks.fp8_amplification [--num-prompts 16] [--max-new-tokens 64] [--results DIR]

An engine and a training side with the same quantizer and the same GEMM kernels still differ by
more than BF16/BF16 in token mult. prob. error (benchmarks/results_log.md, session 10). This
measures the mechanism proposed for that residual, with one engine only (HF transformers, CPU):
two forwards of SmolLM2-135M-Instruct over the same tokens that differ in one non-GEMM operator,
computed two ways that agree to BF16 rounding, as HF and vLLM compute them:

    rmsnorm    HF: y = weight * bf16(x * rsqrt(mean(x^2) + eps)) (two BF16 roundings);
               vLLM's fused kernel: bf16(x * rsqrt(mean(x^2) + eps) * weight) (one)
    silu_mul   HF: bf16(bf16(silu(gate)) * up) (two roundings); vLLM's silu_and_mul: bf16(silu(gate) * up) (one)
    both       the two at once

Each pair is scored in BF16 (BF16 linears on both sides) and in aligned block FP8 (fp8_align's
emulation on both sides: identical quantizer and GEMM), on the model's own greedy and sampled
completions of the benchmark prompts. Nothing differs between the two sides but the operator,
so the error of a pair is what that operator's rounding causes; FP8 over BF16 is the
amplification. Output: DIR/fp8_amplification.json and a table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

PERTURBATIONS = ("rmsnorm", "silu_mul", "both")


def rmsnorm_one_rounding(norm: nn.Module) -> None:
    """Make an HF RMSNorm round once, as vLLM's fused kernel: bf16(x * rsqrt(var + eps) * w)."""
    eps = norm.variance_epsilon

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight.float()
        return y.to(hidden_states.dtype)

    norm.forward = types.MethodType(forward, norm)


def silu_mul_one_rounding(mlp: nn.Module) -> None:
    """Make an HF gated MLP round silu(gate) * up once, as vLLM's silu_and_mul kernel."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj((nn.functional.silu(gate.float()) * up.float()).to(x.dtype))

    mlp.forward = types.MethodType(forward, mlp)


def perturbed(model: nn.Module, which: str) -> nn.Module:
    """A copy of `model` with the named operator(s) computed vLLM's way (see the module doc)."""
    copy_ = copy.deepcopy(model)
    for module in copy_.modules():
        kind = type(module).__name__
        if which in ("rmsnorm", "both") and kind.endswith("RMSNorm"):
            rmsnorm_one_rounding(module)
        if which in ("silu_mul", "both") and kind.endswith("MLP") and hasattr(module, "gate_proj"):
            silu_mul_one_rounding(module)
    return copy_


def generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, sample: bool, pad_id: int) -> list[list[int]]:
    """The model's own completions (greedy, or sampled at temperature 1 with seed 0), one per prompt."""
    torch.manual_seed(0)
    completions = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=sample,
                             temperature=1.0 if sample else None, top_p=None, top_k=None, pad_token_id=pad_id)  # fmt: skip
        completions.append(out[0, len(prompt) :].tolist())
    return completions


def run(num_prompts: int, max_new_tokens: int, say: Callable[[str], None] = print) -> dict:
    """Every (perturbation, precision, sampling) pair's mismatch metrics; see the module doc."""
    from transformers import AutoModelForCausalLM

    from fp8_align.error_bench.prompts import default_prompts_path, read_prompt_records, tokenize_prompts
    from fp8_align.error_bench.scoring import completion_logprobs, fp8_model
    from fp8_align.config import FP8Config
    from fp8_align.metrics import mismatch_metrics
    from fp8_align.error_bench.default_model import smollm2_checkpoint

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    model_dir = smollm2_checkpoint()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()
    prompts = tokenize_prompts(read_prompt_records(default_prompts_path())[:num_prompts], model_dir, bf16.config.vocab_size)
    pad_id = bf16.config.eos_token_id if isinstance(bf16.config.eos_token_id, int) else 0
    recipes = {"bf16": None, "fp8": FP8Config(), "fp8_pow2": FP8Config(use_weight_pow2_scale=True, use_activation_pow2_scale=True)}
    doc: dict = {"pairs": [], "reference": []}
    with torch.no_grad():
        for sampling in ("greedy", "sampled"):
            say(f"generating {sampling} completions")
            completions = generate(bf16, prompts, max_new_tokens, sampling == "sampled", pad_id)
            scored: dict[tuple[str, str], torch.Tensor] = {}
            mask = None
            for precision, cfg in recipes.items():
                base = bf16 if cfg is None else fp8_model(bf16, cfg)
                for which in ("none", *PERTURBATIONS):
                    model = base if which == "none" else perturbed(base, which)
                    say(f"  {sampling} {precision} {which}")
                    scored[precision, which], mask = completion_logprobs(model, prompts, completions)
            for precision in recipes:
                for which in PERTURBATIONS:
                    metrics = mismatch_metrics(scored[precision, which], scored[precision, "none"], mask)
                    doc["pairs"].append({"sampling": sampling, "precision": precision, "perturbation": which, **vars(metrics)})
                if precision != "bf16":  # the size of FP8 itself: BF16 vs FP8 forward, HF way on both
                    metrics = mismatch_metrics(scored[precision, "none"], scored["bf16", "none"], mask)
                    doc["reference"].append({"sampling": sampling, "pair": f"{precision} vs bf16", **vars(metrics)})
    doc.update({
        "model": str(model_dir.name), "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
        "command": " ".join(["python", "-m", "benchmarks.fp8_amplification", *sys.argv[1:]]),
    })  # fmt: skip
    return doc


def table(doc: dict) -> str:
    """Markdown: mult. prob. error of each perturbation, BF16 vs FP8, greedy / sampled."""
    rows = ["| perturbation | precision | greedy | sampled | max abs dlogp greedy / sampled |", "|---|---|---:|---:|---|"]
    index = {(p["sampling"], p["precision"], p["perturbation"]): p for p in doc["pairs"]}
    for which in PERTURBATIONS:
        for precision in ("bf16", "fp8", "fp8_pow2"):
            g, s = index["greedy", precision, which], index["sampled", precision, which]
            rows.append(f"| {which} | {precision} | {g['mult_prob_error']:.4f} | {s['mult_prob_error']:.4f} | "
                        f"{g['max_abs_log_ratio']:.3f} / {s['max_abs_log_ratio']:.3f} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    doc = run(args.num_prompts, args.max_new_tokens)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "fp8_amplification.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
