"""Run one vLLM engine in a fresh process and save what it generated.

`run_generation(spec, out_path)` starts `python -m fp8_align.error_bench.generate SPEC OUT` so each
engine gets a clean process (vLLM spawns its workers from there); `start_generation` does the
same without waiting, so several engines can run side by side. Each engine process leads its
own process group, so `GenerationJob.kill()` also stops the workers it spawned.
`generations_as_completed(specs, plan, ...)` runs many specs, `plan_engines` deciding how many
at once and on which CPU cores. The spec is a JSON-able dict:

    model: str                      path of an HF checkpoint (BF16)
    fp8_config: dict | None         FP8Config fields; None runs stock BF16 vLLM
    prompts: list[list[int]]        prompt token ids
    max_tokens: int, logprobs: int (default 0: sampled token only), ignore_eos: bool (default True)
    stop_token_ids: list[int]       extra tokens that end a completion (default none)
    temperature: float, seed: int   the sampling setting when `sampling` is absent
    sampling: list[dict]            several settings in one engine run, each
                                    {"name": str, "temperature": float, "seed": int}; every
                                    prompt is generated once per setting, all in one batch
    inspect: bool                   also return each linear and routed-experts layer's state and the load's BF16 peak from the worker
    report_kernels: bool            also return each linear layer's method and kernel (no tensors)
    llm_kwargs: dict                extra `vllm.LLM` keyword arguments
    kv_scales: dict                 {layer: {"k_scale", "v_scale"[, "q_scale"]}} pushed with
                                    `push_kv_scales` before generating (FP8 KV cache engines)
    env: dict[str, str]             extra environment for the engine process

The output (torch.save) holds `outputs_by_sampling` ({setting name: per prompt `prompt_ids`,
`token_ids`, `logprobs` of the sampled tokens}), `outputs` (the outputs of the top-level
setting, present when `sampling` is absent), `layers` (when inspect), `linear_kernels` (when
report_kernels), `layers_by_worker` (when inspect: one `layers` per worker, in rank order),
`experts` (when inspect: `read_expert_layers` of the first worker), `load_memory_by_worker` (when
inspect: `load_memory.load_memory_state` per worker), `logprobs_mode`, `vllm_version`,
`engine_start_s`, `generate_s`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ContextManager

import torch

from fp8_align.config import FP8Config
from fp8_align.vllm_plugin import engine_kwargs
from fp8_align.vllm_plugin.kv.scales import push_kv_scales
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer
from fp8_align.vllm_plugin.load_memory import load_memory_state

DEFAULT_LLM_KWARGS = {"gpu_memory_utilization": 0.1, "dtype": "bfloat16", "seed": 0}
#: KV cache per CPU engine in GiB (VLLM_CPU_KVCACHE_SPACE) when engines share a machine.
CPU_KV_CACHE_GIB = 2
#: `gpu_memory_utilization` of scheduled engines; on CPU a share of one NUMA node's memory (<= 0.3).
SCHEDULED_GPU_MEMORY_UTILIZATION = 0.3
#: Name of the single sampling setting built from the top-level `temperature` and `seed`.
DEFAULT_SAMPLING_NAME = "default"


class GenerationError(RuntimeError):
    """The engine process failed; the message carries the tail of its log."""


@dataclass
class GenerationJob:
    """An engine process started by `start_generation`; `wait()` returns its output dict.

    The output file is complete as soon as it exists (the engine process writes a temporary file
    and renames it), so `wait()` returns then and stops the process group instead of waiting for
    vLLM's own shutdown (~5 s on CPU).
    """

    process: subprocess.Popen[bytes]
    out_path: Path
    log_path: Path
    log_file: IO[str]
    deadline: float  # time.monotonic() after which the engine is killed

    def done(self) -> bool:
        """True once the output file exists or the engine process has exited."""
        return self.out_path.exists() or self.process.poll() is not None

    def wait(self) -> dict[str, Any]:
        """Block until the output exists or the process exits; raise GenerationError on failure."""
        while not self.done():
            if time.monotonic() > self.deadline:
                self.kill()
                raise GenerationError(f"vLLM engine process ran past its time limit; log {self.log_path}")
            time.sleep(0.2)
        if self.out_path.exists():
            output = torch.load(self.out_path, weights_only=False)
            self.kill()
            return output
        self.log_file.close()
        tail = "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise GenerationError(f"vLLM engine process exited with {self.process.returncode}; log {self.log_path}:\n{tail}")

    def kill(self, grace_s: float = 10.0) -> None:
        """Stop the engine process and the workers it spawned (its whole process group)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log_file.close()


