"""TRL's GRPOTrainer generating on an fp8_align engine: the one setting for its colocate mode.

TRL 1.16's colocate mode builds its `vllm.LLM` itself (`trl.generation.vllm_generation`,
`VLLMGeneration._init_vllm`) with `quantization=None` and no way to pass other engine arguments.
`patch_trl_engine(cfg)`, called before the trainer is built, makes that constructor an fp8_align
engine's: TRL's own arguments, then `engine_kwargs(cfg)` (quantization, the config, the KV-cache
dtype).

TRL's weight sync needs no change: it calls the engine model's `load_weights([(name, param)])`
one parameter at a time, which on an fp8_align engine checks each tensor and re-quantizes its FP8
layer in place (a q, k or v shard, or a gate or up shard, alone). With an FP8 KV cache
(`cfg.kv_cache_dtype == "fp8"`) new K/V scales follow every sync (wrapped around
`VLLMGeneration.sync_weights`), measured on `kv_calibration_prompts` by the trainer's forward
(`KVScaleCalibrator` on TRL's model: K, V and Q, as the recipe computes them) and pushed to the
engine, so each rollout runs with scales of the weights it samples with. TRL's sleep mode is refused
with an FP8 KV cache: its level 2 discards the scales with the weights, and its sync wakes the
weights alone. `on_policy="bitwise"` (colocate mode, BF16 KV cache) needs the trainer's side first:
the policy converted by `make_bitwise` and `patch_stack_logprobs("trl")` applied, which make TRL's
own log-prob code the engine's (checked on CPU against the engine's reference; the engine inside
TRL's loop is benchmarks/stack_bitwise.py's `--stack trl`, a GPU run). Server mode and an FP8 KV
cache are refused in that mode: neither has been compared.

Server mode (`trl vllm-serve`) takes engine arguments on its command line; `vllm_serve_args(cfg)`
gives them (docs/refit.md, "TRL").

The patch names what it replaces (`LLM` and `VLLMGeneration.sync_weights` in
`trl.generation.vllm_generation`) and the TRL release it was read from; another release is
refused. It applies only when asked, a second call with the same config changes nothing, and
`unpatch_trl_engine()` puts TRL's own back.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
from collections.abc import Sequence
from typing import Any

import torch

from fp8_align.config import FP8Config
from fp8_align.hf_training.stack_patches import is_patched
from fp8_align.megatron_ext.calibration import KVScaleCalibrator
from fp8_align.vllm_plugin import engine_kwargs
from fp8_align.vllm_plugin.kv.scales import push_kv_scales

#: TRL releases whose `trl.generation.vllm_generation` this patch was read from.
TRL_VERSIONS = ("1.16.0",)
TRL_MODULE = "trl.generation.vllm_generation"

_state: dict[str, Any] = {}


def patch_trl_engine(cfg: FP8Config, kv_calibration_prompts: Sequence[Sequence[int]] | None = None) -> None:
    """Make the engine TRL's colocate mode builds an fp8_align engine running `cfg` (module docstring).

    kv_calibration_prompts: token-id prompts the K/V scales are measured on after every weight sync;
    required when `cfg.kv_cache_dtype == "fp8"`, refused otherwise. Raises ValueError for another
    installed TRL release, `on_policy="bitwise"` before `patch_stack_logprobs("trl")` or with an FP8
    KV cache, a missing or needless calibration set, or a second call with another config (unpatch
    first).
    """
    version = importlib.metadata.version("trl")
    if version not in TRL_VERSIONS:
        raise ValueError(f"trl {version}: patch_trl_engine is read from trl {', '.join(TRL_VERSIONS)} only")
    _check_bitwise(cfg)
    fp8_kv = cfg.kv_cache_dtype == "fp8"
    if fp8_kv and not kv_calibration_prompts:
        raise ValueError("an FP8 KV cache needs kv_calibration_prompts: the engine recalibrates its K/V scales on them after every TRL weight sync")
    if not fp8_kv and kv_calibration_prompts:
        raise ValueError("kv_calibration_prompts calibrate an FP8 KV cache; this config's kv_cache_dtype is 'auto'")
    prompts = [list(map(int, prompt)) for prompt in kv_calibration_prompts or ()]
    if _state:
        if _state["cfg"] != cfg or _state["prompts"] != prompts:
            raise ValueError("patch_trl_engine already applied with another config or calibration set; call unpatch_trl_engine() first")
        return
    module = importlib.import_module(TRL_MODULE)
    original_llm, original_sync = module.LLM, module.VLLMGeneration.sync_weights

    def fp8_align_llm(**kwargs: Any) -> Any:
        """TRL's `LLM(**kwargs)` as an fp8_align engine of the patched config."""
        if kwargs.pop("quantization", None) is not None:
            raise ValueError("TRL asked vLLM for bitsandbytes quantization (a 4-bit model); fp8_align's engine quantizes the BF16 weights itself")
        if fp8_kv and kwargs.get("enable_sleep_mode"):
            raise ValueError(
                "vllm_enable_sleep_mode with an FP8 KV cache: TRL's sleep level 2 discards the K/V scales with the weights and its "
                "sync wakes the weights alone, so no scale could be measured before the rollout; unset vllm_enable_sleep_mode"
            )
        return original_llm(**engine_kwargs(cfg, **kwargs))

    def sync_weights_and_kv_scales(self: Any) -> None:
        """TRL's `sync_weights`, then (colocate, FP8 KV cache) the K/V scales of the new weights."""
        original_sync(self)
        if self.mode == "colocate":
            push_kv_scales(self.llm, trainer_kv_scales(self.accelerator.unwrap_model(self.model), prompts))

    module.LLM = fp8_align_llm
    if fp8_kv:
        module.VLLMGeneration.sync_weights = sync_weights_and_kv_scales
    _state.update(cfg=cfg, prompts=prompts, module=module, originals=(original_llm, original_sync))


