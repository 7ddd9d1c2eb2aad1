"""What a weight update into a running engine is checked against: the engine's own checkpoint.

A leaf of the plugin (it imports no other fp8_align module), shared by the RL stacks' sync
(`refit.weight_sync`), `refit.push.refit_weights` and the layers' re-quantizing loaders
(`linear.method`, `moe.experts`):

- `checkpoint_layout`: names, shapes and dtypes of the checkpoint the engine was started from;
  `check_tensor`: one update tensor against it; `SYNC_DTYPES`: what the RL stacks' sync accepts.
- `vllm_target` / `modules_named`: where a checkpoint tensor lands in the vLLM model (merged
  q|k|v and gate|up modules through the model's `packed_modules_mapping`).
- `original_load_weights`: the model class's own `load_weights`, under any wrapper.
- `RefitError`, the one exception family of weight updates; `WeightSyncError` is its kind raised
  by a layer's re-quantizing loader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open

#: dtypes a tensor of the RL stacks' sync may have; it is cast to the layer's dtype as at engine start.
SYNC_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class RefitError(ValueError):
    """A weight update was refused; nothing in the engine was changed."""


class WeightSyncError(RefitError):
    """A tensor the model's `load_weights` sent to an fp8_align FP8 layer cannot be re-quantized."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


_LAYOUT_CACHE: dict[str, dict[str, TensorSpec]] = {}


def checkpoint_layout(model_path: str) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of the checkpoint at `model_path` (safetensors headers only).

    `model_path` is a local directory or a Hugging Face repo id already in the local cache.
    Cached per path: the layout of a running engine does not change. Raises RefitError for a
    checkpoint without safetensors tensors or with a tensor of a non-floating dtype.
    """
    if model_path not in _LAYOUT_CACHE:
        directory = Path(model_path)
        if not directory.is_dir():
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


def check_tensor(
    name: str, tensor: torch.Tensor, layout: Mapping[str, TensorSpec], dtypes: tuple[torch.dtype, ...] | None = None
) -> None:
    """RefitError unless `name` is in `layout` with `tensor`'s shape, and `tensor`'s dtype is the
    checkpoint's (or, when given, one of `dtypes`)."""
    spec = layout.get(name)
    if spec is None:
        raise RefitError(f"{name}: not a tensor of the engine's checkpoint")
    if tuple(tensor.shape) != spec.shape:
        raise RefitError(f"{name}: shape {tuple(tensor.shape)}, the checkpoint has {spec.shape}")
    if dtypes is None and tensor.dtype != spec.dtype:
        raise RefitError(f"{name}: dtype {tensor.dtype}, the checkpoint has {spec.dtype}")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise RefitError(f"{name}: dtype {tensor.dtype}; fp8_align takes {', '.join(str(d) for d in dtypes)}")


def vllm_target(name: str, packed: Mapping[str, list[str]]) -> tuple[str, str, int]:
    """(vLLM module name, parameter, shard index) of checkpoint tensor `name`, given the model's
    `packed_modules_mapping` (merged module -> its checkpoint modules, in shard order).

    model.layers.1.self_attn.k_proj.weight -> (model.layers.1.self_attn.qkv_proj, weight, 1).
    """
    module_name, _, param = name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    for merged, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{merged}" if parent else merged, param, parts.index(leaf)
    return module_name, param, 0


def modules_named(model: torch.nn.Module, names: Iterable[str]) -> list[torch.nn.Module]:
    """The vLLM modules of `model` that checkpoint tensors `names` load into (each once, in order
    of first mention; names whose module the model lacks are skipped)."""
    packed = dict(getattr(model, "packed_modules_mapping", {}))
    modules = dict(model.named_modules())
    return [modules[target] for target in dict.fromkeys(vllm_target(name, packed)[0] for name in names) if target in modules]


def original_load_weights(model: torch.nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]]], Any]:
    """The model class's own `load_weights`, bound to `model` (no validation, no CPU repacking)."""
    return type(model).load_weights.__get__(model)
