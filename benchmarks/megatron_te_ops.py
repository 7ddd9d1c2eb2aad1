"""Which ops of the Megatron-TE training forward differ from the bitwise engine's, and by how much (GPU).

    NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 python benchmarks/megatron_te_ops.py --out benchmarks/results/megatron_te_ops.json
    python benchmarks/megatron_te_ops.py --spec local --device cpu --out /tmp/ops.json    # CPU dry run (BF16, references)

SmolLM2-135M-Instruct mapped onto megatron-core's GPTModel with TransformerEngine layers
(`fp8_align.megatron_ext.hf_bridge`), in BF16 and with the FP8 settings fp8_align gives Megatron for
`FP8Config(on_policy="bitwise")` (TE Float8BlockScaling; pow2 or FP32 scales as TE was imported).
One forward over one sequence of `--tokens` tokens of the shipped chat prompts, with hooks on one
decoder layer's modules and on the final norm and output layer. Each captured op is recomputed from
its captured input by the kernel the bitwise vLLM engine runs for it (the trainer's
`hf_training.BitwiseForward` runs the same), and the two outputs are compared: share of elements
whose bits differ, max |difference|. Ops: linear_qkv (TE's fused RMSNorm + GEMM vs fp8_align's
RMSNorm then the fixed-tile FP8 GEMM or vLLM's batch-invariant matmul, on Megatron's own QKV weight),
RoPE (Megatron's rotation vs fp8_align's with the FP32 table from config.json), core attention
(TE's DotProductAttention vs vLLM's TRITON_ATTN), linear_proj, linear_fc1 (fused norm + GEMM),
SwiGLU (Megatron's vs fp8_align's SiLU-and-mul), linear_fc2, final_layernorm, output_layer. And end to
end: the token log-probs of the sequence, Megatron-TE vs BitwiseForward (whose log-probs are the
bitwise engine's, benchmarks/on_policy_bitwise.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fp8_align.bitwise.ops  # noqa: F401  (registers torch.ops.fp8_align.bitwise_*)
from fp8_align import FP8Config
from fp8_align.hf_training import BitwiseForward
from fp8_align.hf_training.attention import PackedBatch
from fp8_align.hf_training.linear import Fp8TrainingLinear


def compare(megatron: torch.Tensor, engine: torch.Tensor) -> dict[str, Any]:
    """Share of elements with other bits and max |difference| of two same-shaped tensors."""
    a, b = megatron.detach().reshape(-1), engine.detach().reshape(-1).to(megatron.dtype)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: megatron {tuple(megatron.shape)}, engine {tuple(engine.shape)}")
    differ = a.view(torch.int16 if a.element_size() == 2 else torch.int32) != b.view(torch.int16 if b.element_size() == 2 else torch.int32)
    return {
        "elements": a.numel(), "differing_share": round(float(differ.float().mean()), 6),
        "max_abs_diff": float((a.float() - b.float()).abs().max()), "dtype": str(a.dtype).replace("torch.", ""),
    }  # fmt: skip


def _copied(value: Any) -> Any:
    """`value` with every tensor in it cloned (Megatron adds the residual into a linear's output in place)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


class Capture:
    """Forward hooks that keep copies of the first call's positional inputs, keyword inputs and output of named modules."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.seen: dict[str, tuple[tuple[Any, ...], dict[str, Any], Any]] = {}
        self.handles = [m.register_forward_hook(self._hook(name), with_kwargs=True) for name, m in modules.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if name not in self.seen:
                self.seen[name] = (_copied(args), _copied(kwargs), _copied(output))

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _engine_linear(weight: torch.Tensor, cfg: FP8Config, bitwise: BitwiseForward, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The bitwise engine's linear over `weight` [N, K]: the fixed-tile FP8 GEMM (FP8 config) or vLLM's batch-invariant matmul."""
    if type(weight) not in (torch.Tensor, nn.Parameter):  # a TE QuantizedTensor (fp8_param) holds FP8 data
        weight = weight.dequantize()
    if cfg.precision == "fp8":
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        module = Fp8TrainingLinear(linear, cfg, "engine" if weight.is_cuda else "emulation", name, (weight.shape[0],))
        return lambda x: module(x)
    return lambda x: bitwise.kernels.linear(x, weight.detach().to(x.dtype), None)


def _norm_weight(linear: nn.Module) -> torch.Tensor | None:
    """The RMSNorm weight TE fuses into a LayerNormLinear, or None for a plain linear (its norm runs apart)."""
    weight = getattr(linear, "layer_norm_weight", None)
    return None if weight is None else weight.detach()


def op_rows(gpt: nn.Module, hf_config: Any, cfg: FP8Config, bitwise: BitwiseForward, ids: torch.Tensor, layer_index: int) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Per-op comparison rows for one forward of `gpt` over `ids` [1, S]; also returns its logits [1, S, V]."""
    layer = gpt.decoder.layers[layer_index]
    attn, mlp = layer.self_attention, layer.mlp
    watched = {
        "linear_qkv": attn.linear_qkv, "core_attention": attn.core_attention, "linear_proj": attn.linear_proj,
        "linear_fc1": mlp.linear_fc1, "linear_fc2": mlp.linear_fc2, "final_layernorm": gpt.decoder.final_layernorm,
        "output_layer": gpt.output_layer,
    }  # fmt: skip
    capture = Capture(watched)
    seq = ids.shape[1]
    with torch.no_grad():
        logits = gpt(ids, torch.arange(seq, device=ids.device)[None], attention_mask=None)
    capture.remove()
    eps = float(hf_config.rms_norm_eps)
    heads, kv_heads, size = int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads), bitwise.context.head_size
    rows: list[dict[str, Any]] = []

    def row(op: str, megatron_kernel: str, engine_kernel: str, fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            rows.append({"op": op, "megatron": megatron_kernel, "engine": engine_kernel, **compare(*fn())})
        except Exception as exc:  # recorded in the report and turned into a non-zero exit by main()
            rows.append({"op": op, "megatron": megatron_kernel, "engine": engine_kernel, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(rows[-1]), flush=True)

    def norm_then_linear(name: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            args, _, output = capture.seen[name]
            module = watched[name]
            x = args[0].reshape(-1, args[0].shape[-1])
            norm = _norm_weight(module)
            if norm is not None:
                x = torch.ops.fp8_align.bitwise_rms_norm(x, norm, eps)
            out = _first(output)
            return out, _engine_linear(module.weight, cfg, bitwise, name)(x).reshape(out.shape)

        return run

    gemm = "fixed-tile block-FP8 GEMM" if cfg.precision == "fp8" else "vLLM batch-invariant matmul"
    te_gemm = "TE Float8BlockScaling GEMM" if cfg.precision == "fp8" else "TE BF16 GEMM (cuBLAS)"
    fused = _norm_weight(attn.linear_qkv) is not None
    row("linear_qkv", f"{'TE fused RMSNorm + ' if fused else ''}{te_gemm}", f"{'RMSNorm, then ' if fused else ''}{gemm}", norm_then_linear("linear_qkv"))

    def split_qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mixed = _first(capture.seen["linear_qkv"][2])  # [S, B, groups * (heads/groups + 2) * size], Megatron's interleaving
        grouped = mixed.reshape(seq, kv_heads, (heads // kv_heads + 2) * size)
        q, k, v = grouped.split([heads // kv_heads * size, size, size], dim=-1)
        return q.reshape(seq, heads * size), k.reshape(seq, kv_heads * size), v.reshape(seq, kv_heads * size)

    def rope() -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = split_qkv()
        args, kwargs, _ = capture.seen["core_attention"]
        rotated = torch.cat([args[0].reshape(seq, -1), args[1].reshape(seq, -1)], dim=-1)
        positions = torch.arange(seq, device=q.device)
        q_engine, k_engine = torch.ops.fp8_align.bitwise_rope(positions, q.contiguous(), k.contiguous(), bitwise.context.table, size, bitwise.context.rope.rotary_dim)
        return rotated, torch.cat([q_engine, k_engine], dim=-1)

    row("rope", "Megatron apply_rotary_pos_emb (its FP32 inverse frequencies)", "fp8_align RoPE, FP32 table from config.json (float64 math)", rope)

    def attention() -> tuple[torch.Tensor, torch.Tensor]:
        args, _, output = capture.seen["core_attention"]
        q, k, v = (t.reshape(seq, -1).contiguous() for t in args[:3])
        return _first(output).reshape(seq, -1), bitwise.kernels.attention(q, k, v, PackedBatch.from_lengths([seq], q.device), size)

    row("core_attention", type(attn.core_attention).__name__, "vLLM TRITON_ATTN unified_attention (paged K/V)", attention)
    row("linear_proj", te_gemm, gemm, norm_then_linear("linear_proj"))
    fused = _norm_weight(mlp.linear_fc1) is not None
    row("linear_fc1", f"{'TE fused RMSNorm + ' if fused else ''}{te_gemm}", f"{'RMSNorm, then ' if fused else ''}{gemm}", norm_then_linear("linear_fc1"))

    def swiglu() -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = _first(capture.seen["linear_fc1"][2])
        activated = capture.seen["linear_fc2"][0][0]
        return activated.reshape(seq, -1), torch.ops.fp8_align.bitwise_silu_and_mul(gate_up.reshape(seq, -1).contiguous())

    row("swiglu", "Megatron MLP activation (SiLU(gate) * up)", "fp8_align SiLU-and-mul (FP32, one rounding)", swiglu)
    row("linear_fc2", te_gemm, gemm, norm_then_linear("linear_fc2"))

    def final_norm() -> tuple[torch.Tensor, torch.Tensor]:
        args, _, output = capture.seen["final_layernorm"]
        x = args[0].reshape(seq, -1)
        return _first(output).reshape(seq, -1), torch.ops.fp8_align.bitwise_rms_norm(x, gpt.decoder.final_layernorm.weight.detach(), eps)

    row("final_layernorm", type(gpt.decoder.final_layernorm).__name__, "fp8_align RMSNorm", final_norm)

    def output_layer() -> tuple[torch.Tensor, torch.Tensor]:
        args, kwargs, output = capture.seen["output_layer"]
        weight = kwargs.get("weight")
        weight = gpt.output_layer.weight if weight is None else weight
        x = args[0].reshape(seq, -1)
        return _first(output).reshape(seq, -1), bitwise.kernels.linear(x, weight.detach(), None)

    row("output_layer", "Megatron ColumnParallelLinear, BF16 (cuBLAS)", "vLLM batch-invariant matmul", output_layer)
    return rows, logits


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """FP32 log-probs [S - 1] of tokens 1..S-1 of `ids` [1, S] from `logits` [1, S, V]."""
    return torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]


def end_to_end(megatron: torch.Tensor, engine: torch.Tensor) -> dict[str, Any]:
    """max |dlogp| and token multiplicative probability error of two [T] log-prob vectors."""
    diff = (megatron - engine).abs()
    return {"tokens": diff.numel(), "max_abs_dlogp": float(diff.max()), "mult_prob_error": float(torch.exp(diff).mean()),
            "tokens_with_nonzero_dlogp": int((diff != 0).sum())}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=256, help="sequence length (a multiple of 16: TE's FP8 GEMMs)")
    parser.add_argument("--layer", type=int, default=15, help="decoder layer whose ops are compared")
    parser.add_argument("--spec", choices=("transformer_engine", "local"), default="transformer_engine")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    if args.tokens % 16:
        parser.error("--tokens must be a multiple of 16")
    from transformers import AutoModelForCausalLM

    from fp8_align.error_bench.default_model import smollm2_checkpoint
    from fp8_align.error_bench.prompts import default_prompts_path, read_prompt_records, tokenize_prompts
    from fp8_align.megatron_ext.hf_bridge import build_megatron_gpt
    from fp8_align.megatron_ext.te_emulation import te_pow2_scales_from_env

    path = smollm2_checkpoint()
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(args.device).eval()
    chats = tokenize_prompts(read_prompt_records(default_prompts_path()), path, int(hf_model.config.vocab_size))
    tokens = [t for chat in chats for t in chat][: args.tokens]
    ids = torch.tensor([tokens], device=args.device)
    pow2 = te_pow2_scales_from_env() if args.spec == "transformer_engine" else False
    precisions = ("bf16", "fp8") if args.spec == "transformer_engine" else ("bf16",)
    report: dict[str, Any] = {
        "command": " ".join(["megatron_te_ops.py", *(argv if argv is not None else sys.argv[1:])]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "spec": args.spec, "model": "SmolLM2-135M-Instruct", "tokens": len(tokens), "layer": args.layer,
        "fp8_scales": "power-of-two" if pow2 else "FP32", "ops": [], "end_to_end": [],
    }  # fmt: skip
    report["versions"] = {name: _version(name) for name in ("megatron-core", "transformer_engine", "vllm")}
    for precision in precisions:
        cfg = FP8Config(on_policy="bitwise", precision=precision, use_weight_pow2_scale=pow2, use_activation_pow2_scale=pow2)
        bitwise = BitwiseForward(hf_model, cfg)
        gpt = build_megatron_gpt(hf_model, cfg if precision == "fp8" else None, spec=args.spec)
        rows, logits = op_rows(gpt, hf_model.config, cfg, bitwise, ids, args.layer)
        report["ops"] += [{"precision": precision, **r} for r in rows]
        with torch.no_grad():
            (engine,) = bitwise.token_logprobs([tokens], [1])
        report["end_to_end"].append({"precision": precision, "pair": "Megatron-TE vs BitwiseForward (= the bitwise engine)",
                                     **end_to_end(token_logprobs(logits, ids), engine)})  # fmt: skip
        print(json.dumps(report["end_to_end"][-1]), flush=True)
        del gpt
        args.out.write_text(json.dumps(report, indent=1))
    failed = [r for r in report["ops"] if "error" in r]
    args.out.write_text(json.dumps(report, indent=1))
    return 1 if failed or any(math.isnan(r["max_abs_dlogp"]) for r in report["end_to_end"]) else 0


def _version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
