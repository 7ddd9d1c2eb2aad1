"""A Megatron Core GPTModel built from a Llama-family HF checkpoint: the real training side of a benchmark.

`build_megatron_gpt` turns an HF `LlamaForCausalLM`-style model (SmolLM2, Llama 2/3, Mistral
without sliding window, Qwen3 dense: RMSNorm, RoPE, SwiGLU, no biases, grouped-query attention) into a
megatron-core `GPTModel` with the same weights, either with TransformerEngine layers
(`spec="transformer_engine"`, what Megatron training runs and what runs block FP8) or with
megatron-core's own layers (`spec="local"`, BF16 only, runs without TE). The FP8 settings come
from the shared `FP8Config` through `transformer_config_kwargs`, so first/last BF16 layers and
the recipe are exactly what a Megatron training job would get.

Weight mapping (HF -> megatron-core, per decoder layer):
- q/k/v_proj -> `self_attention.linear_qkv.weight`, interleaved per query group:
  [group g: its q heads, its k head, its v head] (megatron-core's fused QKV layout);
- o_proj -> `linear_proj`; cat(gate_proj, up_proj) -> `mlp.linear_fc1`; down_proj -> `mlp.linear_fc2`;
- input/post-attention RMSNorm -> `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`
  (TE fuses the norm into the next linear) or `input_layernorm` / `pre_mlp_layernorm` (local);
- Qwen3's per-head q_norm / k_norm -> `self_attention.q_layernorm` / `k_layernorm` (megatron-core's
  `qk_layernorm`, applied per head before RoPE, as Qwen3 applies them);
- embed_tokens -> `embedding.word_embeddings`; norm -> `decoder.final_layernorm`; lm_head ->
  `output_layer` unless the embeddings are tied;
- Qwen3-MoE's sparse layers (`is_moe_layer`): the router `mlp.gate` -> `mlp.router`, expert e's
  rows of the fused `mlp.experts.gate_up_proj` [E, 2I, H] (gate then up) -> `mlp.experts.linear_fc1.weight<e>`
  and of `down_proj` [E, H, I] -> `mlp.experts.linear_fc2.weight<e>` (megatron-core's grouped-experts
  names). Only the bitwise spec has a module for them (`megatron_ext.bitwise`); `build_megatron_gpt`
  refuses MoE models.

The block-FP8 consequence of the QKV interleave: TE quantizes the fused [ng * (q/g + 2) * d, H]
matrix on one 128x128 grid, while vLLM quantizes q, k and v each on their own grid. The two grids
cover the same rows only when the head dim is a multiple of 128 (Qwen3, Llama 3); with head dim
64 (SmolLM2) TE's blocks mix heads of q, k and v, so its codes differ (`qkv_blocks_align`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from fp8_align.config import FP8Config
from fp8_align.megatron_ext.shim import transformer_config_kwargs

#: HF model types whose weights map onto megatron-core's GPT layers as described above.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen3")
#: MoE model types whose weights map too, onto the bitwise spec's `EngineMoE` (`allow_moe=True`).
MOE_MODEL_TYPES = ("qwen3_moe",)
#: Of those, the ones with a per-head RMSNorm of q and k before RoPE.
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
SPECS = ("transformer_engine", "local")
#: MegatronCausalLM pads sequence lengths to a multiple of this (TE FP8 GEMM shape rule).
TOKEN_MULTIPLE = 16


class MegatronBridgeError(ValueError):
    """The HF model cannot be represented by this bridge; the message says which property."""


def check_llama_family(hf_config: Any, allow_moe: bool = False) -> None:
    """Raise MegatronBridgeError unless `hf_config` is a Llama-style model the bridge maps exactly
    (with `allow_moe`, Qwen3-MoE too: its weight mapping, for the bitwise spec)."""
    model_type = getattr(hf_config, "model_type", None)
    supported = SUPPORTED_MODEL_TYPES + (MOE_MODEL_TYPES if allow_moe else ())
    problems = []
    if model_type not in supported:
        problems.append(f"model_type {model_type!r} (supported: {', '.join(supported)})")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        problems.append("linear biases")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r} (SwiGLU with silu only)")
    scaling = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if rope_type not in ("default", None):
        problems.append(f"rope scaling {rope_type!r}")
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True):
        problems.append("sliding-window attention")
    heads, groups = int(hf_config.num_attention_heads), int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
    if heads % groups:
        problems.append(f"{heads} query heads not divisible by {groups} KV heads")
    if problems:
        raise MegatronBridgeError("cannot map this HF model onto megatron-core GPT layers: " + "; ".join(problems))


def is_moe_layer(hf_config: Any, index: int) -> bool:
    """Whether decoder layer `index` of the HF model is a sparse MoE block (Qwen3-MoE's rule:
    experts exist, the layer is not in `mlp_only_layers`, and `index + 1` is a multiple of
    `decoder_sparse_step`)."""
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    return experts > 0 and index not in (getattr(hf_config, "mlp_only_layers", None) or []) and (index + 1) % step == 0


def head_dim(hf_config: Any) -> int:
    """Attention head size of an HF config (explicit `head_dim` or hidden / heads)."""
    return int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads)


def qkv_blocks_align(hf_config: Any, block: int = 128) -> bool:
    """Whether megatron's interleaved QKV rows fall on the same 128-row blocks as vLLM's q/k/v shards."""
    return head_dim(hf_config) % block == 0


def has_qk_norm(hf_config: Any) -> bool:
    """Whether the model normalizes q and k per head before RoPE (Qwen3)."""
    return getattr(hf_config, "model_type", None) in QK_NORM_MODEL_TYPES


def rope_theta(hf_config: Any) -> float:
    """RoPE base of an HF config (transformers 5 keeps it in `rope_parameters`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(hf_config, "rope_theta", 10000.0))


