"""Block-FP8 GEMM backends on CUDA (vLLM 0.22, Hopper) and their per-layer selection.

Every backend computes `fp8_align.quant.blockwise_fp8_linear`: activations quantized to E4M3 in
1x128 groups by `fp8_align.quant.triton_groupwise.quantize_activation_triton` (bit-identical to
`fp8_align.quant.quantize_activation_groupwise` on CUDA, tested), then a block-scaled GEMM of
those codes with the layer's E4M3 weight codes and the FP32 (or power-of-two) scales exactly as
`fp8_align.quant.quantize_weight_blockwise` computed them. No backend re-rounds a scale:
DeepGEMM is called with `is_deep_gemm_e8m0_used=False`, so vLLM's VLLM_USE_DEEP_GEMM_E8M0
default (UE8M0 rounding on Hopper) never reaches these layers. The torch reference of each
backend is `fp8_align.quant.fp8_block_gemm`; tests/test_gpu_kernels.py checks them against it.

Backends, in the order `select_gpu_kernel` tries them:

    deepgemm          vLLM-bundled DeepGEMM `fp8_gemm_nt` (SM90, bf16 out, uniform 128 grid)
    cutlass           vLLM `cutlass_scaled_mm` with 1x128 / 128x128 block scales (uniform grid)
    cublas            `torch._scaled_mm` blockwise (cuBLASLt, SM90; uniform 128 grid; only
                      where a start-up probe against the reference passes; `kernels.cublas`)
    triton            vLLM `w8a8_triton_block_scaled_mm` on the merged weight (any K, partial
                      last shard)
    triton_per_shard  the same Triton GEMM once per shard of a merged weight (any shapes)
    emulated          the torch reference itself (always possible; slow)

"Uniform 128 grid": N of every shard and K are multiples of 128, so the stacked per-shard
scale grids (`layer.weight_scale_inv`, [sum ceil(n_s/128), ceil(K/128)]) equal the single
[N/128, K/128] grid a one-shot kernel expects.

DeepGEMM kernels are JIT-compiled per shape and M tiling; `DeepGemmBlockFp8Kernel.warm_up`
compiles them while the engine loads, as vLLM does for its own FP8 layers, or loads them from a
JIT cache `fp8-align prepare-deepgemm` filled ahead (`deepgemm_inventory` says which); a cold
cache is filled at engine start by that command in parallel processes (`deepgemm_fill`), with a
warning naming it. It never changes the backend.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

# Importing these vLLM modules registers the custom ops the backends call:
# torch.ops.vllm.fp8_gemm_nt_op, .w8a8_triton_block_scaled_mm_func (and .padded_cutlass up to 0.22).
import vllm.model_executor.kernels.linear.scaled_mm.cutlass  # noqa: F401
import vllm.model_executor.kernels.linear.scaled_mm.deep_gemm  # noqa: F401
import vllm.model_executor.kernels.linear.scaled_mm.triton  # noqa: F401
from vllm import envs
from vllm._custom_ops import cutlass_scaled_mm_supports_block_fp8
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.triton_utils import HAS_TRITON
from vllm.utils.deep_gemm import is_deep_gemm_supported

from fp8_align.config import FP8Config
from fp8_align.quant.shards import shard_slices
from fp8_align.quant.triton_groupwise import ScaleLayout, empty_scales  # registers fp8_align::quantize_activation_groupwise
from fp8_align.versions import installed_vllm_version
from fp8_align.vllm_plugin.compat import cutlass_block_fp8_mm
from fp8_align.vllm_plugin.kernels.base import BLOCK, BlockFp8Kernel, LayerShape
from fp8_align.vllm_plugin.kernels.cublas import cublas_probe_error  # registers fp8_align::cublas_block_scaled_mm
from fp8_align.vllm_plugin.kernels.deepgemm_fill import cold_shapes, fill_command, fill_lock, model_deepgemm_shapes, run_fill
from fp8_align.vllm_plugin.kernels.deepgemm_inventory import (
    JIT_CACHE_ENV_VAR,
    Warmup,
    cache_setup,
    compile_jobs,
    is_prepared,
    jit_cache_dir,
    mark_prepared,
    note_warmup,
    was_warmed_up,
)
from fp8_align.vllm_plugin.kernels.emulated import emulated_block_fp8_linear

logger = logging.getLogger("vllm.fp8_align")


# --------------------------------------------------------------------------- eligibility
@dataclass(frozen=True)
class Target:
    """Where a layer runs: the CUDA device, its capability, the output dtype, the config."""

    device: torch.device
    capability: tuple[int, int]
    out_dtype: torch.dtype
    cfg: FP8Config


def _full_blocks_reason(shape: LayerShape) -> str | None:
    if shape.full_blocks:
        return None
    return f"needs every shard and K to be multiples of 128 ({shape.describe()})"


#: A DeepGEMM warm-up slower than this (seconds per [N, K]) compiled rather than loaded its kernels.
DEEPGEMM_COLD_WARMUP_S = 20.0
#: Seconds DeepGEMM takes to compile one kernel on an H100 (what a cold warm-up costs per M value).
DEEPGEMM_COMPILE_S = 0.8


def deepgemm_warmup_m_values(n: int, max_tokens: int, device: torch.device) -> list[int]:
    """The M values (token counts) an [N, K] DeepGEMM layer is warmed up with: vLLM's own choice
    per VLLM_DEEP_GEMM_WARMUP ("relax": every M where DeepGEMM's tiling or wave count changes, up
    to `max_tokens`; "full": 1..max_tokens). A set for a smaller `max_tokens` is a subset."""
    from vllm.model_executor.warmup.deep_gemm_warmup import _generate_optimal_warmup_m_values

    if envs.VLLM_DEEP_GEMM_WARMUP == "relax":
        return _generate_optimal_warmup_m_values(max_tokens, n, device)
    return list(range(1, max_tokens + 1))


def deepgemm_cache_setup(device: torch.device) -> str:
    """`deepgemm_inventory.cache_setup` of this GPU model, vLLM release and VLLM_DEEP_GEMM_WARMUP."""
    return cache_setup(torch.cuda.get_device_name(device), installed_vllm_version(), envs.VLLM_DEEP_GEMM_WARMUP)


#: (cache directory, model, max_num_batched_tokens) a cold-cache warning was logged for in this process.
_COLD_CACHES_WARNED: set[tuple[str, str, int]] = set()


def _warn_cold_cache(vllm_config: VllmConfig, cache: Path, setup: str, n: int, k: int, kernels: int, device: torch.device) -> None:
    """Warn, once per engine setting and process, that the engine's warm-up is about to compile
    DeepGEMM kernels one after another, how many (every [N, K] not marked prepared of a model
    `decoder_linear_shapes` describes, else this shape's), and the `fp8-align prepare-deepgemm` command that avoids it."""
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    tp = vllm_config.parallel_config.tensor_parallel_size
    model = str(vllm_config.model_config.model)
    if (str(cache), model, max_tokens) in _COLD_CACHES_WARNED:
        return
    _COLD_CACHES_WARNED.add((str(cache), model, max_tokens))
    shapes = model_deepgemm_shapes(vllm_config.model_config.hf_text_config.to_dict(), tp)  # []: only this shape is known
    cold = [s for s in shapes if not is_prepared(cache, setup, s.n, s.k, max_tokens)]
    if cold:
        kernels = sum(len(deepgemm_warmup_m_values(s.n, max_tokens, device)) for s in cold)
        what = f"{len(cold)} layer shapes: {', '.join(f'N={s.n} K={s.k}' for s in cold)}"
        shapes_arg = ",".join(f"{s.n}x{s.k}" for s in cold)
    else:
        what = f"N={n} K={k}, and as many again for each other shape of this model not prepared"
        shapes_arg = f"{n}x{k},... (each `DeepGEMM warm-up N= K=` this engine logs)"
    source = f"--model {model}" if Path(model).is_dir() else f"--shapes {shapes_arg}"
    logger.warning(
        "fp8_align: DeepGEMM's JIT cache %s is not marked prepared for this engine (%s, up to %d batched tokens): "
        "this start compiles up to %d DeepGEMM kernels one after another (~%.1f s each on an H100, ~%.0f min) before "
        "the engine serves. DeepGEMM stays the GEMM. Next time, fill the cache ahead in parallel (once per GPU model and "
        "vLLM version): `fp8-align prepare-deepgemm %s --cache-dir %s --max-num-batched-tokens %d%s` and start the "
        "engine with %s=%s",
        cache, what, max_tokens, kernels, DEEPGEMM_COMPILE_S, kernels * DEEPGEMM_COMPILE_S / 60, source, cache,
        max_tokens, f" --tensor-parallel-size {tp}" if tp > 1 else "", JIT_CACHE_ENV_VAR, cache,
    )  # fmt: skip


#: (cache directory, model, max_num_batched_tokens) whose parallel fill failed in this process.
_FILLS_FAILED: set[tuple[str, str, int]] = set()
#: (cache directory, N, K) of the shapes cold at this start and filled by a fill this process ran or waited for.
_FILLED_AT_START: set[tuple[str, int, int]] = set()


def _fill_cold_cache(vllm_config: VllmConfig, cache: Path, setup: str, n: int, k: int, device: torch.device) -> bool:
    """Compile every cold DeepGEMM shape of the engine's model ahead of the warm-ups, in parallel
    processes (`deepgemm_fill`: `fp8-align prepare-deepgemm` as a child process, under the cache's
    lock so that one tensor-parallel rank fills and the others wait); True when [n, k] is marked
    prepared afterwards. A failed fill is warned about with its reason, once per engine setting
    and process, and returns False: the warm-ups then compile one kernel after another."""
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    tp = vllm_config.parallel_config.tensor_parallel_size
    key = (str(cache), str(vllm_config.model_config.model), max_tokens)
    if key in _FILLS_FAILED:
        return False
    config = vllm_config.model_config.hf_text_config.to_dict()
    cold_at_start = cold_shapes(config, tp, cache, setup, max_tokens, n, k)
    with fill_lock(cache):
        cold = cold_shapes(config, tp, cache, setup, max_tokens, n, k)
        if cold:  # else another rank filled them while this one waited
            index = device.index if device.index is not None else torch.cuda.current_device()
            jobs = compile_jobs(cold, max_tokens, torch.cuda.mem_get_info(index)[0], os.cpu_count() or 1)
            command = fill_command(cold, cache, max_tokens, jobs, index)
            logger.warning(
                "fp8_align: DeepGEMM's JIT cache %s is not marked prepared for this engine (%s, up to %d batched tokens): "
                "compiling their %d kernels in %d parallel processes before the engine serves (`%s`). DeepGEMM stays the "
                "GEMM. Next time start with the cache filled ahead (the same `fp8-align prepare-deepgemm`, once per GPU "
                "model and vLLM version) and %s=%s",
                cache, ", ".join(f"N={s.n} K={s.k}" for s in cold), max_tokens,
                sum(len(deepgemm_warmup_m_values(s.n, max_tokens, device)) for s in cold), jobs,
                " ".join(["fp8-align", *command[3:]]), JIT_CACHE_ENV_VAR, cache,
            )  # fmt: skip
            reason = run_fill(command)
            if reason is not None:
                _FILLS_FAILED.add(key)
                logger.warning(
                    "fp8_align: filling DeepGEMM's JIT cache %s in parallel failed (%s); the warm-up compiles its kernels "
                    "one after another instead", cache, reason,
                )  # fmt: skip
                return False
    _FILLED_AT_START.update((str(cache), s.n, s.k) for s in cold_at_start if is_prepared(cache, setup, s.n, s.k, max_tokens))
    return is_prepared(cache, setup, n, k, max_tokens)


# --------------------------------------------------------------------------- backends
def _as_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@dataclass(frozen=True)
class GpuBlockFp8Kernel(BlockFp8Kernel):
    """A CUDA backend: activation quantization in `scale_layout`, then `gemm`.

    `passed` records why the backends tried before this one were not chosen.
    """

    passed: tuple[str, ...] = ()
    scale_layout: ClassVar[ScaleLayout] = ScaleLayout.ROW_MAJOR

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        """None when this backend runs `shape` exactly on `target`, else the reason it cannot."""
        raise NotImplementedError

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """[M, N] `out_dtype` block-scaled product of [M, K] e4m3 codes (scales [M, ceil(K/128)]
        float32 in `scale_layout`) with the layer's weight codes and `weight_scale_inv`."""
        raise NotImplementedError

    def prepare(self, layer: torch.nn.Module) -> None:
        """Log the choice for this layer (its name, shape, and why earlier backends were passed)."""
        logger.info(
            "fp8_align: %s [%s] -> %s (passed: %s)",
            layer.fp8_align.prefix,
            LayerShape(*layer.weight.shape, tuple(layer.fp8_align.shard_sizes)).describe(),
            self.name,
            "; ".join(self.passed) or "none",
        )

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        act_pow2: bool,
        scale_rule: str = "amax_over_max",
    ) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype: 1x128 FP8 activations, block-FP8 GEMM, + bias."""
        x2 = _as_2d(x)
        x_fp8, x_scale = torch.ops.fp8_align.quantize_activation_groupwise(x2, act_pow2, int(self.scale_layout), scale_rule)
        out = self.gemm(layer, x_fp8, x_scale, x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


@dataclass(frozen=True)
class DeepGemmBlockFp8Kernel(GpuBlockFp8Kernel):
    """DeepGEMM `fp8_gemm_nt` (vLLM-bundled) with FP32 scales as given: no UE8M0 cast."""

    name: str = "deepgemm"
    scale_layout: ClassVar[ScaleLayout] = ScaleLayout.COLUMN_MAJOR_TMA

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        if not target.cfg.use_deep_gemm:
            return "use_deep_gemm=False"
        if target.capability != (9, 0):
            return f"FP32 block scales are kept exactly only by DeepGEMM's SM90 kernels (device is sm{target.capability[0]}{target.capability[1]})"
        if not is_deep_gemm_supported():
            return "DeepGEMM is not available (vllm.utils.deep_gemm.is_deep_gemm_supported() is False)"
        if target.out_dtype != torch.bfloat16:
            return f"DeepGEMM writes bf16 only (layer dtype {target.out_dtype})"
        return _full_blocks_reason(shape)

    def prepare(self, layer: torch.nn.Module) -> None:
        """Refuse a non-bf16 layer (selection assumed bf16 output), then log the choice."""
        if layer.params_dtype != torch.bfloat16:
            raise ValueError(
                f"fp8_align: {layer.fp8_align.prefix} has dtype {layer.params_dtype} but DeepGEMM was selected for "
                "bf16 output; pass the layer dtype as select_kernel(..., out_dtype=)"
            )
        super().prepare(layer)
        self.warm_up(layer)

    def warm_up(self, layer: torch.nn.Module) -> None:
        """JIT-compile DeepGEMM for every M the engine can run this layer's [N, K] with.

        DeepGEMM compiles a kernel per (N, K, M-dependent tiling) on first use; vLLM warms its
        own FP8 layers up at start (`deep_gemm_warmup`, M values per VLLM_DEEP_GEMM_WARMUP) but
        not ours, so without this the compiles land inside generate calls. Same M values, our
        call path (FP32 scales, TMA-aligned activation scales), once per [N, K]. Needs the
        engine's config (max_num_batched_tokens): outside an engine (unit tests, weight reload,
        which reuses the compiled kernels) nothing is compiled ahead. Kernels already in
        DeepGEMM's JIT cache (DG_JIT_CACHE_DIR) are loaded, not compiled: `fp8-align
        prepare-deepgemm` fills it ahead, in parallel. A shape the cache is not marked prepared
        for (`deepgemm_inventory.is_prepared`) is filled first, with every other cold shape of
        the model, by that command run at this start (`_fill_cold_cache`, a warning naming it);
        where that fails, a warning, and the kernels compile here one after another. Once
        warmed up a shape is marked, so the next engine start with that cache loads it.
        """
        n, k = layer.weight.shape
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None or envs.VLLM_DEEP_GEMM_WARMUP == "skip" or was_warmed_up(n, k):
            return
        device = layer.weight.device
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        cache, setup = jit_cache_dir(envs.VLLM_CACHE_ROOT), deepgemm_cache_setup(device)
        ahead = is_prepared(cache, setup, n, k, max_tokens)
        prepared = ahead or _fill_cold_cache(vllm_config, cache, setup, n, k, device)
        m_values = deepgemm_warmup_m_values(n, max_tokens, device)
        if not prepared:
            _warn_cold_cache(vllm_config, cache, setup, n, k, len(m_values), device)
        start = time.perf_counter()
        self.run_for_m_values(layer, m_values)
        seconds = time.perf_counter() - start
        if not prepared:
            try:
                mark_prepared(cache, setup, n, k, max_tokens)
            except OSError as exc:  # a read-only cache: the engine runs, the next start warns again
                logger.warning("fp8_align: could not mark N=%d K=%d prepared in DeepGEMM's JIT cache %s: %s", n, k, cache, exc)
        filled = prepared and (not ahead or (str(cache), n, k) in _FILLED_AT_START)
        note_warmup(Warmup(n, k, len(m_values), prepared, seconds, str(cache), filled_at_start=filled))
        logger.info(
            "fp8_align: DeepGEMM warm-up N=%d K=%d: %d M values in %.1f s (%s)",
            n, k, len(m_values), seconds, "JIT cache marked prepared" if prepared else "not marked prepared: compiled where missing",
        )  # fmt: skip
        if prepared and seconds > DEEPGEMM_COLD_WARMUP_S:
            logger.warning(
                "fp8_align: DeepGEMM's JIT cache %s was marked prepared for N=%d K=%d but its warm-up took %.1f s: its "
                "kernels were compiled again (cache files removed, or another DeepGEMM or CUDA build); run "
                "`fp8-align prepare-deepgemm` into it again",
                cache, n, k, seconds,
            )  # fmt: skip

    def run_for_m_values(self, layer: torch.nn.Module, m_values: list[int]) -> None:
        """Run the layer's GEMM once for each M (zero activations), compiling what DeepGEMM's JIT
        cache lacks. `layer` needs only `weight` ([N, K] e4m3) and `weight_scale_inv`."""
        n, k = layer.weight.shape
        device = layer.weight.device
        x_fp8 = torch.zeros((max(m_values), k), dtype=torch.float8_e4m3fn, device=device)
        for m in m_values:
            x_scale = empty_scales(m, k // BLOCK, self.scale_layout, device).fill_(1.0)
            self.gemm(layer, x_fp8[:m], x_scale, torch.bfloat16)
        torch.cuda.synchronize(device)

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty((x_fp8.shape[0], layer.weight.shape[0]), dtype=out_dtype, device=x_fp8.device)
        torch.ops.vllm.fp8_gemm_nt_op(x_fp8, x_scale, layer.weight, layer.weight_scale_inv, out, False)
        return out


@dataclass(frozen=True)
class CutlassBlockFp8Kernel(GpuBlockFp8Kernel):
    """vLLM's CUTLASS block-scaled FP8 GEMM (`compat.cutlass_block_fp8_mm`)."""

    name: str = "cutlass"
    scale_layout: ClassVar[ScaleLayout] = ScaleLayout.COLUMN_MAJOR

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        capability = target.capability[0] * 10 + target.capability[1]
        if not cutlass_scaled_mm_supports_block_fp8(capability):
            return f"vLLM's CUTLASS build has no block-FP8 kernel for sm{capability}"
        if target.out_dtype not in (torch.bfloat16, torch.float16):
            return f"CUTLASS writes bf16/fp16 only (layer dtype {target.out_dtype})"
        return _full_blocks_reason(shape)

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return cutlass_block_fp8_mm(x_fp8, layer.weight, x_scale, layer.weight_scale_inv, out_dtype)


@dataclass(frozen=True)
class CublasBlockFp8Kernel(GpuBlockFp8Kernel):
    """`torch._scaled_mm` with DeepSeek-style block scales (cuBLASLt, SM90 only): the custom op
    `fp8_align::cublas_block_scaled_mm` of `kernels.cublas`."""

    name: str = "cublas"
    scale_layout: ClassVar[ScaleLayout] = ScaleLayout.COLUMN_MAJOR

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        if target.capability != (9, 0):
            return f"torch's 1x128/128x128 block scaling is SM90-only (device is sm{target.capability[0]}{target.capability[1]})"
        if target.out_dtype not in (torch.bfloat16, torch.float16):
            return f"bf16/fp16 output only (layer dtype {target.out_dtype})"
        reason = _full_blocks_reason(shape)
        if reason is not None:
            return reason
        return cublas_probe_error(target.device.index if target.device.index is not None else torch.cuda.current_device())

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.fp8_align.cublas_block_scaled_mm(x_fp8, x_scale, layer.weight, layer.weight_scale_inv, out_dtype)


def _triton_gemm_reason() -> str | None:
    return None if HAS_TRITON else "vLLM reports no usable Triton"


@dataclass(frozen=True)
class TritonBlockFp8Kernel(GpuBlockFp8Kernel):
    """vLLM's Triton block-FP8 GEMM on the merged weight (masks partial N and K blocks)."""

    name: str = "triton"

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        if not shape.uniform_grid:
            return f"a shard before the last is not a multiple of 128 ({shape.describe()}): the stacked scale grids are not one grid"
        return _triton_gemm_reason()

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.vllm.w8a8_triton_block_scaled_mm_func(
            x_fp8, layer.weight, x_scale, layer.weight_scale_inv, [BLOCK, BLOCK], out_dtype
        )


@dataclass(frozen=True)
class ShardedTritonBlockFp8Kernel(GpuBlockFp8Kernel):
    """vLLM's Triton block-FP8 GEMM once per shard (q|k|v, gate|up), outputs concatenated."""

    name: str = "triton_per_shard"

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        return _triton_gemm_reason()

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        outputs = [
            torch.ops.vllm.w8a8_triton_block_scaled_mm_func(
                x_fp8, layer.weight[rows], x_scale, layer.weight_scale_inv[scale_rows], [BLOCK, BLOCK], out_dtype
            )
            for rows, scale_rows in shard_slices(layer.fp8_align.shard_sizes)
        ]
        return torch.cat(outputs, dim=-1)


@dataclass(frozen=True)
class ReferenceBlockFp8Kernel(GpuBlockFp8Kernel):
    """The torch reference (the emulated op of `EmulatedBlockFp8Kernel`, widening the codes per
    call, which is cheap on a GPU) on the GPU: last resort, always possible."""

    name: str = "emulated"

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        return None

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        act_pow2: bool,
        scale_rule: str = "amax_over_max",
    ) -> torch.Tensor:
        return emulated_block_fp8_linear(x, layer.weight, layer, bias, act_pow2, scale_rule)


#: The order `select_gpu_kernel` tries backends in (fastest first on H100, see benchmarks/gemm_kernels.py).
GPU_KERNEL_ORDER: tuple[type[GpuBlockFp8Kernel], ...] = (
    DeepGemmBlockFp8Kernel,
    CutlassBlockFp8Kernel,
    CublasBlockFp8Kernel,
    TritonBlockFp8Kernel,
    ShardedTritonBlockFp8Kernel,
    ReferenceBlockFp8Kernel,
)


def select_gpu_kernel(
    cfg: FP8Config,
    weight_shape: torch.Size,
    shard_sizes: list[int],
    device: torch.device,
    out_dtype: torch.dtype = torch.bfloat16,
) -> GpuBlockFp8Kernel:
    """The first backend in `GPU_KERNEL_ORDER` that runs this layer exactly.

    Args:
        weight_shape: [N, K] of the FP8 codes; shard_sizes: the N of each stacked shard.
        device: the CUDA device of the weight; out_dtype: the layer's activation dtype.
    Returns the backend, carrying in `passed` the reason each earlier backend was not used
    (logged at INFO by `prepare`).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = Target(device, torch.cuda.get_device_capability(index), out_dtype, cfg)
    shape = LayerShape(int(weight_shape[0]), int(weight_shape[1]), tuple(int(s) for s in shard_sizes))
    passed: list[str] = []
    for kernel_type in GPU_KERNEL_ORDER:
        reason = kernel_type().unsupported_reason(shape, target)
        if reason is None:
            return kernel_type(passed=tuple(passed))
        passed.append(f"{kernel_type.name}: {reason}")
    raise AssertionError("ReferenceBlockFp8Kernel accepts every layer")

