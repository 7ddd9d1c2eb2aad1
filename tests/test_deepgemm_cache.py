"""`fp8-align prepare-deepgemm`: the shapes it compiles for and how it splits the work, and the
engine warm-up's check of the cache (CPU, DeepGEMM stood in for).

The compile itself needs an SM90 GPU and DeepGEMM: tests/test_gpu_deepgemm_cache.py runs it on the box.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from fp8_align.cli import main
from fp8_align.vllm_plugin.kernels.deepgemm.cache import split_work
from fp8_align.vllm_plugin.kernels.deepgemm.inventory import LinearShape, decoder_linear_shapes, parse_shapes, trainer_linear_shapes

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip


def test_dense_shapes_match_vllm_merged_layers() -> None:
    """qkv/o/gate_up/down as vLLM stacks them, per tensor-parallel rank."""
    assert [(s.name, s.n, s.k, s.shards) for s in decoder_linear_shapes(QWEN3_8B)] == [
        ("qkv_proj", 6144, 4096, (4096, 1024, 1024)),
        ("o_proj", 4096, 4096, (4096,)),
        ("gate_up_proj", 24576, 4096, (12288, 12288)),
        ("down_proj", 4096, 12288, (4096,)),
    ]
    tp8 = {s.name: s for s in decoder_linear_shapes(QWEN3_8B, tensor_parallel_size=8)}
    assert tp8["qkv_proj"].shards == (512, 128, 128) and tp8["down_proj"].k == 1536
    # 16 ranks over 8 KV heads: each rank holds one (replicated) KV head.
    assert decoder_linear_shapes(QWEN3_8B, tensor_parallel_size=16)[0].shards == (256, 128, 128)


def test_trainer_shapes_are_the_hf_models_linears() -> None:
    """`trainer_linear_shapes` against the nn.Linear weights of a real transformers Qwen3 model of
    that config (one [N, K] each), and its refusal of an MoE config."""
    small = {**QWEN3_8B, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}
    config = Qwen3Config(**{k: v for k, v in small.items() if k != "model_type"}, num_hidden_layers=1, vocab_size=128)
    layer = Qwen3ForCausalLM(config).model.layers[0]
    held = {tuple(m.weight.shape) for m in layer.modules() if isinstance(m, torch.nn.Linear)}
    found = trainer_linear_shapes(small)
    assert {(s.n, s.k) for s in found} == held and len(found) == len(held)
    # Qwen3-8B: q_proj is o_proj's [N, K]; k/v and gate/up are the new ones
    assert [(s.name, s.n, s.k) for s in trainer_linear_shapes(QWEN3_8B)] == [
        ("q_proj", 4096, 4096), ("k_proj", 1024, 4096), ("gate_proj", 12288, 4096), ("down_proj", 4096, 12288)]  # fmt: skip
    with pytest.raises(ValueError, match="dense decoders only"):
        trainer_linear_shapes(QWEN3_30B_A3B)


def test_smollm2_shapes_that_deepgemm_cannot_take() -> None:
    """SmolLM2-135M: head dim 64 x 3 KV heads gives 192-row K/V shards, off DeepGEMM's 128 grid."""
    smol = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
    eligible = {s.name: s.runs_on_deepgemm for s in decoder_linear_shapes(smol)}
    assert eligible == {"qkv_proj": False, "o_proj": False, "gate_up_proj": False, "down_proj": False}
    assert LinearShape("x", 256, 128, (128, 128)).runs_on_deepgemm


#: Qwen3-30B-A3B's config.json fields the shapes depend on.
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip


def test_moe_shapes_are_the_attention_linears() -> None:
    """Qwen3-30B-A3B: every layer's MLP is routed experts (grouped GEMMs, not listed), so the
    linears are qkv_proj and o_proj: the 5120x2048 and 2048x4096 session 16 prepared by hand."""
    assert [(s.name, s.n, s.k, s.shards) for s in decoder_linear_shapes(QWEN3_30B_A3B)] == [
        ("qkv_proj", 5120, 2048, (4096, 512, 512)),
        ("o_proj", 2048, 4096, (2048,)),
    ]
    dense_layer = decoder_linear_shapes({**QWEN3_30B_A3B, "mlp_only_layers": [0]})
    assert [(s.name, s.n, s.k) for s in dense_layer[2:]] == [("gate_up_proj", 12288, 2048), ("down_proj", 2048, 6144)]


