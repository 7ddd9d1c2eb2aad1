"""Push new weights into a running vLLM engine every RL step, re-quantized with the engine's recipe.

Trainer side: `refit_weights(llm, weights)` with an in-process `vllm.LLM`. The tensors travel to
every worker as one safetensors file (raw tensors do not survive vLLM's multiprocess RPC), and
each worker runs `_refit_in_worker`:

1. Validate everything first (`plan_refit`): every name must be a tensor of the engine's own
   BF16 checkpoint (`model_config.model`), with that tensor's shape and dtype, and all values
   finite. Any problem raises `RefitError` naming the tensor, before anything is written.
2. FP8 layers (`Fp8AlignLinearMethod`): each Hugging Face tensor (q_proj, k_proj, gate_proj, ...)
   is mapped onto its vLLM merged module (`packed_modules_mapping`) and shard, quantized with
   `fp8_align.quant.quantize_weight_blockwise` (the same 128x128 recipe and scale mode the
   engine loaded with) and copied into the existing `weight` rows and `weight_scale_inv` grid
   rows in place: data pointers, and so captured graphs, stay valid. Only the sent shards change.
3. Everything else (BF16 edge layers, which vLLM-CPU repacks, embeddings, norms, lm_head) goes
   through vLLM's own layerwise reload (`model_runner.reload_weights`), which rebuilds the
   module from checkpoint format and copies the result into the old kernel tensors. That path
   rebuilds a whole module, so a module outside FP8 must receive all of its checkpoint tensors
   (all of q/k/v of a BF16 attention layer); partial sends there raise `RefitError`.

vLLM's reload resets attention KV scales to 1.0; the worker reads them before and writes them
back after, so a refit leaves the scales last pushed (`kv_scales.push_kv_scales`) in place.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8_align.quant import quantize_weight_blockwise
from fp8_align.vllm_plugin.kv_scales import read_layer_scales, write_layer_scales

#: Rows (and columns) of one weight scale block.
WEIGHT_BLOCK = 128
#: Where trainer-side tensors are staged for the workers (RAM-backed when available).
STAGING_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None


class RefitError(ValueError):
    """A weight update was refused; nothing in the engine was changed."""


@dataclass(frozen=True)
class RefitResult:
    """What one worker did for one `refit_weights` call."""

    fp8_tensors: int  # checkpoint tensors re-quantized in place into FP8 layers
    reloaded_tensors: int  # checkpoint tensors loaded through vLLM's layerwise reload
    seconds: float  # wall time inside the worker, validation included


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Fp8ShardWrite:
    """One checkpoint tensor bound for rows of an FP8 layer's `weight` (or `bias`)."""

    name: str  # checkpoint name, e.g. model.layers.1.self_attn.k_proj.weight
    layer: torch.nn.Module  # the vLLM linear module (Fp8AlignLinearMethod)
    param: str  # "weight" or "bias"
    shard: int  # index into layer.fp8_align_shard_sizes
    tensor: torch.Tensor  # the checkpoint tensor, [n_shard, K] (weight) or [n_shard] (bias)


@dataclass(frozen=True)
class RefitPlan:
    """A validated update: FP8 shards written in place, the rest through vLLM's reload."""

    fp8: list[Fp8ShardWrite]
    reload: dict[str, torch.Tensor]


def refit_weights(llm: Any, weights: Mapping[str, torch.Tensor] | str | os.PathLike[str]) -> list[RefitResult]:
    """Load `weights` into every worker of `llm` (a `vllm.LLM`), re-quantizing FP8 layers.

    weights: checkpoint-format tensors by Hugging Face name (any subset of the checkpoint the
        engine was started from, same shapes and dtypes, CPU or GPU), or a path to one
        `.safetensors` file or a directory of them.
    Returns one `RefitResult` per worker. A refused update raises `RefitError` here (non-tensor
    values, bad path) or in the worker, which vLLM 0.32 re-raises here as a plain
    `Exception("Worker failed with error '<RefitError message>', ...")`; either message names the
    offending tensor, and the engine still serves the previous weights. Clears the prefix cache,
    whose KV entries were computed with the old weights.
    Needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (the worker function is pickled).
    """
    if isinstance(weights, Mapping):
        with tempfile.TemporaryDirectory(prefix="fp8_align_refit_", dir=STAGING_ROOT) as staging:
            return _refit_files(llm, [_stage(weights, Path(staging))])
    return _refit_files(llm, _safetensors_files(Path(weights)))