def start_generation(spec: dict[str, Any], out_path: str | os.PathLike[str], timeout_s: float = 900) -> GenerationJob:
    """Start `spec` in a new process (log next to `out_path`, suffix .log) and return at once."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.unlink(missing_ok=True)
    spec_path = out_path.with_suffix(".spec.json")
    log_path = out_path.with_suffix(".log")
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **spec.get("env", {})}
    log_file = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "fp8_align.error_bench.generate", str(spec_path), str(out_path)],
        stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    return GenerationJob(process, out_path, log_path, log_file, time.monotonic() + timeout_s)


def run_generation(spec: dict[str, Any], out_path: str | os.PathLike[str], timeout_s: float = 900) -> dict[str, Any]:
    """Run `spec` in a new process and return the loaded output dict (see module docstring)."""
    return start_generation(spec, out_path, timeout_s).wait()


@dataclass(frozen=True)
class EnginePlan:
    """How engines run: how many at once, their CPU cores, and the vLLM keyword arguments they share."""

    core_groups: tuple[tuple[int, ...], ...]  # one group per concurrent engine; empty on CUDA
    llm_kwargs: dict[str, Any]

    @property
    def slots(self) -> int:
        return max(1, len(self.core_groups))


def plan_engines(device: str, num_engines: int, compile_mode: str, max_model_len: int, seed: int) -> EnginePlan:
    """CPU: up to two engines at once, each bound to its share of the cores; CUDA: one at a time.

    Without compilation vLLM runs the model eagerly (`compilation_config.mode = 0`): on CPU this
    starts an engine in ~30 s instead of 80 s or more.
    """
    llm_kwargs: dict[str, Any] = {
        "gpu_memory_utilization": SCHEDULED_GPU_MEMORY_UTILIZATION,
        "max_model_len": max_model_len,
        "seed": seed,
    }
    use_compile = compile_mode == "on" or (compile_mode == "auto" and device == "cuda")
    if not use_compile:
        llm_kwargs["compilation_config"] = {"mode": 0}
    if device == "cuda":
        return EnginePlan((), llm_kwargs)
    cores = sorted(os.sched_getaffinity(0))
    slots = max(1, min(2, len(cores), num_engines))
    groups = tuple(tuple(cores[k * len(cores) // slots : (k + 1) * len(cores) // slots]) for k in range(slots))
    return EnginePlan(groups, llm_kwargs)


def _engine_env(cores: tuple[int, ...]) -> dict[str, str]:
    if not cores:
        return {}
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(CPU_KV_CACHE_GIB),
    }


def generations_as_completed(
    specs: dict[str, dict[str, Any]],
    plan: EnginePlan,
    work_dir: Path,
    say: Callable[[str], None],
    status: Callable[[str], ContextManager[Any]],
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Run one engine per named spec, `plan.slots` at a time; yield (name, output) as each finishes.

    Outputs are `run_generation`'s plus `wall_s` (seconds from process start to exit); files go to
    `work_dir/NAME.pt|.log|.spec.json`. `say(text)` prints a line, `status(text)` is a live message
    (a context manager with `.update(text)`). The next engine starts before a finished one is
    yielded, so the caller's work overlaps the engines still running. Engines still running are
    killed when the generator is closed (or the caller raises).
    """
    pending = list(specs)
    free_groups = list(plan.core_groups) or [()]
    running: dict[str, tuple[GenerationJob, tuple[int, ...], float]] = {}

    def launch() -> None:
        while pending and free_groups:
            name, cores = pending.pop(0), free_groups.pop(0)
            spec = {**specs[name], "env": _engine_env(cores)}
            where = f" on CPU core(s) {','.join(map(str, cores))}" if cores else ""
            say(f"starting vLLM engine '{name}'{where}")
            running[name] = (start_generation(spec, work_dir / f"{name}.pt"), cores, time.perf_counter())

    try:
        launch()
        while running:
            with status(_waiting_text(running)) as spinner:
                while not any(job.done() for job, _, _ in running.values()):
                    time.sleep(0.5)
                    spinner.update(_waiting_text(running))
            name = next(n for n, (job, _, _) in running.items() if job.done())
            job, cores, started = running.pop(name)
            output = job.wait()
            output["wall_s"] = time.perf_counter() - started
            tokens = sum(len(o["token_ids"]) for rows in output["outputs_by_sampling"].values() for o in rows)
            say(
                f"engine '{name}' done: start {output['engine_start_s']:.0f} s, generate "
                f"{output['generate_s']:.0f} s, {tokens} tokens"
            )
            free_groups.append(cores)
            launch()
            yield name, output
    finally:
        for job, _, _ in running.values():
            job.kill()


