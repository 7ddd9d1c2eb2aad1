"""Engine-side FP8 KV-cache scale calibration: the running engine measures its own K, V and Q.

`calibrate_kv_scales(llm, prompts)` runs `prompts` (token ids) through the engine as prefill-only
requests (`max_tokens=1`, prefix cache not read, so every prompt token is computed) while every
attention layer of every worker is probed (`kv.probe.probe_attention`):

- K and V: max |x| over the rows the backend writes into the KV cache, i.e. the `key`/`value`
  rows of `do_kv_cache_update` whose slot is >= 0: post-RoPE keys and values of the real tokens,
  in the activation dtype, before any FP8 rounding; CUDA-graph padding rows are excluded.
- Q: max |x| over the `attn_metadata.num_actual_tokens` query rows attention receives (post-RoPE).

Every layer must have seen every prompt token, or `KVCalibrationError` is raised and nothing is
pushed. Scales are `fp8_align.quant.scale_from_amax(amax, pow2=False)`, i.e. FP32 `amax / 448`
(1.0 for an amax of 0), the rule of the trainer-side `KVScaleCalibrator`, so both options give
the same numbers for the same activations. With several workers (tensor parallel) each layer
takes the max over workers. The scales are pushed with `kv.scales.push_kv_scales`.

With an FP8 KV cache the batch runs on the engine's current scales, so what layer l measures
depends on the scales of layers < l (through their attention outputs). Calling again converges:
after as many calls as there are decoder layers the scales are a fixed point (docs/refit.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch

from fp8_align.quant.scales import scale_from_amax
from fp8_align.vllm_plugin.kv.probe import attention_probe, probe_attention, unprobe_attention
from fp8_align.vllm_plugin.kv.scales import KVScales, attention_layers, push_kv_scales
from fp8_align.vllm_plugin.worker_calls import call_workers

#: Per-layer amaxes: {layer: {"k_amax", "v_amax"[, "q_amax"]}}, in the activations' units.
KVAmaxes = dict[int, dict[str, float]]


class KVCalibrationError(RuntimeError):
    """The calibration was refused or did not observe every layer; no scales were pushed."""


@dataclass(frozen=True)
class KVCalibration:
    """What one `calibrate_kv_scales` call measured and pushed."""

    scales: KVScales  # pushed: {layer: {"k_scale", "v_scale"[, "q_scale"]}}, FP32 amax / 448
    amaxes: KVAmaxes  # max over workers
    worker_amaxes: list[KVAmaxes]  # one per worker, as observed there
    tokens: int  # prompt tokens every layer of every worker observed (sum of prompt lengths)
    seconds: float  # wall time of the whole call: probe, calibration batch, readback, push


def calibrate_kv_scales(llm: Any, prompts: Sequence[Sequence[int]], *, include_q: bool = True) -> KVCalibration:
    """Measure K/V (and Q) amax per decoder layer on `prompts` inside `llm` and push the scales.

    llm: an in-process `vllm.LLM` (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1).
    prompts: token-id lists, each non-empty; a small batch (a few thousand tokens at most).
    include_q: also calibrate q_scale. Engines that quantize the query to FP8 before attention
        (vLLM GPU backends with an FP8 KV cache, `Attention.query_quant`) never expose the
        unquantized query; there this raises, and `include_q=False` calibrates K/V only and
        leaves each layer's q_scale as it is.
    Raises KVCalibrationError for bad prompts (empty, not integers, outside the vocabulary, not
    shorter than the engine's max_model_len), or
    when some layer did not observe every prompt token (e.g. tokens that ran inside a full CUDA
    graph); the engine keeps its scales then. Clears the prefix cache (through `push_kv_scales`).
    """
    start = time.perf_counter()
    batch = _validate_prompts(prompts)
    model_config = llm.llm_engine.model_config
    _check_vocabulary(batch, model_config.get_vocab_size())
    _check_lengths(batch, model_config.max_model_len)
    tokens = sum(len(prompt) for prompt in batch)
    try:
        call_workers(llm, _start_in_worker, (include_q,))
        _run_batch(llm, batch)
    finally:
        observed = call_workers(llm, _stop_in_worker)
    worker_amaxes = [_check_observation(rank, observation, tokens, include_q) for rank, observation in enumerate(observed)]
    amaxes = _max_over_workers(worker_amaxes)
    scales = _scales(amaxes)
    push_kv_scales(llm, scales)
    return KVCalibration(scales, amaxes, worker_amaxes, tokens, time.perf_counter() - start)


def _validate_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise KVCalibrationError("prompts: expected a non-empty list of token-id lists")
    batch = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not prompt:
            raise KVCalibrationError(f"prompt {index}: expected a non-empty list of token ids, got {prompt!r:.80}")
        if any(isinstance(token, bool) or not isinstance(token, Integral) or token < 0 for token in prompt):
            raise KVCalibrationError(f"prompt {index}: token ids must be non-negative integers, got {list(prompt)!r:.80}")
        batch.append([int(token) for token in prompt])
    return batch


def _check_vocabulary(batch: list[list[int]], vocab_size: int) -> None:
    """vLLM does not check the ids of token prompts when it has no tokenizer, and an id past the
    embedding table takes the worker down; refuse those here."""
    for index, prompt in enumerate(batch):
        if max(prompt) >= vocab_size:
            raise KVCalibrationError(f"prompt {index}: token id {max(prompt)} is outside the model's vocabulary (size {vocab_size})")


def _check_lengths(batch: list[list[int]], max_model_len: int) -> None:
    """The calibration pass generates one token after each prompt, so a prompt may hold at most
    `max_model_len - 1` tokens; vLLM would refuse a longer one mid-batch."""
    for index, prompt in enumerate(batch):
        if len(prompt) >= max_model_len:
            raise KVCalibrationError(
                f"prompt {index}: {len(prompt)} tokens; the engine's max_model_len is {max_model_len} and the calibration "
                f"pass generates one token, so a prompt may hold at most {max_model_len - 1}"
            )


def _run_batch(llm: Any, batch: list[list[int]]) -> None:
    """Prefill every prompt once: one sampled token, no prefix-cache reads (all tokens computed)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, skip_reading_prefix_cache=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in batch], params, use_tqdm=False)


