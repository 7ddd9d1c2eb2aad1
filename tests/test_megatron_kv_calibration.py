"""KVScaleCalibrator on tiny random HF models (Llama, Qwen3) and on real megatron-core SelfAttention
modules on CPU. Expected amaxes are recomputed from the layer inputs with a RoPE written here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from fp8_align.megatron_ext import KVScaleCalibrator
from fp8_align.megatron_ext.hf_bridge import init_single_process_parallel_state
from fp8_align.quant import E4M3_MAX

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE; x [..., seq, head_dim], cos/sin broadcastable to it."""
    return x * cos + _rotate_half(x) * sin


def _hf_model(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    return Qwen3ForCausalLM(Qwen3Config(**TINY)).eval()


@torch.no_grad()
def _hf_expected_amax(model: nn.Module, input_ids: torch.Tensor) -> dict[int, dict[str, float]]:
    """Per layer: max |post-RoPE q|, |post-RoPE k|, |v| recomputed from the layer inputs."""
    out = model(input_ids, output_hidden_states=True)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    expected = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(out.hidden_states[i])
        heads = (*h.shape[:-1], -1, attn.head_dim)
        q, k, v = attn.q_proj(h).view(heads), attn.k_proj(h).view(heads), attn.v_proj(h)
        if hasattr(attn, "k_norm"):  # Qwen3 normalises each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = model.model.rotary_emb(h, positions)
        q = _rope(q.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1))
        k = _rope(k.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1))
        expected[i] = {"q_amax": q.abs().max().item(), "k_amax": k.abs().max().item(), "v_amax": v.abs().max().item()}
    return expected


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hf_post_rope_amax_and_scales(family: str) -> None:
    model = _hf_model(family)
    batches = [torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    baseline_hooks = _hook_count(model)

    with KVScaleCalibrator(model) as calib:
        assert _hook_count(model) > baseline_hooks
        for batch in batches:
            model(batch)
    assert _hook_count(model) == baseline_hooks

    per_batch = [_hf_expected_amax(model, batch) for batch in batches]
    amaxes, scales = calib.amaxes(), calib.scales()
    assert sorted(amaxes) == [0, 1, 2]
    for layer, measured in amaxes.items():
        for key, value in measured.items():
            running_max = max(batch[layer][key] for batch in per_batch)
            assert value == pytest.approx(running_max, rel=1e-6, abs=0)
            kind = key.removesuffix("_amax")
            fp32_scale = (torch.tensor(value, dtype=torch.float32) / E4M3_MAX).item()
            assert scales[layer][f"{kind}_scale"] == fp32_scale


def test_post_rope_keys_differ_from_the_projection_output() -> None:
    # Guards the choice of tensor: the k_proj output's amax is not what the KV cache holds.
    model = _hf_model("llama")
    batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    projected = {}

    def keep_projection_amax(_: nn.Module, __: object, out: torch.Tensor) -> None:
        projected["k"] = out.abs().max().item()

    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(keep_projection_amax)
    with KVScaleCalibrator(model) as calib, torch.no_grad():
        model(batch)
    handle.remove()
    assert calib.amaxes()[0]["k_amax"] != pytest.approx(projected["k"], rel=1e-6)


def test_hooks_are_gone_after_exit_and_maxima_persist() -> None:
    model = _hf_model("llama")
    batch = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with KVScaleCalibrator(model) as calib, torch.no_grad():
        model(batch)
    before = calib.amaxes()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(10)  # would raise every v_amax if still hooked
        model(batch)
    assert calib.amaxes() == before


def test_errors_without_observations_or_attention() -> None:
    calib = KVScaleCalibrator(_hf_model("llama"))
    with pytest.raises(RuntimeError, match="no attention forward pass"):
        calib.scales()
    with pytest.raises(ValueError, match="no supported attention modules"):
        KVScaleCalibrator(nn.Linear(4, 4)).__enter__()


class _AttentionWithoutRope(nn.Module):
    """HF-shaped attention whose modeling module (this test file) has no apply_rotary_pos_emb."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.layer_idx, self.head_dim = 7, 4


def test_unsupported_attention_is_refused_and_leaves_no_hooks() -> None:
    model = _hf_model("llama")
    both = nn.ModuleList([model, _AttentionWithoutRope()])
    baseline_hooks = _hook_count(both)
    with pytest.raises(TypeError, match="no apply_rotary_pos_emb"):
        KVScaleCalibrator(both).__enter__()
    assert _hook_count(both) == baseline_hooks


# --------------------------------------------------------------------------- megatron-core


class _CpuCoreAttention(nn.Module):
    """Stand-in for megatron's core_attention (its DotProductAttention allocates on CUDA):
    causal SDPA on [sq, b, heads, dim] with grouped KV heads, output [sq, b, heads * dim]."""

    def forward(self, query, key, value, attention_mask, **_: object) -> torch.Tensor:
        groups = query.shape[2] // key.shape[2]
        q, k, v = (
            t.permute(1, 2, 0, 3) for t in (query, key.repeat_interleave(groups, 2), value.repeat_interleave(groups, 2))
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).flatten(2)


@pytest.fixture(scope="module")
def megatron_block():
    """A 3-layer megatron-core TransformerBlock (local spec) on CPU, in the process's 1-process gloo
    group (`init_single_process_parallel_state`: set up once per process, whichever module asks
    first, and left for the others)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_single_process_parallel_state()
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    block = TransformerBlock(config, get_gpt_layer_local_spec())
    for layer in block.layers:
        layer.self_attention.core_attention = _CpuCoreAttention()
    return block


def _megatron_rope(seq: int, dim: int) -> torch.Tensor:
    """megatron's rotary_pos_emb layout: [seq, 1, 1, dim] angles, the two halves repeated."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def test_megatron_self_attention_post_rope_amax(megatron_block) -> None:
    seq, batch = 6, 2
    emb = _megatron_rope(seq, 8)
    inputs = [torch.randn(seq, batch, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    with KVScaleCalibrator(megatron_block) as calib, torch.no_grad():
        for layer, hidden in zip(megatron_block.layers, inputs):
            layer.self_attention(hidden, attention_mask=None, rotary_pos_emb=emb)

    amaxes = calib.amaxes()
    assert sorted(amaxes) == [0, 1, 2]  # layer_number - 1
    with torch.no_grad():
        for index, (layer, hidden) in enumerate(zip(megatron_block.layers, inputs)):
            query, key, value = layer.self_attention.get_query_key_value_tensors(hidden)[:3]
            cos, sin = emb.cos(), emb.sin()
            expected = {
                "q_amax": _rope(query, cos, sin).abs().max().item(),
                "k_amax": _rope(key, cos, sin).abs().max().item(),
                "v_amax": value.abs().max().item(),
            }
            assert amaxes[index] == pytest.approx(expected, rel=1e-6, abs=0)
    # One-rank group: the all-reduce(MAX) path returns the same numbers.
    assert calib.amaxes(group=dist.group.WORLD) == amaxes
    assert all(not layer.self_attention.core_attention._forward_pre_hooks for layer in megatron_block.layers)