def megatron_config_kwargs(hf_config: Any, fp8_cfg: FP8Config | None, allow_moe: bool = False) -> dict[str, Any]:
    """`TransformerConfig(**kwargs)` for the HF model; `fp8_cfg` None (or precision bf16) trains in BF16.

    The FP8 fields come from `transformer_config_kwargs(fp8_cfg)`: the same fields any Megatron
    job using fp8_align sets. `allow_moe`: a Qwen3-MoE model too (the dense layers' sizes; its
    sparse layers are the bitwise spec's `EngineMoE`, which takes its own).
    """
    check_llama_family(hf_config, allow_moe)
    layers = int(hf_config.num_hidden_layers)
    kwargs: dict[str, Any] = {
        "num_layers": layers,
        "hidden_size": int(hf_config.hidden_size),
        "ffn_hidden_size": int(hf_config.intermediate_size),
        "num_attention_heads": int(hf_config.num_attention_heads),
        "num_query_groups": int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads),
        "kv_channels": head_dim(hf_config),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf_config.rms_norm_eps),
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": has_qk_norm(hf_config),
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "attention_softmax_in_fp32": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "use_cpu_initialization": True,
        "perform_initialization": False,
    }
    if fp8_cfg is not None and fp8_cfg.precision == "fp8":
        kwargs.update(transformer_config_kwargs(fp8_cfg, num_layers=layers))
    return kwargs


