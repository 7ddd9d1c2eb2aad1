"""Bit-identity of fp8_align's block-FP8 quantization against the real TransformerEngine (GPU box).

For SmolLM2-135M-Instruct (the default model) in one process, under the scale rounding TE was
imported with (NVTE_FP8_BLOCK_SCALING_FP32_SCALES: "1" FP32, otherwise power of two):

- weights: every decoder linear in HF layout, TE's `Float8BlockQuantizer` (128x128) vs
  `fp8_align.quant.quantize_weight_blockwise` (`alignment_report(training_quantizer=
  "transformer_engine")`): fraction of E4M3 codes and block scales bitwise equal;
- Megatron's fused layouts: TE quantizes linear_qkv (interleaved per query group) and linear_fc1
  ([gate; up]) as single matrices, while vLLM quantizes q/k/v and gate/up on their own grids:
  fraction of dequantized weight values equal, mapped back to the HF layout;
- activations: the inputs of every FP8 linear in a BF16 HF forward over the benchmark's prompts,
  TE's 1x128 quantizer vs fp8_align's torch reference (`quantize_activation_groupwise`) and the
  plugin's Triton kernel (`quantize_activation_triton`, what vLLM runs): codes and scales.

Every generation-side comparison is made for both of fp8_align's scale rules (`FP8Config.scale_rule`):
"amax_over_max" (scale_inv = amax / 448, codes x / scale_inv) and "transformer_engine" (TE's own).

    python -m benchmarks.te_alignment --out benchmarks/results/te_alignment_pow2.json
    NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 python -m benchmarks.te_alignment --out .../te_alignment_fp32.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
from pathlib import Path
from typing import Any

import torch

from fp8_align import FP8Config
from fp8_align.megatron_ext import alignment_report, te_pow2_scales_from_env
from fp8_align.megatron_ext.alignment import transformer_engine_quantize
from fp8_align.megatron_ext.hf_bridge import head_dim, megatron_state_dict_from_hf
from fp8_align.quant import dequantize_blockwise, quantize_activation_groupwise, quantize_weight_blockwise
from fp8_align.rounding import SCALE_RULES


def fused_layout_agreement(hf_state: dict[str, torch.Tensor], hf_config: Any, pow2: bool, rule: str) -> dict[str, Any]:
    """Per fused Megatron matrix: fraction of dequantized values equal to vLLM's per-shard quantization."""
    mapped = megatron_state_dict_from_hf(hf_state, hf_config, fused_norms=True)
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    d, hidden = head_dim(hf_config), hf_config.hidden_size
    rows: dict[str, list[float]] = {"linear_qkv": [], "linear_fc1": []}
    for i in range(hf_config.num_hidden_layers):
        hf = f"model.layers.{i}."
        for fused, shards in (("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              ("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj"))):
            w = mapped[f"decoder.layers.{i}.{fused}.weight"].cuda()
            codes, scales = transformer_engine_quantize(w, pow2, 2)
            te_values = dequantize_blockwise(codes, scales.contiguous(), dtype=torch.float32)
            gen_values = []
            for shard in shards:
                c, s = quantize_weight_blockwise(hf_state[hf + shard + ".weight"].cuda(), pow2_scale=pow2, scale_rule=rule)
                gen_values.append(dequantize_blockwise(c, s, dtype=torch.float32))
            if fused.endswith("linear_qkv"):
                q, k, v = gen_values
                gen = torch.cat([q.view(groups, heads // groups * d, hidden), k.view(groups, d, hidden), v.view(groups, d, hidden)], 1)
                gen = gen.reshape(-1, hidden)
            else:
                gen = torch.cat(gen_values)
            rows[fused.split(".")[1]].append((te_values == gen).double().mean().item())
    return {
        name: {"values_equal_mean": sum(v) / len(v), "values_equal_min": min(v), "layers": len(v)}
        for name, v in rows.items()
    } | {"head_dim": d, "note": "1.0 = TE's fused-matrix codes x scales equal vLLM's per-shard quantization everywhere"}


def activation_agreement(model: torch.nn.Module, prompts: list[list[int]], pow2: bool, rule: str) -> dict[str, Any]:
    """Inputs of every FP8 linear over `prompts`: TE 1x128 vs fp8_align's reference and Triton kernel."""
    from fp8_align.quant.triton_groupwise import ScaleLayout, quantize_activation_triton

    captured: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("q_proj", "o_proj", "gate_proj", "down_proj"):  # k/v and up share the input
            hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: captured.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        for ids in prompts:
            model(input_ids=torch.tensor([ids], device="cuda"))
    for h in hooks:
        h.remove()
    totals = {"values": 0, "te_vs_reference_codes": 0, "te_vs_reference_scales": 0, "groups": 0,
              "triton_vs_reference_codes": 0, "triton_vs_reference_scales": 0}  # fmt: skip
    worst: dict[str, float] = {}
    for name, chunks in captured.items():
        x = torch.cat(chunks).contiguous()
        te_codes, te_scales = transformer_engine_quantize(x, pow2, 1)
        ref_codes, ref_scales = quantize_activation_groupwise(x, pow2_scale=pow2, scale_rule=rule)
        tri_codes, tri_scales = quantize_activation_triton(x, pow2, ScaleLayout.ROW_MAJOR.value, rule)
        eq = (te_codes.view(torch.uint8) == ref_codes.view(torch.uint8))
        totals["values"] += x.numel()
        totals["te_vs_reference_codes"] += int(eq.sum())
        totals["te_vs_reference_scales"] += int((te_scales == ref_scales).sum())
        totals["groups"] += ref_scales.numel()
        totals["triton_vs_reference_codes"] += int((tri_codes.view(torch.uint8) == ref_codes.view(torch.uint8)).sum())
        totals["triton_vs_reference_scales"] += int((tri_scales == ref_scales).sum())
        worst[name] = eq.double().mean().item()
    return {
        "num_linear_inputs": len(captured),
        "num_values": totals["values"],
        "num_groups": totals["groups"],
        "te_vs_reference_codes_equal": totals["te_vs_reference_codes"] / totals["values"],
        "te_vs_reference_scales_equal": totals["te_vs_reference_scales"] / totals["groups"],
        "triton_vs_reference_codes_equal": totals["triton_vs_reference_codes"] / totals["values"],
        "triton_vs_reference_scales_equal": totals["triton_vs_reference_scales"] / totals["groups"],
        "min_codes_equal_per_linear": min(worst.values()),
    }


def weight_agreement(state: dict[str, torch.Tensor], num_layers: int, pow2: bool, rule: str) -> dict[str, Any]:
    """`alignment_report` against TE's real quantizer for every decoder linear (HF layout)."""
    cfg = FP8Config(use_weight_pow2_scale=pow2, use_activation_pow2_scale=pow2, scale_rule=rule)
    report = alignment_report(state, cfg, training_quantizer="transformer_engine", num_layers=num_layers)
    return {
        "training_quantizer": report.training_quantizer,
        "num_compared": len(report.compared),
        "codes_equal": report.codes_equal,
        "scales_equal": report.scales_equal,
        "max_scale_rel_diff": report.max_scale_rel_diff,
        "bitwise_aligned": report.bitwise_aligned,
    }


def _reported(section: Any, *args: Any) -> dict[str, Any]:
    """Run one section; if it fails, its result is the exact error (printed too), not a silent gap."""
    import traceback

    try:
        return section(*args)
    except Exception as exc:  # noqa: BLE001 - reported in the result document
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-prompts", type=int, default=16)
    args = parser.parse_args()

    import transformer_engine  # noqa: F401  (fixes the rounding from the environment)
    from transformers import AutoModelForCausalLM

    from fp8_align.error_bench.prompts import default_prompts_path, read_prompt_records, tokenize_prompts
    from fp8_align.error_bench.default_model import smollm2_checkpoint

    pow2 = te_pow2_scales_from_env()
    path = smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    state = {k: v for k, v in model.state_dict().items()}
    prompts = tokenize_prompts(read_prompt_records(default_prompts_path())[: args.num_prompts], path, model.config.vocab_size)
    doc = {
        "schema": "fp8_align.te_alignment/2",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "versions": {p: md.version(p) for p in ("transformer_engine", "transformer_engine_torch", "megatron-core", "torch")},
        "model": "SmolLM2-135M-Instruct (BF16)",
        "rounding": "power-of-two" if pow2 else "FP32",
        "by_scale_rule": {
            rule: {
                "weights_hf_layout": _reported(weight_agreement, state, model.config.num_hidden_layers, pow2, rule),
                "weights_megatron_fused_layout": _reported(fused_layout_agreement, state, model.config, pow2, rule),
                "activations": _reported(activation_agreement, model, prompts, pow2, rule),
            }
            for rule in SCALE_RULES
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
