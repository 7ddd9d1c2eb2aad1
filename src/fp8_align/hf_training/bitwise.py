"""The trainer half of `FP8Config(on_policy="bitwise")`: an HF Llama/Qwen2/Qwen3 model's forward run
kernel for kernel as a bitwise vLLM engine runs it, so its token log-probs are the engine's bits.

`BitwiseForward(model, cfg)` reads the model's own Parameters (optimizers, state dicts and weight
sync see the usual tensors) and computes, over packed sequences: embedding, RMSNorm with the fused
residual add, the projections (block FP8 through the plugin's fixed-tile GEMM for the layers the
recipe quantizes, vLLM's batch-invariant matmul for BF16 ones), RMSNorm of q/k per head (Qwen3),
RoPE with the FP32 table, attention with vLLM's TRITON_ATTN kernel over a paged copy of K/V,
SiLU-and-mul, the final norm, lm_head and the log-softmax of the sampler. Each op is an autograd
function whose forward is the engine's kernel and whose backward is the gradient of the op's
pure-torch reference at the same inputs (FP8 projections: BF16 straight-through), so training runs.

On CUDA the kernels are the engine's (fp8_align's Triton operators and vLLM's, via
`vllm_plugin.compat.batch_invariant_kernels`); on CPU every op runs its pure-torch reference, which
no CPU engine shares (a CPU engine refuses `on_policy="bitwise"`): the CPU path checks the plumbing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fp8_align.bitwise.ops  # noqa: F401  (registers torch.ops.fp8_align.bitwise_*)
from fp8_align.bitwise import MODEL_TYPES
from fp8_align.bitwise.reference import (
    RopeSpec,
    apply_rope,
    fused_add_rms_norm_reference,
    rms_norm_reference,
    rope_table,
    silu_and_mul_reference,
)
from fp8_align.config import FP8Config
from fp8_align.hf_emulation import recipe_fp8_modules
from fp8_align.hf_training.linear import Fp8TrainingLinear, stacked_shard_sizes

#: KV-cache block size of the trainer's paged K/V copy (vLLM's default for TRITON_ATTN on CUDA).
ATTENTION_BLOCK_SIZE = 16


class UnsupportedModelError(ValueError):
    """A model family whose forward `BitwiseForward` does not reproduce."""


class _EngineOp(torch.autograd.Function):
    """Forward: `engine_fn(*inputs)`; backward: autograd of `reference_fn` at the same inputs."""

    @staticmethod
    def forward(ctx: Any, engine_fn: Callable[..., Any], reference_fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.reference_fn = reference_fn
        ctx.save_for_backward(*inputs)
        return engine_fn(*inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        inputs = [t.detach().requires_grad_(need and t.is_floating_point()) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        with torch.enable_grad():
            outputs = ctx.reference_fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        wanted = [t for t in inputs if t.requires_grad]
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) if pairs and wanted else [])
        return (None, None, *(next(found) if t.requires_grad else None for t in inputs))


def engine_op(engine_fn: Callable[..., Any], reference_fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
    """`engine_fn(*inputs)` with the backward of `reference_fn` (the same contract, pure torch)."""
    return _EngineOp.apply(engine_fn, reference_fn, *inputs)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int], head_size: int) -> torch.Tensor:
    """Causal attention of packed sequences: q [T, Hq * D], k/v [T, Hk * D] (grouped heads) ->
    [T, Hq * D] in q's dtype, softmax in FP32 with scale D ** -0.5. The sequences are padded into one
    [B, H, L, D] batch (one matmul per step for every sequence, so its backward is fast too)."""
    heads, kv_heads = q.shape[-1] // head_size, k.shape[-1] // head_size
    count, longest, device = len(seq_lens), max(seq_lens), q.device
    lengths = torch.tensor(list(seq_lens), device=device)
    row = torch.repeat_interleave(torch.arange(count, device=device), lengths)
    position = torch.arange(q.shape[0], device=device) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)

    def padded(x: torch.Tensor, num_heads: int) -> torch.Tensor:
        grid = x.new_zeros(count, longest, num_heads, head_size).index_put((row, position), x.reshape(-1, num_heads, head_size))
        return grid.transpose(1, 2).float()  # [B, H, L, D]

    qs = padded(q, heads)
    ks = padded(k, kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    vs = padded(v, kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    scores = (qs @ ks.transpose(-1, -2)) * head_size**-0.5
    keys = torch.arange(longest, device=device)
    allowed = (keys[None, :] <= keys[:, None])[None] & (keys[None, None, :] < lengths[:, None, None])  # [B, L, L]
    probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(dim=-1)
    out = (probs @ vs).transpose(1, 2)[row, position]  # [T, H, D]
    return out.reshape(q.shape[0], heads * head_size).to(q.dtype)


@dataclass(frozen=True)
class _Kernels:
    """The forward kernels of the ops that are not fp8_align's own: BF16 linear, log-softmax, attention."""

    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    log_softmax: Callable[[torch.Tensor], torch.Tensor]
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int], int], torch.Tensor]


