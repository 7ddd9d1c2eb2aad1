"""What an fp8_align engine runs, and why: the GEMM backends of its FP8 linears and the kernel that
decodes its KV cache, reported in one INFO line at engine start.

`plan_engine` runs in each worker once the model is loaded (from the patch
`weight_sync_on_loaded_models`), before the KV cache exists and before any warm-up or CUDA-graph
capture. The GEMM backends are chosen per layer by then (`kernels.registry.select_kernel`, each
logged; a DeepGEMM JIT cache without this engine's kernels is warned about before they compile,
`kernels.gpu`). The decode kernel is chosen here, by `choose_decode_kernel`, one pure function of
`DecodeFacts` and the requested `FP8Config.kv_decode_kernel`:

    fp8_align: engine plan: GEMM deepgemm x144 (JIT cache /root/.cache/vllm/deep_gemm: 4 of 4
    shapes prepared ahead); decode XQA (kv_decode_kernel='auto': FP8 KV cache on SM90 with ...)

(one line). A WARNING follows where a faster decode was possible on this machine but is not taken
(FP8 KV cache on Hopper with vLLM 0.22's FLASH_ATTN, but FlashInfer's XQA module does not load),
saying what to do.

Before that, at the engine's first linear layer (before any attention layer is built),
`default_attention_backend` picks vLLM 0.25's FLASHINFER for an FP8 cache on Hopper where the
engine left `attention_backend` unset (`choose_attention_backend`: vLLM then decodes with XQA
itself); the INFO line says so.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fp8_align.config import FP8Config
from fp8_align.versions import installed_vllm_version, vllm_series
from fp8_align.vllm_plugin.compat import attention_backend_name, flashinfer_decodes_with_xqa, set_attention_backend
from fp8_align.vllm_plugin.kernels.deepgemm.inventory import warmups
from fp8_align.vllm_plugin.kv.flashinfer_scales import LIVE_SCALES_SERIES, read_scales_live
from fp8_align.vllm_plugin.kv.xqa_decode import (
    XQA_CAPABILITY,
    XQA_KV_CACHE_DTYPES,
    XQA_SERIES,
    XqaDecodeError,
    route_decode_to_xqa,
    xqa_module_error,
)
from fp8_align.vllm_plugin.layer_state import fp8_align_layers

logger = logging.getLogger("vllm.fp8_align")

#: The attention backend whose decode the XQA route replaces (`FlashAttentionImpl`).
XQA_BACKEND = "FLASH_ATTN"
#: vLLM 0.25's backend that decodes an FP8 cache on SM90 with XQA itself (`kv.flashinfer_scales`).
FLASHINFER_BACKEND = "FLASHINFER"
#: Where the decode choice is kept on a planned model (so it is planned once).
_PLAN_ATTR = "fp8_align_decode_plan"


@dataclass(frozen=True)
class DecodeFacts:
    """What the decode choice depends on, all known once the engine's model is built.

    vllm_version: the installed vLLM (None: not found). capability: the engine's CUDA device
    capability, None off CUDA. kv_cache_dtype: vLLM's `cache_config.cache_dtype` ("auto", "fp8",
    "fp8_e4m3", "fp8_e5m2", ...). attention_backend: `get_name()` of the model's attention layers'
    backend, several joined by "+", "none" without attention layers. activation_dtype: the model
    dtype ("bfloat16", "float16", ...). on_policy: `FP8Config.on_policy`.
    """

    vllm_version: str | None
    capability: tuple[int, int] | None
    kv_cache_dtype: str
    attention_backend: str
    activation_dtype: str
    on_policy: str


@dataclass(frozen=True)
class DecodeChoice:
    """`kernel` ("XQA" or the attention backend's name) decodes the engine's KV cache because of
    `reason`; `warning` (or None) says which faster choice this machine missed and what to do."""

    kernel: str
    reason: str
    warning: str | None = None

    @property
    def xqa(self) -> bool:
        """True when XQA decodes (the route must be applied)."""
        return self.kernel == "XQA"


@dataclass(frozen=True)
class BackendFacts:
    """What fp8_align's choice of attention backend depends on, all known before the first layer
    is built. requested: the engine's `attention_config.backend` name, None when unset (vLLM
    chooses). use_mla: the model's attention is MLA. kv_decode_kernel: `FP8Config.kv_decode_kernel`.
    Other fields as in `DecodeFacts`."""

    vllm_version: str | None
    capability: tuple[int, int] | None
    kv_cache_dtype: str
    requested: str | None
    use_mla: bool
    on_policy: str
    kv_decode_kernel: str


def choose_attention_backend(facts: BackendFacts, flashinfer_xqa: Callable[[], bool]) -> str | None:
    """FLASHINFER where fp8_align picks it for an engine whose backend is unset: an FP8 (E4M3) cache
    on vLLM 0.25 on SM90 (its FLASHINFER backend decodes with XQA, 1.16x faster than FA3 in the
    Qwen3-8B rollout, and `kv.flashinfer_scales` keeps pushed K/V scales live there), no MLA,
    on_policy off, kv_decode_kernel "auto" ("backend" keeps vLLM's choice; "xqa" asks for 0.22's
    route and is refused at the plan), and `flashinfer_xqa()` (vLLM would send this
    model's decode to XQA: cubins reachable or VLLM_HAS_FLASHINFER_CUBIN=1; called last). Else None:
    vLLM's own choice stands, and the engine plan warns where FA3 then decodes an FP8 cache."""
    if facts.requested is not None or facts.use_mla or facts.kv_decode_kernel != "auto":
        return None
    if not _xqa_by_flashinfer(facts):
        return None
    return FLASHINFER_BACKEND if flashinfer_xqa() else None


def default_attention_backend(cfg: FP8Config, vllm_config: Any) -> str | None:
    """Apply `choose_attention_backend` to the engine being built (call before its first attention
    layer exists, inside its VllmConfig context): set `attention_config.backend` where it chooses one.
    Returns the backend set, or None."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    model_config, attention = vllm_config.model_config, vllm_config.attention_config.backend
    facts = BackendFacts(
        vllm_version=installed_vllm_version(),
        capability=tuple(current_platform.get_device_capability()),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        requested=None if attention is None else str(attention.name),
        use_mla=bool(model_config.use_mla),
        on_policy=cfg.on_policy,
        kv_decode_kernel=cfg.kv_decode_kernel,
    )
    parallel = vllm_config.parallel_config
    chosen = choose_attention_backend(
        facts,
        lambda: flashinfer_decodes_with_xqa(model_config.get_num_attention_heads(parallel), model_config.get_num_kv_heads(parallel)),
    )
    if chosen is not None:
        set_attention_backend(vllm_config, chosen)
    return chosen


def _why_not_xqa(facts: DecodeFacts) -> str | None:
    """The first reason the XQA route cannot decode this engine, from the facts alone, or None."""
    if facts.kv_cache_dtype not in XQA_KV_CACHE_DTYPES:
        if facts.kv_cache_dtype.startswith("fp8"):
            return f"the KV cache is {facts.kv_cache_dtype}; XQA reads an E4M3 cache (kv_cache_dtype='fp8')"
        return f"the KV cache is not FP8 (kv_cache_dtype={facts.kv_cache_dtype!r}); XQA decodes an FP8 (E4M3) cache"
    if facts.on_policy == "bitwise":
        return "on_policy='bitwise' decodes with TRITON_ATTN's batch-invariant kernel"
    series = vllm_series(facts.vllm_version) if facts.vllm_version else None
    if series not in XQA_SERIES:
        return (
            f"fp8_align's XQA route is implemented for vLLM 0.22 (installed: {facts.vllm_version}); vLLM 0.25+ decodes "
            "an FP8 KV cache with XQA on Hopper itself with attention_backend='FLASHINFER'"
        )
    if facts.capability is None:
        return "the engine runs on no CUDA GPU; XQA's FP8-KV kernel needs SM90 (Hopper)"
    if facts.capability != XQA_CAPABILITY:
        return f"the GPU is sm{facts.capability[0]}{facts.capability[1]}; XQA's FP8-KV kernel (mha_sm90) is for SM90 (Hopper)"
    if facts.attention_backend != XQA_BACKEND:
        return (
            f"the attention backend is {facts.attention_backend}; the XQA route replaces {XQA_BACKEND}'s decode "
            f"(attention_backend='{XQA_BACKEND}', the default on Hopper)"
        )
    if facts.activation_dtype != "bfloat16":
        return f"the model runs in {facts.activation_dtype}; the XQA route passes it a BF16 query and output"
    return None


def choose_decode_kernel(requested: str, facts: DecodeFacts, xqa_module: Callable[[], str | None]) -> DecodeChoice:
    """The kernel that decodes the engine's KV cache, and why.

    requested: `FP8Config.kv_decode_kernel`. "backend": the attention backend's own decode,
    always. "auto": XQA wherever fp8_align implements it and it can run (an FP8 E4M3 KV cache,
    on_policy off, vLLM 0.22, an SM90 GPU, every attention layer on FLASH_ATTN, a BF16 model, and
    FlashInfer's XQA module loads), else the backend's own, with the reason; a WARNING text when
    only the XQA module was missing (the one thing to fix on this machine), or where vLLM 0.25's
    FLASHINFER backend would decode faster (`_flashinfer_hint`). "xqa": XQA, or
    XqaDecodeError with the reason and what to set instead.
    `xqa_module` returns None when the XQA module loads, else why not and how to build it; it is
    called only when everything else allows XQA (it may compile the module).
    """
    if requested == "backend":
        return DecodeChoice(facts.attention_backend, "kv_decode_kernel='backend': the attention backend's own decode")
    if requested not in ("auto", "xqa"):
        raise ValueError(f"kv_decode_kernel must be 'auto', 'backend' or 'xqa', got {requested!r}")
    if requested == "auto" and facts.attention_backend == FLASHINFER_BACKEND and _xqa_by_flashinfer(facts):
        return DecodeChoice(
            FLASHINFER_BACKEND,
            f"kv_decode_kernel='auto': FP8 KV cache on SM90 with vLLM {facts.vllm_version}'s {FLASHINFER_BACKEND}, which "
            "decodes it with XQA where it can load the kernel",
        )
    reason = _why_not_xqa(facts)
    missing_module = None if reason is not None else xqa_module()
    if reason is None and missing_module is None:
        return DecodeChoice(
            "XQA",
            f"kv_decode_kernel={requested!r}: FP8 KV cache on SM90 with vLLM {facts.vllm_version}'s {XQA_BACKEND}: "
            f"FlashInfer's XQA kernel decodes it faster than FA3 (docs/xqa_decode.md); prefill stays on {XQA_BACKEND}",
        )
    reason = reason or str(missing_module)
    if requested == "xqa":
        raise XqaDecodeError(
            f"kv_decode_kernel='xqa' cannot run in this engine: {reason}. Set kv_decode_kernel='auto' (XQA where it can "
            "run, else the attention backend's decode) or 'backend'."
        )
    warning = _flashinfer_hint(facts)
    if missing_module is not None:
        warning = (
            f"this engine could decode its FP8 KV cache with XQA (faster than FA3 on Hopper, docs/xqa_decode.md), but "
            f"{missing_module}. It decodes with {facts.attention_backend} (FA3) instead."
        )
    return DecodeChoice(facts.attention_backend, f"kv_decode_kernel='auto': {reason}", warning)


def _live_scales_release(facts: DecodeFacts | BackendFacts) -> bool:
    """A vLLM release and GPU where `kv.flashinfer_scales` makes FLASHINFER's XQA decode read pushed
    K/V scales (vLLM 0.25, SM90)."""
    series = vllm_series(facts.vllm_version) if facts.vllm_version else None
    return series in LIVE_SCALES_SERIES and facts.capability == XQA_CAPABILITY


def _xqa_by_flashinfer(facts: DecodeFacts | BackendFacts) -> bool:
    """An engine whose FP8 (E4M3) cache vLLM's FLASHINFER backend decodes with XQA, with scales
    fp8_align keeps live: vLLM 0.25, SM90, on_policy off (bitwise decodes with TRITON_ATTN)."""
    return _live_scales_release(facts) and facts.kv_cache_dtype in XQA_KV_CACHE_DTYPES and facts.on_policy != "bitwise"


def _flashinfer_hint(facts: DecodeFacts) -> str | None:
    """The WARNING for an FP8 (E4M3) cache decoded by FA3 on SM90 with a vLLM whose FLASHINFER
    backend decodes it with XQA and whose scales fp8_align keeps live there (vLLM 0.25), else None."""
    if not (facts.attention_backend == XQA_BACKEND and _xqa_by_flashinfer(facts)):
        return None
    return (
        f"this engine decodes its FP8 KV cache with {XQA_BACKEND} (FA3); on vLLM {facts.vllm_version} "
        "attention_backend='FLASHINFER' decodes it with XQA, 1.16x faster in fp8_align's Qwen3-8B rollout on an H100 "
        "(benchmarks/RESULTS.md), and fp8_align keeps per-step K/V scales live there (docs/xqa_decode.md). fp8_align "
        "picks it itself where attention_backend is unset and vLLM can load XQA, which needs NVIDIA's cubin "
        "artifactory, flashinfer-cubin, or on an offline machine with nvcc VLLM_HAS_FLASHINFER_CUBIN=1."
    )


def _attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if attention_backend_name(module) is not None]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def decode_facts(model: torch.nn.Module, cfg: FP8Config, vllm_config: Any) -> DecodeFacts:
    """The `DecodeFacts` of a loaded engine model and its `VllmConfig`."""
    device = _device(model)
    backends = sorted({str(attention_backend_name(layer)) for layer in _attention_layers(model)})
    return DecodeFacts(
        vllm_version=installed_vllm_version(),
        capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        attention_backend="+".join(backends) or "none",
        activation_dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        on_policy=cfg.on_policy,
    )


def _xqa_module_error(model: torch.nn.Module, page_size: int | None) -> str | None:
    """`xqa_module_error` for every (head dim, query heads per KV head) of the model's attention
    layers with the engine's KV-cache page size; the first failure, or None."""
    if page_size is None:
        return "the KV-cache block size is not set when the model is loaded, so the XQA module to load is not known"
    heads = sorted({(layer.impl.head_size, layer.impl.num_heads // layer.impl.num_kv_heads) for layer in _attention_layers(model)})
    for head_dim, group_ratio in heads:
        error = xqa_module_error(head_dim, group_ratio, page_size)
        if error is not None:
            return error
    return None


def _deepgemm_state() -> str:
    """DeepGEMM's JIT-cache state from this process's warm-ups (`deepgemm.inventory.warmups`)."""
    runs = warmups()
    if not runs:
        return "no warm-up ran in this process (VLLM_DEEP_GEMM_WARMUP=skip): kernels compile at first use"
    cold = [run for run in runs if not run.prepared]
    filled = [run for run in runs if run.filled_at_start]
    text = f"JIT cache {runs[-1].cache_dir}: {len(runs) - len(cold) - len(filled)} of {len(runs)} shapes prepared ahead"
    if filled:
        text += f"; {len(filled)} filled at this start in parallel processes"
    if cold:
        seconds = sum(run.seconds for run in cold)
        text += f"; the others' {sum(run.kernels for run in cold)} kernels compiled where missing at this start, {seconds:.0f} s"
    return text


def gemm_summary(model: torch.nn.Module) -> str:
    """The GEMM backends of `model`'s FP8 linears, most used first, as "name xCOUNT (why)": why
    the fastest backend was passed (the first reason the layer's selection recorded), DeepGEMM's
    JIT-cache state, or the CPU; FP8 routed-expert layers counted after them."""
    kernels = [layer.fp8_align.kernel for layer in fp8_align_layers(model, "linear")]
    on_cpu = _device(model).type == "cpu"
    parts = []
    for name, count in Counter(kernel.name for kernel in kernels).most_common():
        passed = next(getattr(kernel, "passed", ()) for kernel in kernels if kernel.name == name)
        if name == "deepgemm":
            why = _deepgemm_state()
        elif passed:
            why = f"not {passed[0]}"
        else:
            why = "CPU: fp8_align's reference block-FP8 GEMM" if on_cpu else ""
        parts.append(f"{name} x{count}" + (f" ({why})" if why else ""))
    experts = len(fp8_align_layers(model, "experts"))
    if experts:
        where = "fp8_align's reference block-FP8 MoE" if on_cpu else "vLLM's block-FP8 fused-MoE kernel"
        parts.append(f"routed experts x{experts} ({where})")
    return ", ".join(parts) or "no FP8 layers"


def make_flashinfer_scales_live(model: torch.nn.Module, facts: DecodeFacts) -> int:
    """On vLLM 0.25 with an FP8 cache on SM90, make every FLASHINFER attention layer of `model` whose
    decode is XQA read its K/V scales live (`kv.flashinfer_scales.read_scales_live`, before the first forward, so CUDA
    graphs capture the buffers); returns how many. Elsewhere 0: pushes into such layers are refused."""
    if not (_live_scales_release(facts) and facts.kv_cache_dtype.startswith("fp8")):
        return 0
    return sum(read_scales_live(layer) for layer in _attention_layers(model) if _decodes_with_xqa(layer))


def _decodes_with_xqa(layer: torch.nn.Module) -> bool:
    """A FLASHINFER layer whose decode vLLM sends to XQA (FlashInfer's native decode keeps its scales
    as captured floats too, and is left as it is: pushes into it are refused)."""
    impl = layer.impl
    return attention_backend_name(layer) == "FLASHINFER" and flashinfer_decodes_with_xqa(impl.num_heads, impl.num_kv_heads)


def plan_engine(model: torch.nn.Module, cfg: FP8Config, vllm_config: Any) -> DecodeChoice:
    """Choose the decode kernel of a loaded engine model (`choose_decode_kernel` with
    `cfg.kv_decode_kernel`), mark its FLASH_ATTN layers for the XQA route when XQA is chosen, make
    FLASHINFER layers read pushed K/V scales (`make_flashinfer_scales_live`), and log the engine's
    one INFO line (GEMM and decode, with reasons) and the choice's warning.
    Raises XqaDecodeError where "xqa" was requested and cannot run. Planned once per model: a
    second call returns the first choice and logs nothing."""
    planned: DecodeChoice | None = model.__dict__.get(_PLAN_ATTR)
    if planned is not None:
        return planned
    facts = decode_facts(model, cfg, vllm_config)
    choice = choose_decode_kernel(
        cfg.kv_decode_kernel, facts, lambda: _xqa_module_error(model, vllm_config.cache_config.block_size)
    )
    if choice.xqa:
        for layer in _attention_layers(model):
            route_decode_to_xqa(layer.impl)
    live = make_flashinfer_scales_live(model, facts)
    model.__dict__[_PLAN_ATTR] = choice
    scales = f"; K/V scales read live by FlashInfer's decode in {live} layers (kv.flashinfer_scales)" if live else ""
    chosen = getattr(getattr(vllm_config, "quant_config", None), "attention_backend_chosen", None)
    backend = f"; attention backend {chosen} chosen by fp8_align (attention_backend unset)" if chosen else ""
    logger.info("fp8_align: engine plan: GEMM %s; decode %s (%s)%s%s", gemm_summary(model), choice.kernel, choice.reason, scales, backend)
    if choice.warning:
        logger.warning("fp8_align: %s", choice.warning)
    return choice
