"""NeMo RL's own colocated refit, CUDA IPC over ZMQ, into an fp8_align engine on a GPU.

NeMo RL commit 7ea279a (vendored unmodified: tests/third_party/nemo_rl; it pins vLLM 0.25.1). One
in-process `vllm.LLM` from the random Qwen3-shaped checkpoint W1 (tests/gpu_models.py, layer 0
BF16) with NeMo RL's worker extension (tests/nemo_rl_worker.py `WorkerExtension`: its class, less
the attributes the installed vLLM's worker defines itself). The trainer side is this process, as
in NeMo RL's colocated job: a REQ socket at NeMo RL's address for the GPU
(`ipc:///tmp/<NVML UUID>.sock`, its `get_zmq_address`) and its `stream_weights_via_ipc_zmq_impl`
sending CUDA buffers by IPC handle; the worker runs its `update_weights_via_ipc_zmq`, nothing
stood in for. After the refit to W2 every FP8 layer's codes and scales equal the reference
quantization of W2 in the same storage, and the engine generates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engines import FIRST_LAYER_BF16, generate_greedy
from tests.gpu_models import (
    IN_PROCESS_LLM_KWARGS, NEW_TOKENS, SMALL, assert_codes_equal, assert_same_storage, cuda_weights, fp8_state,
    refit_checkpoints, refit_prompts,
)  # fmt: skip

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

#: NeMo RL sizes this from free memory (NRL_REFIT_BUFFER_MEMORY_RATIO); 256 MiB gives a few groups here.
BUFFER_BYTES = 256 * 2**20


def test_nemo_rl_cuda_ipc_refit_requantizes_in_place(tmp_path_factory: pytest.TempPathFactory, vllm_runner: Any) -> None:
    try:  # its third-party imports (ray, accelerate, pynvml), and its fp8 module, which the refit imports per batch
        from tests.nemo_rl_worker import ENGINE_ENV, GPU_WORKER, refit_stream, start_ipc_sender, state_dict_info
        from nemo_rl.models.generation.vllm.quantization import fp8  # noqa: F401
        from nemo_rl.utils.nvml import get_device_uuid
    except ImportError as error:
        pytest.skip(f"NeMo RL 7ea279a (pins vLLM 0.25.1) does not import here: {error}")

    checkpoints: dict[str, Path] = refit_checkpoints(tmp_path_factory)
    prompts = refit_prompts()
    with vllm_runner(checkpoints["w1"], FIRST_LAYER_BF16, env=ENGINE_ENV, worker_extension_cls=GPU_WORKER,
                     **IN_PROCESS_LLM_KWARGS) as runner:  # fmt: skip
        llm = runner.llm
        before = llm.apply_model(fp8_state)[0]
        w1_outputs = generate_greedy(llm, prompts, NEW_TOKENS)
        stream = list(refit_stream(cuda_weights(checkpoints["w2"]).items(), None, SMALL["num_hidden_layers"], device="cuda"))
        llm.collective_rpc("prepare_refit_info", args=(state_dict_info(stream),))
        thread, errors = start_ipc_sender(f"ipc:///tmp/{get_device_uuid(0)}.sock", stream, BUFFER_BYTES)
        [updated] = llm.collective_rpc("update_weights_via_ipc_zmq")
        thread.join(timeout=120)
        assert not thread.is_alive() and not errors, errors
        assert updated is True
        after = llm.apply_model(fp8_state)[0]
        assert_codes_equal(after, checkpoints["w2"])
        assert_same_storage(before, after)
        outputs = generate_greedy(llm, prompts, NEW_TOKENS)
        assert all(len(out["token_ids"]) == NEW_TOKENS for out in outputs)
        assert outputs != w1_outputs, "generation after NeMo RL's refit is the same as with W1"