def init_single_process_parallel_state(seed: int = 0) -> None:
    """torch.distributed (world size 1) and megatron-core's model-parallel state, once per process.

    NCCL on CUDA, gloo otherwise; MASTER_ADDR/PORT default to 127.0.0.1 and a free port.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        if torch.cuda.is_available():
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)


def _renamed_tensors(hf_config: Any, fused_norms: bool) -> list[tuple[str, str]]:
    """(HF name, megatron-core name) of every tensor the mapping moves unchanged: embedding, o/down
    projections, the norms (fused into the TE linears or not), Qwen3's q/k norms, the final norm and
    an untied lm_head."""
    pairs = [("model.embed_tokens.weight", "embedding.word_embeddings.weight")]
    for i in range(int(hf_config.num_hidden_layers)):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        pairs += [
            (hf + "self_attn.o_proj.weight", mg + "self_attention.linear_proj.weight"),
            (hf + "input_layernorm.weight", mg + ("self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight")),
            (hf + "post_attention_layernorm.weight", mg + ("mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight")),
        ]
        if not is_moe_layer(hf_config, i):
            pairs.append((hf + "mlp.down_proj.weight", mg + "mlp.linear_fc2.weight"))
        if has_qk_norm(hf_config):
            pairs += [(hf + "self_attn.q_norm.weight", mg + "self_attention.q_layernorm.weight"),
                      (hf + "self_attn.k_norm.weight", mg + "self_attention.k_layernorm.weight")]  # fmt: skip
    pairs.append(("model.norm.weight", "decoder.final_layernorm.weight"))
    if not getattr(hf_config, "tie_word_embeddings", False):
        pairs.append(("lm_head.weight", "output_layer.weight"))
    return pairs


def megatron_state_dict_from_hf(hf_state: Mapping[str, torch.Tensor], hf_config: Any, fused_norms: bool) -> dict[str, torch.Tensor]:
    """HF Llama-family weights -> megatron-core GPTModel parameter names (see the module docstring).

    Args:
        hf_state: `model.state_dict()` of the HF causal LM (names with the `model.` prefix).
        hf_config: its config.
        fused_norms: True for TE layers (norm weights inside linear_qkv / linear_fc1).
    Returns:
        {megatron name: tensor}; `output_layer.weight` only when embeddings are not tied.
    """
    check_llama_family(hf_config, allow_moe=True)
    heads = int(hf_config.num_attention_heads)
    groups = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    d, hidden = head_dim(hf_config), int(hf_config.hidden_size)
    out = {mg: hf_state[hf] for hf, mg in _renamed_tensors(hf_config, fused_norms)}
    for i in range(int(hf_config.num_hidden_layers)):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf_state[hf + "self_attn.q_proj.weight"].view(groups, heads // groups * d, hidden)
        k = hf_state[hf + "self_attn.k_proj.weight"].view(groups, d, hidden)
        v = hf_state[hf + "self_attn.v_proj.weight"].view(groups, d, hidden)
        out[mg + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, hidden)
        if is_moe_layer(hf_config, i):
            out[mg + "mlp.router.weight"] = hf_state[hf + "mlp.gate.weight"]
            for e, (fc1, fc2) in enumerate(zip(hf_state[hf + "mlp.experts.gate_up_proj"], hf_state[hf + "mlp.experts.down_proj"])):
                out[f"{mg}mlp.experts.linear_fc1.weight{e}"], out[f"{mg}mlp.experts.linear_fc2.weight{e}"] = fc1, fc2
        else:
            out[mg + "mlp.linear_fc1.weight"] = torch.cat([hf_state[hf + "mlp.gate_proj.weight"], hf_state[hf + "mlp.up_proj.weight"]])
    return out


def build_megatron_gpt(hf_model: nn.Module, fp8_cfg: FP8Config | None, spec: str = "transformer_engine") -> nn.Module:
    """A megatron-core GPTModel holding `hf_model`'s weights, on `hf_model`'s device, in eval mode.

    Args:
        hf_model: an HF Llama-family causal LM (any dtype; weights are cast to BF16).
        fp8_cfg: the shared config; FP8 (TE block scaling, its BF16 layers) when precision is fp8.
        spec: "transformer_engine" (TE layers) or "local" (megatron-core layers, BF16 only).
    Raises:
        MegatronBridgeError for an unmappable model, FP8 without TE layers, or weights that do not
        cover the Megatron model's parameters exactly.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_config import TransformerConfig

    if spec not in SPECS:
        raise MegatronBridgeError(f"spec must be one of {SPECS}, got {spec!r}")
    if spec == "local" and fp8_cfg is not None and fp8_cfg.precision == "fp8":
        raise MegatronBridgeError("block FP8 needs TransformerEngine layers: use spec='transformer_engine'")
    hf_config = hf_model.config
    check_llama_family(hf_config)
    init_single_process_parallel_state()
    config = TransformerConfig(**megatron_config_kwargs(hf_config, fp8_cfg))
    qk_norm = has_qk_norm(hf_config)
    if spec == "transformer_engine":
        layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    else:
        layer_spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
    model = GPTModel(
        config,
        layer_spec,
        vocab_size=int(hf_config.vocab_size),
        max_sequence_length=int(hf_config.max_position_embeddings),
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf_config)),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        pre_process=True,
        post_process=True,
    )
    copy_hf_weights(model, hf_model, fused_norms=spec == "transformer_engine")
    device = next(hf_model.parameters()).device
    return model.to(device).eval()