def test_mla_shapes_are_the_ones_vllm_built_for_moonlight() -> None:
    """Moonlight-16B-A3B's config: the [N, K] and shards of every fp8_align linear a vLLM 0.25.1
    engine of that shape logged on an H200 (session 17,
    benchmarks/logs/session17_h200_vllm025/fp8_align.log), and nothing else."""
    from benchmarks.rollout.checkpoints import MOONLIGHT_16B_A3B

    got = {(s.n, s.k, s.shards) for s in decoder_linear_shapes(MOONLIGHT_16B_A3B)}
    assert got == {
        (576, 2048, (576,)), (3072, 2048, (3072,)), (4096, 512, (4096,)), (2048, 2048, (2048,)),  # MLA
        (22528, 2048, (11264, 11264)), (2048, 11264, (2048,)),  # layer 0's dense MLP
        (5632, 2048, (2816, 2816)), (2048, 2816, (2048,)),  # the shared experts
    }  # fmt: skip
    runs = {s.name: s.runs_on_deepgemm for s in decoder_linear_shapes(MOONLIGHT_16B_A3B)}
    assert runs["kv_a_proj_with_mqa"] is False and sum(runs.values()) == 7


def test_expert_shapes_and_the_grouped_warm_up_of_vllm() -> None:
    """Qwen3-30B-A3B's experts: w13 [128, 1536, 2048] and w2 [128, 2048, 768], top-8; the M values
    of vLLM's grouped warm-up at 16,384 batched tokens are 2 x 1,151 = the 2,302 calls session 16
    counted in vLLM's log; Moonlight's 64 experts of 1408 (top-6); a dense model has none."""
    from benchmarks.rollout.checkpoints import MOONLIGHT_16B_A3B

    from fp8_align.vllm_plugin.kernels.deepgemm.inventory import expert_shapes, grouped_m_values

    w13, w2 = expert_shapes(QWEN3_30B_A3B)
    assert (w13.experts, w13.n, w13.k, w13.top_k, w2.n, w2.k) == (128, 1536, 2048, 8, 2048, 768)
    assert [len(grouped_m_values(e, 16384)) for e in (w13, w2)] == [1151, 1151]
    assert grouped_m_values(w13, 16384)[:2] == [128, 256] and grouped_m_values(w13, 16384)[-1] == 147328
    tp4 = expert_shapes(QWEN3_30B_A3B, tensor_parallel_size=4)
    assert [(e.n, e.k) for e in tp4] == [(384, 2048), (2048, 192)] and all(e.runs_on_deepgemm for e in tp4[:1])
    assert not tp4[1].runs_on_deepgemm  # K = 192 is off the 128 grid
    assert [(e.experts, e.n, e.k, e.top_k) for e in expert_shapes(MOONLIGHT_16B_A3B)] == [(64, 2816, 2048, 6), (64, 2048, 1408, 6)]
    assert expert_shapes(QWEN3_8B) == []


def test_split_grouped_work_gives_each_worker_one_contiguous_run() -> None:
    from fp8_align.vllm_plugin.kernels.deepgemm.cache import split_grouped_work

    values = list(range(128, 128 * 11, 128))  # 10 M values
    parts = split_grouped_work({"g8x256x512": values}, 4)
    assert [part["g8x256x512"] for part in parts] == [values[0:3], values[3:6], values[6:9], values[9:10]]
    assert split_grouped_work({"g8x256x512": values[:2]}, 4) == [{"g8x256x512": [128]}, {"g8x256x512": [256]}]


