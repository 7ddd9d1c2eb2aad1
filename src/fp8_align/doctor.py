"""`fp8-align doctor`: what this environment can run of the FP8 recipe, and why not."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from dataclasses import asdict, dataclass, field

import torch

from fp8_align.versions import (
    BITWISE_FEATURE,
    BITWISE_MOE_FEATURE,
    BITWISE_V2_FEATURE,
    FEATURE_SERIES,
    installed_vllm_version,
    is_tested_vllm,
    series_text,
    tested_range_text,
    vllm_series,
)


@dataclass(frozen=True)
class EnvironmentFacts:
    """Everything the report is derived from; `detect_environment()` fills it from this machine."""

    python: str
    torch: str
    torch_cuda: str | None
    cuda_available: bool
    gpu_name: str | None
    compute_capability: tuple[int, int] | None
    vllm: str | None
    deep_gemm: bool
    megatron_core: str | None
    transformer_engine: str | None
    te_block_scaling: bool
    te_import_error: str | None = None
    triton: str | None = None


@dataclass(frozen=True)
class RecipeOption:
    """One recipe capability: whether it can run here, and the reason."""

    name: str
    usable: bool
    reason: str


@dataclass(frozen=True)
class DoctorReport:
    facts: EnvironmentFacts
    vllm_supported: bool | None
    options: list[RecipeOption] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _te_block_scaling() -> tuple[bool, str | None]:
    """(TE has Float8BlockScaling, the import error when TE is installed but fails to import)."""
    if not _has_module("transformer_engine"):
        return False, None
    try:
        from transformer_engine.common import recipe
    except (ImportError, OSError, RuntimeError) as exc:  # reported, e.g. TE without GPU libraries
        return False, f"{type(exc).__name__}: {exc}"
    return hasattr(recipe, "Float8BlockScaling"), None


def detect_environment() -> EnvironmentFacts:
    """Read versions and device facts without importing vLLM or Megatron."""
    cuda = torch.cuda.is_available()
    te_block_scaling, te_import_error = _te_block_scaling()
    return EnvironmentFacts(
        python=platform.python_version(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=cuda,
        gpu_name=torch.cuda.get_device_name() if cuda else None,
        compute_capability=tuple(torch.cuda.get_device_capability()) if cuda else None,
        vllm=installed_vllm_version(),
        deep_gemm=_has_module("deep_gemm") or _has_module("vllm.third_party.deep_gemm"),
        megatron_core=_dist_version("megatron-core", "megatron_core"),
        transformer_engine=_dist_version("transformer-engine", "transformer_engine", "transformer-engine-torch"),
        te_block_scaling=te_block_scaling,
        te_import_error=te_import_error,
        triton=_dist_version("triton", "pytorch-triton"),
    )


def _cuda_at_least(version: str | None, major: int, minor: int) -> bool:
    if not version:
        return False
    got = tuple(int(p) for p in version.split(".")[:2])
    return got >= (major, minor)


def recipe_options(facts: EnvironmentFacts) -> list[RecipeOption]:
    """Which parts of the recipe can run with these facts, each with the reason."""
    cc = facts.compute_capability
    hopper = cc is not None and cc[0] == 9
    fp8_gpu = cc is not None and cc >= (8, 9)
    no_gpu = "no CUDA GPU visible"
    options = [
        RecipeOption("fp8 emulated linears (CPU)", True, "pure-torch reference path, bit-identical quantization"),
        RecipeOption(
            "fp8 GPU linears (CUTLASS/Triton block FP8)",
            fp8_gpu and facts.vllm is not None,
            no_gpu if cc is None else ("needs compute capability >= 8.9" if not fp8_gpu else ("vLLM not installed" if facts.vllm is None else f"sm{cc[0]}{cc[1]}")),
        ),
        RecipeOption(
            "use_deep_gemm (DeepGEMM block FP8)",
            hopper and facts.deep_gemm,
            no_gpu if cc is None else ("DeepGEMM kernels need Hopper (sm90)" if not hopper else ("DeepGEMM not found (bundled with vLLM >= 0.22 on CUDA)" if not facts.deep_gemm else "Hopper + DeepGEMM")),
        ),
        RecipeOption(
            "kv_cache_dtype=fp8",
            facts.vllm is not None,
            "vLLM not installed" if facts.vllm is None else "supported by the installed vLLM's attention backends (see docs for per-backend limits)",
        ),
        RecipeOption("on_policy='bitwise' (engine log-probs = trainer's, bit for bit)", *_bitwise_usable(facts)),
        RecipeOption(
            "training fp8_recipe=blockwise (TransformerEngine)",
            hopper and _cuda_at_least(facts.torch_cuda, 12, 9) and facts.te_block_scaling,
            _training_reason(facts, hopper),
        ),
    ]
    return options


def _bitwise_usable(facts: EnvironmentFacts) -> tuple[bool, str]:
    """Whether FP8Config(on_policy="bitwise") can run with these facts, and why (not)."""
    series = FEATURE_SERIES[BITWISE_FEATURE]
    cc = facts.compute_capability
    if cc is None:
        return False, "no CUDA GPU visible (its kernels are Triton on CUDA; on CPU use on_policy='off')"
    if cc < (8, 9):
        return False, f"needs FP8 tensor cores (compute capability >= 8.9; proven on H100/H200), this GPU is sm{cc[0]}{cc[1]}"
    if facts.vllm is None or vllm_series(facts.vllm) not in series:
        return False, f"runs on vLLM {series_text(series)}; the installed vLLM is {facts.vllm or 'none'}"
    if facts.triton is None:
        return False, "Triton not installed (the bitwise kernels are Triton kernels)"
    extensions = "; ".join(
        f"{feature}: {'yes' if vllm_series(facts.vllm) in FEATURE_SERIES[feature] else 'vLLM ' + series_text(FEATURE_SERIES[feature]) + ' only'}"
        for feature in (BITWISE_V2_FEATURE, BITWISE_MOE_FEATURE)
    )
    return True, f"CUDA sm{cc[0]}{cc[1]}, vLLM {facts.vllm}, Triton {facts.triton}; {extensions}"


def _training_reason(facts: EnvironmentFacts, hopper: bool) -> str:
    if facts.compute_capability is None:
        return "no CUDA GPU visible (blockwise FP8 training needs Hopper and CUDA >= 12.9)"
    if facts.compute_capability[0] >= 10:
        return "Blackwell: use FP8 generation with BF16 training (TE blockwise GEMMs are Hopper-only)"
    if not hopper:
        return "blockwise FP8 training needs Hopper (sm90)"
    if not _cuda_at_least(facts.torch_cuda, 12, 9):
        return f"CUDA {facts.torch_cuda} < 12.9"
    if facts.transformer_engine is None:
        return "TransformerEngine not installed"
    if not facts.te_block_scaling:
        return "installed TransformerEngine has no Float8BlockScaling recipe"
    return "Hopper, CUDA >= 12.9, TE with Float8BlockScaling"


def build_report(facts: EnvironmentFacts | None = None) -> DoctorReport:
    """The doctor report for `facts` (detected from this machine when None)."""
    facts = detect_environment() if facts is None else facts
    supported = None if facts.vllm is None else is_tested_vllm(facts.vllm)
    return DoctorReport(facts=facts, vllm_supported=supported, options=recipe_options(facts))


def format_report(report: DoctorReport) -> str:
    """Plain-text rendering, one fact or option per line."""
    f = report.facts
    gpu = "none" if f.gpu_name is None else f"{f.gpu_name} (sm{f.compute_capability[0]}{f.compute_capability[1]})"
    if f.vllm is None:
        vllm = "not installed"
    else:
        vllm = f"{f.vllm} ({'tested' if report.vllm_supported else 'OUTSIDE the tested range: ' + tested_range_text()})"
    lines = [
        "fp8_align environment report",
        f"  python              {f.python}",
        f"  torch               {f.torch} (CUDA {f.torch_cuda or 'none'})",
        f"  GPU                 {gpu}",
        f"  vLLM                {vllm}",
        f"  Triton              {f.triton or 'not installed'}",
        f"  DeepGEMM            {'available' if f.deep_gemm else 'not found'}",
        f"  megatron-core       {f.megatron_core or 'not installed'}",
        f"  TransformerEngine   {f.transformer_engine or 'not installed'}"
        + (" (Float8BlockScaling)" if f.te_block_scaling else "")
        + (f" (import failed: {f.te_import_error})" if f.te_import_error else ""),
        "recipe options:",
    ]
    lines += [f"  [{'ok' if o.usable else '--'}] {o.name}: {o.reason}" for o in report.options]
    return "\n".join(lines)