def hf_state_dict_from_megatron(megatron_state: Mapping[str, torch.Tensor], hf_config: Any, fused_norms: bool) -> dict[str, torch.Tensor]:
    """The inverse of `megatron_state_dict_from_hf`: megatron-core GPTModel parameters -> HF names
    (`model.` prefix; `lm_head.weight` only when the embeddings are not tied), for a weight sync
    (`refit_weights`) or an HF copy of a Megatron-trained model; views, no arithmetic (a Qwen3-MoE
    layer's experts are stacked into HF's fused tensors)."""
    check_llama_family(hf_config, allow_moe=True)
    heads = int(hf_config.num_attention_heads)
    groups = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    d, hidden = head_dim(hf_config), int(hf_config.hidden_size)
    per_group = heads // groups * d
    out = {hf: megatron_state[mg] for hf, mg in _renamed_tensors(hf_config, fused_norms)}
    for i in range(int(hf_config.num_hidden_layers)):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = megatron_state[mg + "self_attention.linear_qkv.weight"].view(groups, per_group + 2 * d, hidden)
        out[hf + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, hidden)
        out[hf + "self_attn.k_proj.weight"] = qkv[:, per_group : per_group + d].reshape(-1, hidden)
        out[hf + "self_attn.v_proj.weight"] = qkv[:, per_group + d :].reshape(-1, hidden)
        if is_moe_layer(hf_config, i):
            experts = range(int(hf_config.num_experts))
            out[hf + "mlp.gate.weight"] = megatron_state[mg + "mlp.router.weight"]
            out[hf + "mlp.experts.gate_up_proj"] = torch.stack([megatron_state[f"{mg}mlp.experts.linear_fc1.weight{e}"] for e in experts])
            out[hf + "mlp.experts.down_proj"] = torch.stack([megatron_state[f"{mg}mlp.experts.linear_fc2.weight{e}"] for e in experts])
        else:
            out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = megatron_state[mg + "mlp.linear_fc1.weight"].chunk(2)
    return out