@pytest.mark.parametrize(
    "config, message",
    [({**QWEN3_8B, "q_lora_rank": 1536, "kv_lora_rank": 512}, "q_lora_rank"),
     ({**QWEN3_8B, "num_experts": 60, "shared_expert_intermediate_size": 5632}, "shared_expert_intermediate_size"),
     ({**QWEN3_8B, "model_type": "llama4_text", "num_local_experts": 16}, "llama4_text"),
     ({**QWEN3_8B, "model_type": "deepseek_v2", "kv_lora_rank": 512}, "deepseek_v2")],
)  # fmt: skip
def test_architectures_not_described_are_refused(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"{message}.*--shapes"):
        decoder_linear_shapes(config)


def test_tensor_parallel_that_does_not_split_is_refused() -> None:
    with pytest.raises(ValueError, match="does not split"):
        decoder_linear_shapes(QWEN3_8B, tensor_parallel_size=3)


def test_parse_shapes() -> None:
    assert [(s.n, s.k) for s in parse_shapes("6144x4096, 4096X12288")] == [(6144, 4096), (4096, 12288)]
    for bad in ("6144", "ax4096", ""):
        with pytest.raises(ValueError):
            parse_shapes(bad)


def test_split_work_deals_every_m_once() -> None:
    m_values = {(6144, 4096): list(range(1, 11)), (4096, 4096): [1, 2, 3]}
    parts = split_work(m_values, 4)
    assert len(parts) == 4
    dealt = sorted((shape, m) for part in parts for shape, values in part.items() for m in values)
    assert dealt == sorted([("6144x4096", m) for m in range(1, 11)] + [("4096x4096", m) for m in (1, 2, 3)])
    assert max(map(lambda p: sum(map(len, p.values())), parts)) - min(map(lambda p: sum(map(len, p.values())), parts)) <= 1
    assert len(split_work({(1, 1): [1]}, 8)) == 1  # no idle workers


def test_cli_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Errors before any GPU work: neither or both sources, a config it does not describe, a missing config."""
    assert main(["prepare-deepgemm"]) == 2
    assert "one of --model and --shapes" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_8B, "q_lora_rank": 1536, "kv_lora_rank": 512}))
    assert main(["prepare-deepgemm", "--model", str(tmp_path)]) == 2
    assert "--shapes" in capsys.readouterr().err
    assert main(["prepare-deepgemm", "--model", str(tmp_path / "missing")]) == 2
    assert main(["prepare-deepgemm", "--shapes", "12x"]) == 2
    capsys.readouterr()
    assert main(["prepare-deepgemm", "--shapes", "6144x4096", "--trainer"]) == 2
    assert "--trainer adds the shapes of --model's trainer" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_refuses_to_prepare_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """Valid shapes on a machine without CUDA: exit 2 and one line, before any compile process starts."""
    assert main(["prepare-deepgemm", "--shapes", "6144x4096"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


class Engine(SimpleNamespace):
    """An engine start for `DeepGemmBlockFp8Kernel.warm_up` with its config, DeepGEMM, the GPU and
    the fill command stood in for: `start(*shapes)` warms up one layer per [N, K] in a fresh
    process; `compiled`, `fills` (the commands run) and `logged` record what happened."""


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Engine:
    from fp8_align.vllm_plugin.kernels import gpu
    from fp8_align.vllm_plugin.kernels.deepgemm import inventory as deepgemm_inventory
    from fp8_align.vllm_plugin.kernels.deepgemm import warmup

    cache, checkpoint = (tmp_path / "dg").resolve(), tmp_path / "qwen3"
    checkpoint.mkdir()
    monkeypatch.setenv(deepgemm_inventory.JIT_CACHE_ENV_VAR, str(cache))
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(model=str(checkpoint), hf_text_config=SimpleNamespace(to_dict=lambda: QWEN3_8B)),
    )
    monkeypatch.setattr(warmup, "get_current_vllm_config_or_none", lambda: config)
    monkeypatch.setattr(warmup, "deepgemm_warmup_m_values", lambda n, max_tokens, device: [1, 2, 4, 8][: 3 + (n == 24576)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 << 30, 80 << 30))
    state = Engine(cache=cache, checkpoint=checkpoint, compiled=[], fills=[], fill_error=None, logged={"info": [], "warning": []})
    monkeypatch.setattr(gpu.DeepGemmBlockFp8Kernel, "run_for_m_values", lambda self, layer, m: state.compiled.append(tuple(layer.weight.shape)))
    for level in state.logged:
        monkeypatch.setattr(warmup.logger, level, lambda message, *args, _level=level: state.logged[_level].append(message % args))

    def run_fill(command: list[str]) -> str | None:
        """The command's effect when it succeeds: every shape it names marked prepared."""
        state.fills.append(command)
        if state.fill_error is None:
            args = dict(zip(command[4::2], command[5::2]))
            setup = warmup.deepgemm_cache_setup(torch.device("cuda", int(args["--device"])))
            for shape in parse_shapes(args["--shapes"]):
                deepgemm_inventory.mark_prepared(Path(args["--cache-dir"]), setup, shape.n, shape.k, int(args["--max-num-batched-tokens"]))
        return state.fill_error

    monkeypatch.setattr(warmup, "run_fill", run_fill)

    def start(*shapes: tuple[int, int]) -> None:
        monkeypatch.setattr(deepgemm_inventory, "_warmups", {})
        monkeypatch.setattr(warmup, "_COLD_CACHES_WARNED", set())
        monkeypatch.setattr(warmup, "_FILLS_FAILED", set())
        monkeypatch.setattr(warmup, "_FILLED_AT_START", set())
        for n, k in shapes:
            gpu.DeepGemmBlockFp8Kernel().warm_up(SimpleNamespace(weight=torch.empty(n, k, device="meta")))

    state.start = start
    return state


