"""OpenRLHF's and verl's vLLM worker extensions, mixed into one vLLM worker class for the GPU
stack-sync tests (tests/test_gpu_stack_sync.py), so one engine start serves both stacks. Each
class's methods are theirs, unchanged: OpenRLHF 0.11.2 `WorkerWrap`
(openrlhf/trainer/ray/vllm_worker_wrap.py) and verl 0.9.1 `vLLMColocateWorkerExtension`
(verl/workers/rollout/vllm_rollout/utils.py); their method names do not overlap."""

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension


class OpenRLHFAndVerlWorkerExtension(WorkerWrap, vLLMColocateWorkerExtension):
    """vLLM `worker_extension_cls`: OpenRLHF's update_weight_cuda_ipc and verl's update_weights_from_ipc."""
