"""The bitwise trainer with an FP8 KV cache, on CPU (`FP8Config(on_policy="bitwise", kv_cache_dtype="fp8")`):
the K/V read-back reference against an independent E4M3 rounding, the engine's per-layer scales
reaching each layer's attention, the refusals, and the straight-through backward. On CPU every op
runs its pure-torch reference; engine-vs-trainer bit equality over the real FP8 cache needs the
CUDA kernels (tests/test_gpu_bitwise.py, tests/test_gpu_bitwise_rollout.py,
benchmarks/on_policy_bitwise.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from fp8_align import FP8Config
from fp8_align.bitwise.reference import fp8_kv_cache_reference
from fp8_align.hf_training import BitwiseForward
from fp8_align.hf_training.attention import KVCacheScales, PackedBatch, attention_reference
from fp8_align.vllm_plugin.kv.scales import KVScaleError
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES

FP8_KV = FP8Config(on_policy="bitwise", kv_cache_dtype="fp8")


def _e4m3_values() -> torch.Tensor:
    """Every finite E4M3 value, from its 256 bit patterns (NaNs dropped), sorted."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[values.isfinite()].unique()


def _nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the E4M3 grid by search over its values, saturating at +-448:
    a reference that shares no code with the cast under test."""
    grid = _e4m3_values()
    x = x.clamp(-448, 448)
    distance = (x[:, None] - grid[None, :]).abs()
    best = distance.min(dim=1, keepdim=True).values
    ties = distance == best
    even = (grid.view(1, -1).to(torch.float8_e4m3fn).view(torch.uint8) % 2 == 0).expand_as(ties)
    pick = torch.where(ties.sum(1) > 1, (ties & even).float().argmax(1), ties.float().argmax(1))
    return grid[pick]


def test_kv_read_back_is_the_nearest_e4m3_code_times_the_scale() -> None:
    """With a power-of-two scale `code * scale` is exact, so the FP32 read-back divided by the
    scale must be exactly the nearest E4M3 value of x / scale (ties to even), saturated at 448."""
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([2.0**-3])
    x = torch.cat([(torch.randn(4000, generator=g) * 30).to(torch.bfloat16), torch.tensor([100.0, -70.0, 0.0], dtype=torch.bfloat16)])
    read_back = fp8_kv_cache_reference(x, scale)
    assert read_back.dtype == torch.float32
    assert torch.equal(read_back.float() / scale, _nearest_e4m3(x.float() / scale))
    assert read_back[-3:].tolist() == [56.0, -56.0, 0.0]  # 100 / 2^-3 = 800 and -560 saturate at +-448


def test_fp8_kv_attention_reference_reads_back_k_and_v_with_their_own_scales() -> None:
    """attention_reference with scales = attention over the read-back K and V; each scale matters."""
    g = torch.Generator().manual_seed(1)
    batch = PackedBatch.from_lengths([7, 20], "cpu")
    q, k, v = (torch.randn(27, n * 64, generator=g).to(torch.bfloat16) * 3 for n in (4, 2, 2))
    scales = KVCacheScales(torch.tensor([0.05]), torch.tensor([0.01]))
    got = attention_reference(q, k, v, batch, 64, kv_scales=scales)
    want = attention_reference(q, fp8_kv_cache_reference(k, scales.k_scale), fp8_kv_cache_reference(v, scales.v_scale), batch, 64)
    assert torch.equal(got, want)
    assert not torch.equal(got, attention_reference(q, k, v, batch, 64))
    swapped = KVCacheScales(scales.v_scale, scales.k_scale)
    assert not torch.equal(got, attention_reference(q, k, v, batch, 64, kv_scales=swapped))


def _scales(num_layers: int, k: float = 0.02, v: float = 0.01) -> dict[int, dict[str, float]]:
    return {layer: {"k_scale": k * (layer + 1), "v_scale": v * (layer + 1)} for layer in range(num_layers)}


def test_every_layer_attends_with_its_own_engine_scales() -> None:
    """The scales given reach the attention of their own decoder layer, as FP32 [1] tensors."""
    forward = BitwiseForward(tiny_hf_model("qwen3", num_layers=3), FP8_KV, kv_scales=_scales(3))
    seen: list[tuple[float, float]] = []
    attention = forward.kernels.attention

    def recording(*args: Any, kv_scales: KVCacheScales, **kwargs: Any) -> torch.Tensor:
        assert kv_scales.k_scale.dtype == torch.float32 and kv_scales.k_scale.shape == (1,)
        seen.append((kv_scales.k_scale.item(), kv_scales.v_scale.item()))
        return attention(*args, kv_scales=kv_scales, **kwargs)

    forward.kernels = dataclasses.replace(forward.kernels, attention=recording)
    forward.token_logprobs(SEQUENCES, PROMPT_LENS)
    expected = [(torch.tensor(0.02 * (i + 1)).item(), torch.tensor(0.01 * (i + 1)).item()) for i in range(3)]
    assert seen == expected


def test_fp8_kv_log_probs_depend_on_the_scales_and_not_on_packing() -> None:
    """The FP8 cache moves the log-probs off the BF16-cache ones, and scales too small for the K/V
    range (0.002: codes saturate at 448 x 0.002 = 0.9) move them much further than fitting ones
    (0.02; measured 0.24 vs 0.045 nats), so the scales are really applied; a sequence scores the
    same bits alone and packed with others."""
    model = tiny_hf_model("qwen3")
    bf16_cache = torch.cat(BitwiseForward(model, FP8Config(on_policy="bitwise")).token_logprobs(SEQUENCES, PROMPT_LENS))
    gaps = []
    for k_scale in (0.02, 0.002):
        forward = BitwiseForward(model, FP8_KV, kv_scales=_scales(2, k=k_scale, v=k_scale))
        packed = forward.token_logprobs(SEQUENCES, PROMPT_LENS)
        for i, seq in enumerate(SEQUENCES):
            assert torch.equal(forward.token_logprobs([seq], [PROMPT_LENS[i]])[0], packed[i])
        gaps.append((torch.cat(packed) - bf16_cache).abs().max().item())
    assert 0 < 2 * gaps[0] < gaps[1], gaps


def test_fp8_kv_backward_is_straight_through_the_quantization(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward of attention over the FP8 cache is the BF16 gradient at the unquantized K/V:
    against plain autograd through each op's `gradient_fn` (where attention has no scales), every
    parameter's gradient is within 20% (relative Frobenius norm); measured here: at most 7%, the
    forwards differing by the FP8 cache and BF16 rounding. A backward through the quantizer (zero
    almost everywhere) or a missing term is off by O(1)."""
    from fp8_align.hf_training import bitwise_modules, engine_ops, stacked

    model = tiny_hf_model("qwen3")

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        torch.cat(BitwiseForward(model, FP8_KV, kv_scales=_scales(2)).token_logprobs(SEQUENCES, PROMPT_LENS)).sum().backward()
        return {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}

    engine = gradients()
    for module in (bitwise_modules, engine_ops, stacked):  # every module that calls engine_op
        monkeypatch.setattr(module, "engine_op", lambda engine_fn, gradient_fn, *inputs, **_: gradient_fn(*inputs))
    reference = gradients()
    assert engine.keys() == reference.keys() and len(engine) == len(list(model.parameters()))
    errors = {name: ((engine[name] - reference[name]).norm() / reference[name].norm().clamp_min(1e-12)).item() for name in engine}
    assert all(math.isfinite(e) for e in errors.values()) and max(errors.values()) < 0.2, errors