def _waiting_text(running: dict[str, tuple[GenerationJob, tuple[int, ...], float]]) -> str:
    now = time.perf_counter()
    return "vLLM generating: " + ", ".join(f"{n} ({now - t:.0f} s)" for n, (_, _, t) in running.items())


def linear_kernels(model: torch.nn.Module) -> dict[str, dict[str, str]]:
    """Per linear module name: its quant method class and, for fp8_align layers, the GEMM kernel.

    Runs inside the vLLM worker (passed to `LLM.apply_model`); returns names only, no tensors.
    """
    kernels: dict[str, dict[str, str]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "input_size"):
            continue
        kernel = module.fp8_align.kernel.name if is_fp8_align_layer(module, "linear") else "bf16"
        kernels[name] = {"method": type(method).__name__, "kernel": kernel}
    return kernels


def _sampling_settings(spec: dict[str, Any]) -> list[dict[str, Any]]:
    if "sampling" in spec:
        names = [s["name"] for s in spec["sampling"]]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"spec['sampling'] needs at least one setting and unique names, got {names}")
        return list(spec["sampling"])
    return [{"name": DEFAULT_SAMPLING_NAME, "temperature": spec.get("temperature", 0.0), "seed": spec.get("seed", 0)}]


def _generate(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # imports vLLM (through vllm_plugin.compat): only in this engine process, never in the parent
    from fp8_align.vllm_plugin.inspection import read_expert_layers, read_linear_layers

    kwargs: dict[str, Any] = {**DEFAULT_LLM_KWARGS, "skip_tokenizer_init": True, **spec.get("llm_kwargs", {})}
    if spec.get("fp8_config") is not None:
        kwargs.update(engine_kwargs(FP8Config.from_kwargs(**spec["fp8_config"])))
    start = time.perf_counter()
    llm = LLM(model=spec["model"], **kwargs)
    engine_start_s = time.perf_counter() - start
    if spec.get("kv_scales"):
        push_kv_scales(llm, {int(layer): scales for layer, scales in spec["kv_scales"].items()})
    settings = _sampling_settings(spec)
    prompts, params = [], []
    for setting in settings:
        sampling_params = SamplingParams(
            max_tokens=int(spec.get("max_tokens", 16)),
            temperature=float(setting["temperature"]),
            seed=int(setting["seed"]),
            logprobs=int(spec.get("logprobs", 0)),
            ignore_eos=bool(spec.get("ignore_eos", True)),
            stop_token_ids=[int(t) for t in spec.get("stop_token_ids", [])],
        )
        prompts += [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
        params += [sampling_params] * len(spec["prompts"])
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    outputs_by_sampling: dict[str, list[dict[str, Any]]] = {s["name"]: [] for s in settings}
    for index, result in enumerate(results):
        completion = result.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(token_ids, completion.logprobs)]
        setting_index, prompt_index = divmod(index, len(spec["prompts"]))
        outputs_by_sampling[settings[setting_index]["name"]].append(
            {"prompt_ids": list(spec["prompts"][prompt_index]), "token_ids": token_ids, "logprobs": logprobs}
        )
    out: dict[str, Any] = {
        "outputs_by_sampling": outputs_by_sampling,
        "logprobs_mode": str(llm.model_config.logprobs_mode),
        "vllm_version": vllm.__version__,
        "engine_start_s": engine_start_s,
        "generate_s": generate_s,
    }
    if "sampling" not in spec:
        out["outputs"] = outputs_by_sampling[DEFAULT_SAMPLING_NAME]
    if spec.get("inspect"):
        out["layers_by_worker"] = read_linear_layers(llm)
        out["layers"] = out["layers_by_worker"][0]
        out["experts"] = read_expert_layers(llm)[0]
        out["load_memory_by_worker"] = llm.apply_model(load_memory_state)
    if spec.get("report_kernels"):
        # This file runs as __main__; vLLM pickles functions by module name, so pass the copy
        # importable as fp8_align.error_bench.generate.
        from fp8_align.error_bench.generate import linear_kernels as importable_linear_kernels

        out["linear_kernels"] = llm.apply_model(importable_linear_kernels)[0]
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m fp8_align.error_bench.generate SPEC.json OUT.pt`."""
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    result = _generate(json.loads(Path(spec_path).read_text()))
    partial = Path(out_path).with_suffix(".partial")
    torch.save(result, partial)
    os.replace(partial, out_path)  # the parent treats an existing output file as complete
    return 0


if __name__ == "__main__":
    sys.exit(main())