def trainer_kv_scales(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> dict[int, dict[str, float]]:
    """{layer: {"k_scale", "v_scale", "q_scale"}} (amax / 448 of post-RoPE K, V, Q) that the HF
    `model`'s forward over each token-id prompt observes, without gradients."""
    device = next(model.parameters()).device
    with KVScaleCalibrator(model) as calibrator, torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([list(prompt)], device=device))
    return calibrator.scales()


def unpatch_trl_engine() -> None:
    """Put TRL's own engine constructor and weight sync back; nothing happens when not patched."""
    if not _state:
        return
    module, (original_llm, original_sync) = _state["module"], _state["originals"]
    module.LLM, module.VLLMGeneration.sync_weights = original_llm, original_sync
    _state.clear()


def vllm_serve_args(cfg: FP8Config) -> list[str]:
    """`trl vllm-serve` command-line arguments that make its server an fp8_align engine running `cfg`
    (TRL passes arguments it does not know to `vllm serve`; the last `--kv-cache-dtype` given wins
    over TRL's own). Raises ValueError for `on_policy="bitwise"`: server mode's bitwise engine has not
    been compared with TRL's trainer."""
    if cfg.on_policy == "bitwise":
        raise ValueError("on_policy='bitwise' in TRL's server mode: not compared with TRL's trainer; use colocate mode (patch_trl_engine)")
    args = []
    for key, value in engine_kwargs(cfg).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return args


def _check_bitwise(cfg: FP8Config) -> None:
    if cfg.on_policy != "bitwise":
        return
    if not is_patched("trl"):
        raise ValueError(
            "on_policy='bitwise' with TRL: first convert the policy with make_bitwise(model, cfg) and call "
            "patch_stack_logprobs('trl'), so that TRL's own log-prob code is the engine's; then build the trainer around that model"
        )
    if cfg.kv_cache_dtype == "fp8":
        raise ValueError("on_policy='bitwise' with an FP8 KV cache in TRL: not compared yet (the trainer would need the engine's K/V scales "
                         "after every sync); use kv_cache_dtype='auto'")
