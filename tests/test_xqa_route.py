"""The XQA decode route: config rules, the patch (applied only once an engine plan chose XQA, and
only for the attention implementations the plan marked), the batch selection and the scale
mapping, on CPU. When XQA is chosen: tests/test_engine_plan.py. The XQA kernel itself needs an
H100 and runs in tests/test_gpu_xqa.py (kernel against FA3 and an FP32 reference, a whole engine
against FA3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fp8_align import FP8Config
from fp8_align.vllm_plugin import patches
from fp8_align.vllm_plugin.kv.xqa_decode import (
    is_pure_decode,
    route_decode_to_xqa,
    routes_to_xqa,
    xqa_kernel_scales,
    xqa_scales,
)

XQA = FP8Config(kv_cache_dtype="fp8", kv_decode_kernel="xqa")


def test_xqa_needs_an_fp8_kv_cache() -> None:
    with pytest.raises(ValueError, match="kv_decode_kernel='xqa' decodes an FP8 KV cache"):
        FP8Config(kv_decode_kernel="xqa")
    assert FP8Config.from_json(XQA.to_json()) == XQA


def test_the_route_patch_waits_for_the_engine_plan() -> None:
    """No requested value patches FlashAttentionImpl from the engine's first layer on: the hook that
    plans the loaded model applies `XQA_PATCH` where the plan chose XQA (vLLM 0.22 only)."""
    assert patches.XQA_PATCH.target == "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward"
    assert patches.XQA_PATCH.versions == ((0, 22),)
    for cfg in (XQA, FP8Config(kv_cache_dtype="fp8"), FP8Config(kv_cache_dtype="fp8", kv_decode_kernel="backend")):
        assert "fp8_kv_decode_with_xqa" not in [p.name for p in patches._patches_for(cfg)]
    patches.undo_patches()
    try:
        assert "fp8_kv_decode_with_xqa" not in patches.apply_patches(XQA)
    finally:
        patches.undo_patches()


def test_only_marked_implementations_decode_with_xqa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patched forward sends a pure-decode batch to XQA only for an implementation the engine
    plan marked; an unmarked one (another engine of the process, kv_decode_kernel='backend') and
    prefill batches stay on FA."""
    monkeypatch.setattr(patches, "xqa_decode", lambda impl, *args: "xqa")
    forward = patches._route_pure_decode_to_xqa(lambda impl, *args: "fa")
    decode, prefill = SimpleNamespace(max_query_len=1, use_cascade=False), SimpleNamespace(max_query_len=5, use_cascade=False)
    marked, unmarked = _impl(), _impl()
    route_decode_to_xqa(marked)
    assert routes_to_xqa(marked) and not routes_to_xqa(unmarked)
    tensors = [torch.zeros(1)] * 4
    assert forward(marked, None, *tensors, decode, torch.zeros(1)) == "xqa"
    assert forward(marked, None, *tensors, prefill, torch.zeros(1)) == "fa"
    assert forward(unmarked, None, *tensors, decode, torch.zeros(1)) == "fa"
    assert forward(marked, None, *tensors, decode, torch.zeros(1), torch.ones(1)) == "fa"  # an output scale: FA


def _impl(**changes: object) -> SimpleNamespace:
    fields = dict(kv_cache_dtype="fp8", attn_type="decoder", sliding_window=(-1, -1), sinks=None, alibi_slopes=None,
                  logits_soft_cap=0.0, dcp_world_size=1)  # fmt: skip
    return SimpleNamespace(**{**fields, **changes})


def test_only_pure_decode_batches_over_an_fp8_cache_go_to_xqa() -> None:
    decode = SimpleNamespace(max_query_len=1, use_cascade=False)
    assert is_pure_decode(_impl(), decode)
    assert not is_pure_decode(_impl(), None)  # profiling run
    assert not is_pure_decode(_impl(), SimpleNamespace(max_query_len=7, use_cascade=False))  # prefill / mixed
    assert not is_pure_decode(_impl(), SimpleNamespace(max_query_len=1, use_cascade=True))
    for change in ({"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "fp8_e5m2"}, {"sliding_window": (127, 0)}, {"sinks": torch.zeros(4)},
                   {"alibi_slopes": torch.ones(4)}, {"logits_soft_cap": 30.0}, {"dcp_world_size": 2},
                   {"attn_type": "encoder_decoder"}):  # fmt: skip
        assert not is_pure_decode(_impl(**change), decode), change


def test_scales_fold_into_xqa_multipliers_like_fa3_descales() -> None:
    """XQA's logits (Q.K) * q_arg * kv_arg / sqrt(d) and output (P.V) * kv_arg must equal FA3's
    (Q.K) * q_descale * k_descale * softmax_scale and (P.V) * v_descale, for the same E4M3 codes."""
    d = 128
    q_scale, k_scale, v_scale = torch.tensor([0.03]), torch.tensor([0.011]), torch.tensor([0.0045])
    q_arg, kv_arg = xqa_kernel_scales(*xqa_scales(q_scale, k_scale, v_scale, d**-0.5), d)
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(n, d, generator=g) * 50).to(torch.float8_e4m3fn).float() for n in (4, 33, 33))
    fa3 = torch.softmax(q @ k.T * q_scale * k_scale * d**-0.5, -1) @ v * v_scale
    xqa = torch.softmax(q @ k.T * q_arg * kv_arg / d**0.5, -1) @ v * kv_arg
    torch.testing.assert_close(xqa, fa3, rtol=1e-5, atol=1e-5 * fa3.abs().max().item())  # FP32 re-association only
    # a swapped K/V scale or a dropped q_scale is visible
    wrong = torch.softmax(q @ k.T * k_scale * d**-0.5, -1) @ v * v_scale
    assert not torch.allclose(wrong, fa3, rtol=1e-3)