def _check_observation(rank: int, observation: dict[int, dict[str, Any]], tokens: int, include_q: bool) -> KVAmaxes:
    """One worker's {layer: amaxes}, after checking that every layer saw all `tokens`, finite."""
    kinds = ("k", "v", "q") if include_q else ("k", "v")
    problems = [problem for layer, seen in sorted(observation.items()) for problem in _layer_problems(layer, seen, tokens, kinds)]
    if problems:
        raise KVCalibrationError(
            f"worker {rank} did not observe the calibration batch exactly: {'; '.join(problems)}. Tokens are missed "
            "when a step runs inside a full CUDA graph (e.g. every scheduled request had 1 token: use prompts of >= 2 "
            "tokens) or in a fused RoPE/KV-cache kernel; no scales were pushed"
        )
    return {layer: {f"{kind}_amax": seen[kind] for kind in kinds} for layer, seen in sorted(observation.items())}


def _layer_problems(layer: int, seen: dict[str, Any], tokens: int, kinds: tuple[str, ...]) -> list[str]:
    counts = {"k/v": seen["kv_tokens"], "q": seen["q_tokens"]} if "q" in kinds else {"k/v": seen["kv_tokens"]}
    problems = [f"layer {layer}: {kind} saw {count} of {tokens} prompt tokens" for kind, count in counts.items() if count != tokens]
    problems += [f"layer {layer}: {message}" for message in seen["problems"]]
    problems += [f"layer {layer}: {kind} amax {seen[kind]}" for kind in kinds if kind in seen and not math.isfinite(seen[kind])]
    return problems


def _max_over_workers(worker_amaxes: list[KVAmaxes]) -> KVAmaxes:
    layers = set(worker_amaxes[0])
    if any(set(amaxes) != layers for amaxes in worker_amaxes):
        raise KVCalibrationError(
            f"workers hold different attention layers {[sorted(a) for a in worker_amaxes]}; "
            "calibration needs every worker to hold every layer (pipeline parallel size 1)"
        )
    return {
        layer: {key: max(amaxes[layer][key] for amaxes in worker_amaxes) for key in worker_amaxes[0][layer]}
        for layer in sorted(layers)
    }