def _reference_kernels() -> _Kernels:
    return _Kernels(F.linear, functools.partial(torch.log_softmax, dim=-1), attention_reference)


def _engine_kernels() -> _Kernels:
    """vLLM's own kernels of a batch-invariant CUDA engine (vLLM is required on CUDA)."""
    from fp8_align.vllm_plugin.compat import batch_invariant_kernels

    linear, log_softmax, unified_attention = batch_invariant_kernels()

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int], head_size: int) -> torch.Tensor:
        return paged_triton_attention(unified_attention, q, k, v, seq_lens, head_size)

    return _Kernels(linear, functools.partial(log_softmax, dim=-1), attention)


def paged_triton_attention(
    unified_attention: Callable[..., None], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int], head_size: int
) -> torch.Tensor:
    """`attention_reference`'s contract computed by vLLM's TRITON_ATTN kernel as a bitwise engine
    calls it: K/V copied into a paged cache of `ATTENTION_BLOCK_SIZE`-token blocks, every query of a
    sequence attending to its prefix, scales 1.0 (BF16 cache), softmax scale D ** -0.5."""
    tokens, device = q.shape[0], q.device
    heads, kv_heads = q.shape[-1] // head_size, k.shape[-1] // head_size
    blocks = [-(-length // ATTENTION_BLOCK_SIZE) for length in seq_lens]
    block_table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    slots, first = [], 0
    for i, (length, count) in enumerate(zip(seq_lens, blocks)):
        block_table[i, :count] = torch.arange(first, first + count, dtype=torch.int32)
        slots.append(torch.arange(length) + first * ATTENTION_BLOCK_SIZE)
        first += count
    slot = torch.cat(slots).to(device)
    key_cache = torch.zeros(first * ATTENTION_BLOCK_SIZE, kv_heads, head_size, dtype=k.dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    key_cache[slot] = k.reshape(tokens, kv_heads, head_size)
    value_cache[slot] = v.reshape(tokens, kv_heads, head_size)
    lengths = torch.tensor(list(seq_lens), dtype=torch.int32)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0, dtype=torch.int32)]).to(device)
    unit = torch.ones(1, dtype=torch.float32, device=device).expand(len(seq_lens), kv_heads)
    out = torch.empty(tokens, heads, head_size, dtype=q.dtype, device=device)
    unified_attention(
        q=q.reshape(tokens, heads, head_size).contiguous(),
        k=key_cache.view(first, ATTENTION_BLOCK_SIZE, kv_heads, head_size),
        v=value_cache.view(first, ATTENTION_BLOCK_SIZE, kv_heads, head_size),
        out=out, cu_seqlens_q=cu_seqlens, max_seqlen_q=max(seq_lens), seqused_k=lengths.to(device),
        max_seqlen_k=max(seq_lens), softmax_scale=head_size**-0.5, causal=True, window_size=(-1, -1),
        block_table=block_table.to(device), softcap=0, q_descale=None, k_descale=unit, v_descale=unit,
    )  # fmt: skip
    return out.reshape(tokens, heads * head_size)