#: The vocabulary-parallel tensors of a GPTModel (rows split over tensor-parallel ranks).
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _split_dim(name: str) -> int | None:
    """The dimension megatron-core's tensor parallelism splits parameter `name` along: 0 for the
    column-parallel and vocabulary-parallel weights, 1 for the row-parallel ones, None (replicated)
    for the norms."""
    if name in VOCAB_TENSORS or name.endswith(("linear_qkv.weight", "linear_fc1.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def tensor_parallel_shard(megatron_state: Mapping[str, torch.Tensor], rank: int, size: int, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s parameters of a megatron-core GPTModel at tensor parallel size `size`, from the
    whole model's (`megatron_state_dict_from_hf`, local layers): the rank's query groups of
    `linear_qkv` (its rows are grouped, so one contiguous block), its rows of gate and of up in
    `linear_fc1` ([gate_r; up_r]), its input columns of `linear_proj` / `linear_fc2`, its rows of the
    vocabulary padded with zero rows to `padded_vocab`; norms whole. Views where no padding is needed."""
    out = {}
    for name, tensor in megatron_state.items():
        dim = _split_dim(name)
        if dim is None:
            out[name] = tensor
        elif name.endswith("linear_fc1.weight"):
            out[name] = torch.cat([half.chunk(size)[rank] for half in tensor.chunk(2)])
        elif name in VOCAB_TENSORS:
            padded = torch.cat([tensor, tensor.new_zeros(padded_vocab - tensor.shape[0], tensor.shape[1])]) if padded_vocab > tensor.shape[0] else tensor
            out[name] = padded.chunk(size)[rank]
        else:
            out[name] = tensor.chunk(size, dim=dim)[rank]
    return out


def merge_tensor_parallel_shards(shards: Sequence[Mapping[str, torch.Tensor]], vocab_size: int) -> dict[str, torch.Tensor]:
    """The inverse of `tensor_parallel_shard`: the whole model's parameters from every rank's (in
    rank order), the vocabulary cut back to `vocab_size` rows; for a weight sync of a
    tensor-parallel Megatron model (`hf_state_dict_from_megatron` then takes the whole state)."""
    out = {}
    for name in shards[0]:
        parts = [shard[name] for shard in shards]
        dim = _split_dim(name)
        if dim is None:
            out[name] = parts[0]
        elif name.endswith("linear_fc1.weight"):
            halves = [part.chunk(2) for part in parts]
            out[name] = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        else:
            out[name] = torch.cat(parts, dim=dim)
            if name in VOCAB_TENSORS:
                out[name] = out[name][:vocab_size]
    return out


def copy_hf_weights(model: nn.Module, hf_model: nn.Module, fused_norms: bool, tensor_parallel: tuple[int, int, int] | None = None) -> None:
    """Copy `hf_model`'s weights into the megatron-core GPTModel `model` (`megatron_state_dict_from_hf`;
    with `tensor_parallel` = (rank, size, padded vocabulary), that rank's share, `tensor_parallel_shard`);
    MegatronBridgeError unless the mapped names and shapes cover `model`'s parameters exactly."""
    weights = megatron_state_dict_from_hf(hf_model.state_dict(), hf_model.config, fused_norms=fused_norms)
    if tensor_parallel is not None:
        weights = tensor_parallel_shard(weights, *tensor_parallel)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unused = sorted(set(weights) - set(params))
    if missing or unused:
        raise MegatronBridgeError(f"weight mapping does not cover the Megatron model: missing {missing[:6]}, unused {unused[:6]}")
    with torch.no_grad():
        for name, param in params.items():
            if tuple(param.shape) != tuple(weights[name].shape):
                raise MegatronBridgeError(f"{name}: Megatron shape {tuple(param.shape)}, mapped HF shape {tuple(weights[name].shape)}")
            param.copy_(weights[name])


class MegatronCausalLM(nn.Module):
    """An HF-style causal-LM call around a megatron-core GPTModel: `model(input_ids=, attention_mask=).logits`.

    Sequences are right-padded (the benchmark's scorer pads that way), so causal attention over
    positions 0..L-1 gives every real token exactly its own prefix; `attention_mask` is checked to
    be right-padding and otherwise unused. The length is padded further to a multiple of 16 (TE's
    FP8 GEMMs need token counts divisible by 16), which changes no real token's logits under
    causal attention. Logits are [B, L, V] in the model's dtype.
    """

    def __init__(self, gpt: nn.Module, hf_config: Any) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = hf_config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        length = input_ids.shape[1]
        padded = torch.nn.functional.pad(input_ids, (0, -length % TOKEN_MULTIPLE))
        positions = torch.arange(padded.shape[1], device=input_ids.device)[None]
        if attention_mask is not None:
            lengths = attention_mask.sum(dim=1, keepdim=True)
            if not torch.equal(attention_mask.bool(), positions[:, :length] < lengths):
                raise ValueError("MegatronCausalLM takes right-padded batches only (attention_mask = 1...1 0...0 per row)")
        logits = self.gpt(padded, positions.expand_as(padded), attention_mask=None)
        return SimpleNamespace(logits=logits[:, :length])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