def test_a_cold_cache_is_filled_in_parallel_before_the_warm_up(engine: Engine) -> None:
    """The first warm-up on a cache without marks runs `fp8-align prepare-deepgemm` once for every
    cold shape of the model (one warning naming the command), then every warm-up loads (prepared);
    a later engine start with that cache fills nothing and warns not."""
    from fp8_align.vllm_plugin.kernels.deepgemm import inventory as deepgemm_inventory

    engine.start((6144, 4096), (6144, 4096), (4096, 4096))
    [command] = engine.fills
    assert command[3:] == ["prepare-deepgemm", "--shapes", "6144x4096,4096x4096,24576x4096,4096x12288", "--cache-dir",
                           str(engine.cache), "--max-num-batched-tokens", "256", "--jobs", command[11], "--device", "0"]  # fmt: skip
    [warning] = engine.logged["warning"]
    assert warning.startswith(f"fp8_align: DeepGEMM's JIT cache {engine.cache} is not marked prepared for this engine (N=6144 K=4096, ")
    assert f"compiling their 13 kernels in {command[11]} parallel processes before the engine serves (`fp8-align prepare-deepgemm --shapes" in warning
    assert engine.compiled == [(6144, 4096), (4096, 4096)]  # the warm-up still runs each shape once: it loads
    assert [(w.prepared, w.filled_at_start) for w in deepgemm_inventory.warmups()] == [(True, True), (True, True)]
    engine.logged["warning"].clear()
    engine.start((6144, 4096), (4096, 4096))
    assert len(engine.fills) == 1 and engine.logged["warning"] == []
    assert [(w.prepared, w.filled_at_start) for w in deepgemm_inventory.warmups()] == [(True, False), (True, False)]