class BitwiseForward:
    """Token log-probs of packed sequences through the engine's kernels, with gradients.

    `model`: an HF `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` in BF16 on one
    device; `cfg`: the engine's FP8Config (`on_policy="bitwise"`; its recipe picks the FP8 layers).
    Other model families raise UnsupportedModelError.
    """

    def __init__(self, model: nn.Module, cfg: FP8Config) -> None:
        config = model.config.get_text_config()
        if config.model_type not in MODEL_TYPES:
            raise UnsupportedModelError(
                f"BitwiseForward reproduces vLLM's {', '.join(MODEL_TYPES)} forward; this model is {config.model_type!r}"
            )
        if cfg.on_policy != "bitwise":
            raise ValueError("BitwiseForward computes what an FP8Config(on_policy='bitwise') engine computes; set on_policy='bitwise'")
        self.model, self.cfg, self.config = model, cfg, config
        self.head_size = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.rope = RopeSpec.from_hf_config(config)
        self.device = next(model.parameters()).device
        self.kernels = _engine_kernels() if self.device.type == "cuda" else _reference_kernels()
        self.table = rope_table(self.rope, self.device)
        kernel = "engine" if self.device.type == "cuda" else "emulation"
        self.fp8 = {
            name: Fp8TrainingLinear(module, cfg, kernel, name, stacked_shard_sizes(model, name))
            for name, module in (recipe_fp8_modules(model, cfg, config.num_hidden_layers) if cfg.precision == "fp8" else [])
        }

    # ------------------------------------------------------------------ ops
    def _linear(self, name: str, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if name in self.fp8:
            return self.fp8[name](x)
        inputs = (x, module.weight) if module.bias is None else (x, module.weight, module.bias)
        return engine_op(self.kernels.linear, F.linear, *inputs)

    def _norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None = None) -> Any:
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", self.config.rms_norm_eps)))
        if residual is None:
            return engine_op(functools.partial(torch.ops.fp8_align.bitwise_rms_norm, eps=eps), functools.partial(rms_norm_reference, eps=eps), x, norm.weight)
        return engine_op(
            functools.partial(torch.ops.fp8_align.bitwise_fused_add_rms_norm, eps=eps),
            functools.partial(fused_add_rms_norm_reference, eps=eps), x, residual, norm.weight,
        )  # fmt: skip

    def _rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size, rotary = self.head_size, self.rope.rotary_dim

        def reference(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return apply_rope(positions, q, self.table, size, rotary), apply_rope(positions, k, self.table, size, rotary)

        def kernel(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.ops.fp8_align.bitwise_rope(positions, q, k, self.table, size, rotary)

        return engine_op(kernel, reference, q, k)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        return engine_op(
            functools.partial(self.kernels.attention, seq_lens=seq_lens, head_size=self.head_size),
            functools.partial(attention_reference, seq_lens=seq_lens, head_size=self.head_size), q, k, v,
        )  # fmt: skip

    def _layer(self, index: int, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = f"model.layers.{index}"
        if residual is None:
            residual, x = h, self._norm(h, layer.input_layernorm)
        else:
            x, residual = self._norm(h, layer.input_layernorm, residual)
        attn = layer.self_attn
        q = self._linear(f"{prefix}.self_attn.q_proj", attn.q_proj, x)
        k = self._linear(f"{prefix}.self_attn.k_proj", attn.k_proj, x)
        v = self._linear(f"{prefix}.self_attn.v_proj", attn.v_proj, x)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm of every head before RoPE
            q = self._norm(q.reshape(q.shape[0], -1, self.head_size), attn.q_norm).reshape(q.shape)
            k = self._norm(k.reshape(k.shape[0], -1, self.head_size), attn.k_norm).reshape(k.shape)
        q, k = self._rope(positions, q, k)
        h = self._linear(f"{prefix}.self_attn.o_proj", attn.o_proj, self._attention(q, k, v, seq_lens))
        x, residual = self._norm(h, layer.post_attention_layernorm, residual)
        mlp = layer.mlp
        gate_up = torch.cat((self._linear(f"{prefix}.mlp.gate_proj", mlp.gate_proj, x), self._linear(f"{prefix}.mlp.up_proj", mlp.up_proj, x)), dim=-1)
        act = engine_op(torch.ops.fp8_align.bitwise_silu_and_mul, silu_and_mul_reference, gate_up)
        return self._linear(f"{prefix}.mlp.down_proj", mlp.down_proj, act), residual

    # ------------------------------------------------------------------ public
    def hidden_states(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Final normed hidden states [sum(len), hidden] (BF16) of the packed `sequences` (token ids)."""
        seq_lens = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in seq_lens])
        inner = self.model.model
        h = F.embedding(ids, inner.embed_tokens.weight)
        residual = None
        for index, layer in enumerate(inner.layers):
            h, residual = self._layer(index, layer, h, residual, positions, seq_lens)
        return self._norm(h, inner.norm, residual)[0]

    def token_logprobs(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], chunk_rows: int = 2048) -> list[torch.Tensor]:
        """Per sequence, FP32 [len - prompt_len] log-probs of its tokens after the prompt, each given
        its prefix, as the engine's sampler returns them (`logprobs` of the sampled tokens).
        lm_head and log-softmax run on `chunk_rows` rows at a time."""
        hidden = self.hidden_states(sequences)
        rows, targets, start = [], [], 0
        for seq, prompt in zip(sequences, prompt_lens):
            if not 0 < prompt <= len(seq):
                raise ValueError(f"prompt_len {prompt} is outside 1..{len(seq)}")
            rows.append(torch.arange(start + prompt - 1, start + len(seq) - 1))
            targets.extend(seq[prompt:])
            start += len(seq)
        row_index = torch.cat(rows).to(self.device)
        target = torch.tensor(targets, dtype=torch.long, device=self.device)
        head = self.model.lm_head
        picked = []
        for chunk in range(0, row_index.numel(), chunk_rows):
            part = slice(chunk, chunk + chunk_rows)
            logits = engine_op(self.kernels.linear, F.linear, hidden[row_index[part]], head.weight)
            logprobs = engine_op(self.kernels.log_softmax, functools.partial(torch.log_softmax, dim=-1), logits.float())
            picked.append(logprobs.gather(1, target[part, None])[:, 0])
        return list(torch.cat(picked).split([len(s) - p for s, p in zip(sequences, prompt_lens)]))