def _refit_files(llm: Any, files: list[str]) -> list[RefitResult]:
    results = llm.collective_rpc(_refit_in_worker, args=(files,))
    llm.reset_prefix_cache()
    return results


def _stage(weights: Mapping[str, torch.Tensor], directory: Path) -> str:
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            raise RefitError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    path = directory / "weights.safetensors"
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in weights.items()}, str(path))
    return str(path)


def _safetensors_files(path: Path) -> list[str]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or any(f.suffix != ".safetensors" or not f.is_file() for f in files):
        raise RefitError(f"{path}: expected a .safetensors file or a directory holding some")
    return [str(f) for f in files]


def _refit_in_worker(worker: Any, files: list[str]) -> RefitResult:
    """Worker side of `refit_weights` (runs in every vLLM worker via collective_rpc)."""
    start = time.perf_counter()
    model = worker.get_model()
    plan = plan_refit(model, _load_updates(files), checkpoint_layout(worker.vllm_config.model_config.model))
    if plan.reload:
        # vLLM's reload resets every attention layer's KV scales to 1.0; keep the pushed ones.
        kv_scales = read_layer_scales(model)
        worker.model_runner.reload_weights(weights_iterator=iter(plan.reload.items()), is_checkpoint_format=True)
        if kv_scales:
            write_layer_scales(model, kv_scales)
    with torch.no_grad():
        for write in plan.fp8:
            _write_fp8_shard(write)
    return RefitResult(len(plan.fp8), len(plan.reload), time.perf_counter() - start)


def _load_updates(files: list[str]) -> dict[str, torch.Tensor]:
    updates: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in load_file(path).items():
            if name in updates:
                raise RefitError(f"{name}: sent twice ({path} and an earlier file)")
            updates[name] = tensor
    return updates


_LAYOUT_CACHE: dict[str, dict[str, TensorSpec]] = {}