def test_a_failed_fill_is_warned_about_and_the_warm_up_compiles_serially(engine: Engine) -> None:
    """The fill command fails: after the fill's own warning one with its reason, then the
    serial-compile warning (number of kernels, the prepare-deepgemm command for next time); no
    second fill for the next shape; the warm-up marks each shape it compiled, so the next start
    finds them prepared."""
    from fp8_align.vllm_plugin.kernels.deepgemm import inventory as deepgemm_inventory

    engine.fill_error = "it exited with 1: CUDA error: out of memory"
    engine.start((6144, 4096), (4096, 4096))
    assert len(engine.fills) == 1
    announced, fill_warning, serial_warning = engine.logged["warning"]
    assert "parallel processes before the engine serves" in announced
    assert fill_warning.endswith("failed (it exited with 1: CUDA error: out of memory); the warm-up compiles its kernels one after another instead")
    assert serial_warning == (
        f"fp8_align: DeepGEMM's JIT cache {engine.cache} is not marked prepared for this engine (4 layer shapes: N=6144 K=4096, "
        "N=4096 K=4096, N=24576 K=4096, N=4096 K=12288, up to 256 batched tokens): this start compiles up to 13 DeepGEMM "
        "kernels one after another (~0.8 s each on an H100, ~0 min) before the engine serves. DeepGEMM stays the GEMM. Next time, "
        "fill the cache ahead in parallel (once per GPU model and vLLM version): `fp8-align prepare-deepgemm --model "
        f"{engine.checkpoint} --cache-dir {engine.cache} --max-num-batched-tokens 256` and start the engine with DG_JIT_CACHE_DIR={engine.cache}"
    )
    assert [w.prepared for w in deepgemm_inventory.warmups()] == [False, False]
    assert engine.logged["info"][0].endswith("(not marked prepared: compiled where missing)")
    engine.start((6144, 4096), (4096, 4096))
    assert [w.prepared for w in deepgemm_inventory.warmups()] == [True, True]