def test_scales_are_required_complete_and_valid() -> None:
    model = tiny_hf_model("llama")
    forward = BitwiseForward(model, FP8_KV)
    with pytest.raises(ValueError, match=r"call set_kv_scales\(model, engine_kv_scales\(llm\)\)"):
        forward.token_logprobs(SEQUENCES, PROMPT_LENS)
    with pytest.raises(KVScaleError, match=r"missing \[1\]"):
        forward.set_kv_scales({0: {"k_scale": 0.1, "v_scale": 0.1}})
    with pytest.raises(KVScaleError, match=r"unknown \[2\]"):
        forward.set_kv_scales({**_scales(2), 2: {"k_scale": 0.1, "v_scale": 0.1}})
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-50):
        with pytest.raises(KVScaleError, match="layer 1 v_scale"):
            forward.set_kv_scales({0: {"k_scale": 0.1, "v_scale": 0.1}, 1: {"k_scale": 0.1, "v_scale": bad}})
    with pytest.raises(KVScaleError, match="missing keys"):
        forward.set_kv_scales({0: {"k_scale": 0.1}, 1: {"k_scale": 0.1, "v_scale": 0.1}})
    assert forward.kv_scales is None  # nothing refused was kept
    forward.set_kv_scales({layer: {**values, "q_scale": 5.0} for layer, values in _scales(2).items()})  # q_scale: accepted, unused
    assert forward.kv_scales is not None and forward.kv_scales[1].v_scale.item() == torch.tensor(0.02).item()
    with pytest.raises(ValueError, match="K/V scales apply to an FP8 KV cache"):
        BitwiseForward(model, FP8Config(on_policy="bitwise"), kv_scales=_scales(2))