def checkpoint_layout(model_path: str) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of the checkpoint at `model_path` (safetensors headers only).

    `model_path` is a local directory or a Hugging Face repo id already in the local cache.
    Cached per path: the layout of a running engine does not change.
    """
    if model_path not in _LAYOUT_CACHE:
        directory = Path(model_path)
        if not directory.is_dir():
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(model_path, local_files_only=True, allow_patterns=["*.safetensors"]))
        layout: dict[str, TensorSpec] = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    tensor_slice = handle.get_slice(name)
                    layout[name] = TensorSpec(tuple(tensor_slice.get_shape()), _safetensors_dtype(tensor_slice.get_dtype()))
        if not layout:
            raise RefitError(f"{directory}: no .safetensors tensors; refit validates names against the checkpoint")
        _LAYOUT_CACHE[model_path] = layout
    return _LAYOUT_CACHE[model_path]


def _safetensors_dtype(code: str) -> torch.dtype:
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    if code not in dtypes:
        raise RefitError(f"checkpoint tensor dtype {code} is not a floating weight dtype fp8_align refits")
    return dtypes[code]


def plan_refit(model: torch.nn.Module, updates: dict[str, torch.Tensor], layout: dict[str, TensorSpec]) -> RefitPlan:
    """Validate `updates` against the checkpoint `layout` and the live `model`; write nothing.

    Raises RefitError naming the first offending tensor: unknown name, shape or dtype other than
    the checkpoint's, a non-finite value, or a partial send to a module refit by vLLM's reload.
    """
    if not updates:
        raise RefitError("empty weight update")
    for name, tensor in updates.items():
        _check_tensor(name, tensor, layout)
    modules = dict(model.named_modules())
    packed = dict(getattr(model, "packed_modules_mapping", {}))
    fp8: list[Fp8ShardWrite] = []
    reload: dict[str, torch.Tensor] = {}
    for name, tensor in updates.items():
        module_name, param, shard = _vllm_target(name, packed)
        layer = modules.get(module_name)
        if layer is not None and hasattr(layer, "fp8_align_kernel") and param in ("weight", "bias"):
            write = Fp8ShardWrite(name, layer, param, shard, tensor)
            _check_fp8_target(write)
            fp8.append(write)
        else:
            reload[name] = tensor
    _check_whole_modules(reload, layout, packed)
    return RefitPlan(fp8, reload)


def _check_tensor(name: str, tensor: torch.Tensor, layout: dict[str, TensorSpec]) -> None:
    spec = layout.get(name)
    if spec is None:
        raise RefitError(f"{name}: not a tensor of the engine's checkpoint")
    if tuple(tensor.shape) != spec.shape:
        raise RefitError(f"{name}: shape {tuple(tensor.shape)}, the checkpoint has {spec.shape}")
    if tensor.dtype != spec.dtype:
        raise RefitError(f"{name}: dtype {tensor.dtype}, the checkpoint has {spec.dtype}")
    if not bool(torch.isfinite(tensor).all()):
        raise RefitError(f"{name}: holds NaN or Inf")


def _vllm_target(name: str, packed: Mapping[str, list[str]]) -> tuple[str, str, int]:
    """(vLLM module name, parameter, shard index) for a checkpoint name.

    model.layers.1.self_attn.k_proj.weight -> (model.layers.1.self_attn.qkv_proj, weight, 1).
    """
    module_name, _, param = name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    for merged, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{merged}" if parent else merged, param, parts.index(leaf)
    return module_name, param, 0


def _check_fp8_target(write: Fp8ShardWrite) -> None:
    layer = write.layer
    if layer.tp_size != 1:
        raise RefitError(f"{write.name}: in-place FP8 refit supports tensor parallel size 1, the engine runs {layer.tp_size}")
    sizes = layer.fp8_align_shard_sizes
    if write.shard >= len(sizes):
        raise RefitError(f"{write.name}: shard {write.shard} but {layer.fp8_align_prefix} has shards {sizes}")
    expected = (sizes[write.shard], layer.weight.shape[1]) if write.param == "weight" else (sizes[write.shard],)
    if tuple(write.tensor.shape) != expected:
        raise RefitError(f"{write.name}: shape {tuple(write.tensor.shape)}, {layer.fp8_align_prefix} shard needs {expected}")
    if write.param == "bias" and getattr(layer, "bias", None) is None:
        raise RefitError(f"{write.name}: {layer.fp8_align_prefix} has no bias")


def _check_whole_modules(reload: dict[str, torch.Tensor], layout: dict[str, TensorSpec], packed: Mapping[str, list[str]]) -> None:
    """vLLM's layerwise reload rebuilds whole modules: each touched one must get all its tensors."""
    needed: dict[str, set[str]] = {}
    for name in layout:
        needed.setdefault(_vllm_target(name, packed)[0], set()).add(name)
    for name in reload:
        missing = needed[_vllm_target(name, packed)[0]] - reload.keys()
        if missing:
            raise RefitError(
                f"{name}: its module is refit through vLLM's reload, which rebuilds the whole module; "
                f"also send {sorted(missing)}"
            )


def _write_fp8_shard(write: Fp8ShardWrite) -> None:
    """Quantize one checkpoint shard and copy codes, scales (or bias) into the layer's storage."""
    layer = write.layer
    sizes = layer.fp8_align_shard_sizes
    row = sum(sizes[: write.shard])
    rows = slice(row, row + sizes[write.shard])
    device = layer.weight.device
    tensor = write.tensor
    if write.param == "bias":
        layer.bias.data[rows].copy_(tensor.to(device))
        return
    codes, scales = quantize_weight_blockwise(tensor.to(device), pow2_scale=layer.quant_method.cfg.use_weight_pow2_scale)
    scale_row = sum(-(-size // WEIGHT_BLOCK) for size in sizes[: write.shard])
    layer.weight.data[rows].copy_(codes)
    layer.weight_scale_inv.data[scale_row : scale_row + scales.shape[0]].copy_(scales)