def test_fill_helpers(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`cold_shapes`: the model's DeepGEMM shapes not marked (an undescribed model: the layer's own);
    `compile_jobs`: CPUs, at most 16, within half the free memory (routed-expert weights too; the
    CLI's default since 64 processes on a 64-core H100 host ran out of device memory); `fill_command` is a command line
    the real CLI parses (here it stops at the missing GPU); `run_fill` passes the child's stderr on
    and reports a failure with its exit status."""
    from fp8_align.vllm_plugin.kernels.deepgemm.fill import cold_shapes, fill_command, run_fill
    from fp8_align.vllm_plugin.kernels.deepgemm.inventory import ExpertShape, compile_jobs, mark_prepared

    mark_prepared(tmp_path, "setup", 6144, 4096, 512)
    assert [(s.n, s.k) for s in cold_shapes(QWEN3_8B, 1, tmp_path, "setup", 512, 4096, 4096)] == [(4096, 4096), (24576, 4096), (4096, 12288)]
    assert [(s.n, s.k) for s in cold_shapes({"model_type": "other", "num_experts": 4}, 1, tmp_path, "setup", 512, 256, 512)] == [(256, 512)]
    shapes = decoder_linear_shapes(QWEN3_8B)
    assert compile_jobs(shapes, 16384, 80 << 30, 64) == 16
    assert compile_jobs(shapes, 16384, 80 << 30, 4) == 4
    per_process = 16384 * 4096 + 2 * 16384 * 24576 + 24576 * 4096 + (1 << 30)  # gate_up's tensors and the overhead
    assert compile_jobs(shapes, 16384, 10 * per_process, 64) == 5 and compile_jobs(shapes, 16384, 0, 64) == 1
    w13 = ExpertShape("w13", 128, 1536, 2048, 8)  # Qwen3-30B-A3B's: every expert's weight and 8 rows per token
    per_expert_process = 128 * 1536 * 2048 + 16384 * 8 * (2048 + 2 * 1536) + (1 << 30)
    assert compile_jobs([], 16384, 10 * per_expert_process, 64, [w13]) == 5 and compile_jobs(shapes[:1], 16384, 80 << 30, 64, [w13]) == 16
    command = fill_command(shapes[:2], tmp_path, 512, 3, 1)
    if not torch.cuda.is_available():
        assert main(command[3:]) == 2 and "CUDA GPU" in capfd.readouterr().err
    assert run_fill([sys.executable, "-c", "import sys; sys.stderr.write('kernels 5/9\\r'); sys.exit(3)"]) == "it exited with 3: kernels 5/9"
    assert "kernels 5/9" in capfd.readouterr().err
    assert run_fill([sys.executable, "-c", "pass"]) is None




def test_fill_lock_lets_one_rank_fill_at_a_time(tmp_path: Path) -> None:
    """Two ranks (threads with their own lock handles): the second enters only after the first left."""
    import threading
    import time

    from fp8_align.vllm_plugin.kernels.deepgemm.fill import fill_lock

    events: list[str] = []

    def rank(name: str, hold_s: float) -> None:
        with fill_lock(tmp_path):
            events.append(f"{name} in")
            time.sleep(hold_s)
            events.append(f"{name} out")

    first = threading.Thread(target=rank, args=("a", 0.3))
    first.start()
    time.sleep(0.1)
    second = threading.Thread(target=rank, args=("b", 0.0))
    second.start()
    first.join()
    second.join()
    assert events == ["a in", "a out", "b in", "b out"]


#: Stands in for the GPU compile process (`python -m ...deepgemm_cache --worker`), which needs DeepGEMM
#: and an SM90 GPU: it prints the same "compiled <key> <M> <seconds>" lines, logs each call to
#: CALLS, and fails as torch does on the call named by FAIL (once if ONCE exists, else always).
_STAND_IN_WORKER = """
import json, os, sys
part, calls, fail, once = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
for key, values in part.items():
    for m in values:
        if f"{key} {m}" == fail and (not os.path.exists(once) or os.path.getsize(once) == 0):
            if os.path.exists(once):
                open(once, "w").write("failed")
            print("Traceback (most recent call last):")
            print(os.environ["FAILURE"])
            sys.exit(1)
        open(calls, "a").write(f"{key} {m}\\n")
        print(f"compiled {key} {m} 0.5", flush=True)
"""


def _compile_with_stand_in(tmp_path: Path, work: list[dict[str, list[int]]], fail: str, once: bool, failure: str):
    from fp8_align.vllm_plugin.kernels.deepgemm.cache import compile_in_processes

    tmp_path.mkdir(exist_ok=True)
    script, calls, flag = tmp_path / "worker.py", tmp_path / "calls.txt", tmp_path / "once"
    script.write_text(_STAND_IN_WORKER)
    if once:
        flag.write_text("")
    bar = []
    seconds = compile_in_processes(work, lambda part: [sys.executable, str(script), json.dumps(part), str(calls), fail, str(flag)],
                                   {**os.environ, "FAILURE": failure}, bar.append)  # fmt: skip
    return seconds, sorted(calls.read_text().split("\n")[:-1]), len(bar)


WORK = [{"4096x4096": [1, 5], "g8x256x512": [128, 256]}, {"4096x4096": [2, 6], "g8x256x512": [384, 512]}, {"4096x4096": [3]}]
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 502.00 MiB."


def test_processes_out_of_device_memory_run_their_remaining_calls_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A process that runs out of device memory (the stand-in worker above: DeepGEMM needs a GPU)
    after one call has its other calls made once more after the rest ended: every call made
    exactly once, the bar advanced once per kernel, a WARNING says so."""
    seconds, calls, steps = _compile_with_stand_in(tmp_path, WORK, "g8x256x512 384", once=True, failure=OOM)
    expected = sorted(f"{key} {m}" for part in WORK for key, values in part.items() for m in values)
    assert calls == expected and steps == len(expected) and seconds == 0.5 * len(expected)
    assert "1 of 3 DeepGEMM compile processes ran out of device memory; their 2 calls" in caplog.text


def test_other_failures_and_a_second_oom_raise(tmp_path: Path) -> None:
    """Any other failure raises at once with the process's output; a second OOM raises, naming --jobs."""
    with pytest.raises(RuntimeError, match="exited with 1:\nTraceback.*\nValueError: bad shape"):
        _compile_with_stand_in(tmp_path / "a", WORK, "4096x4096 3", once=False, failure="ValueError: bad shape")
    with pytest.raises(RuntimeError, match="failed again after running out of device memory \\(pass --jobs"):
        _compile_with_stand_in(tmp_path / "b", WORK, "4096x4096 3", once=False, failure=OOM)


def test_remaining_work_drops_calls_made() -> None:
    from fp8_align.vllm_plugin.kernels.deepgemm.cache import remaining_work

    assert remaining_work({"a": [1, 2], "b": [3]}, {("a", 1), ("b", 3)}) == {"a": [2]}
    assert remaining_work({"a": [1]}, {("a", 1)}) == {}