def _scales(amaxes: KVAmaxes) -> KVScales:
    """FP32 amax / 448 per entry (scale_from_amax: a correctly rounded division on CPU)."""
    scales: KVScales = {}
    for layer, values in amaxes.items():
        table = scale_from_amax(torch.tensor(list(values.values()), dtype=torch.float32), pow2=False).tolist()
        scales[layer] = {key.replace("_amax", "_scale"): scale for key, scale in zip(values, table)}
    return scales


class _LayerObserver:
    """Worker side, one attention layer: running max |K|, |V|, |Q| (FP32 0-dim tensors on the
    activations' device, updated without host syncs) and how many token rows fed them."""

    def __init__(self, include_q: bool) -> None:
        self.include_q = include_q
        self.amax: dict[str, torch.Tensor] = {}
        self.kv_tokens: torch.Tensor | int = 0
        self.q_tokens = 0
        self.problems: list[str] = []

    def on_kv_write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        try:  # runs inside the engine's forward pass: report, never raise
            rows = slot_mapping.shape[0]
            written = slot_mapping >= 0
            self._update("k", key[:rows], written)
            self._update("v", value[:rows], written)
            self.kv_tokens = self.kv_tokens + written.sum()
        except Exception as error:  # noqa: BLE001 (any failure is reported by the driver instead)
            self._problem(f"observing K/V failed: {error!r}")

    def on_attention(self, query: torch.Tensor, attn_metadata: Any) -> None:
        if not self.include_q or attn_metadata is None:
            return
        try:
            rows = attn_metadata.num_actual_tokens
            self._update("q", query[:rows], None)
            self.q_tokens += rows
        except Exception as error:  # noqa: BLE001 (any failure is reported by the driver instead)
            self._problem(f"observing Q failed: {error!r}")

    def result(self) -> dict[str, Any]:
        """Plain floats and ints for the driver: "k"/"v"/"q" amax (absent if never seen), token counts, problems."""
        return {
            **{kind: float(amax) for kind, amax in self.amax.items()},
            "kv_tokens": int(self.kv_tokens),
            "q_tokens": self.q_tokens,
            "problems": self.problems,
        }

    def _update(self, kind: str, rows: torch.Tensor, keep: torch.Tensor | None) -> None:
        if rows.element_size() == 1:  # an FP8 tensor: already rounded, its range is not observable
            self._problem(f"{kind} reached the backend as {rows.dtype}")
            return
        if rows.numel() == 0:
            return
        magnitude = rows.abs()
        if keep is not None:
            magnitude = torch.where(keep.view(-1, *([1] * (magnitude.dim() - 1))), magnitude, 0)
        amax = magnitude.amax().float()
        self.amax[kind] = torch.maximum(self.amax[kind], amax) if kind in self.amax else amax

    def _problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)


def _start_in_worker(worker: Any, include_q: bool) -> None:
    """Probe every attention layer of this worker with a fresh `_LayerObserver`."""
    layers = attention_layers(worker.get_model())
    if not layers:
        raise KVCalibrationError("the model has no vLLM Attention layers (MLA and other attention types are not supported)")
    quantized = sorted(index for index, attn in layers.items() if getattr(attn, "query_quant", None) is not None)
    if include_q and quantized:
        raise KVCalibrationError(
            f"layers {quantized} quantize the query to FP8 before attention (Attention.query_quant, "
            "set by GPU backends with an FP8 KV cache), so the engine never sees the unquantized query; "
            "call calibrate_kv_scales(..., include_q=False) to calibrate K/V only (q_scale is left as it is)"
        )
    for attn in layers.values():
        probe_attention(attn.impl, _LayerObserver(include_q))


def _stop_in_worker(worker: Any) -> dict[int, dict[str, Any]]:
    """Unprobe every attention layer; {layer: `_LayerObserver.result()`}, zero counts for a layer
    that was not probed (its start failed, or its probe was removed meanwhile)."""
    observation = {}
    for index, attn in attention_layers(worker.get_model()).items():
        probe = attention_probe(attn.impl)
        unprobe_attention(attn.impl)
        if isinstance(probe, _LayerObserver):
            observation[index] = probe.result()
        else:
            observation[index] = {"kv_tokens": 0, "q_tokens": 0, "problems": ["was not probed"]}
    return observation
