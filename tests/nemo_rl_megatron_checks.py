"""NeMo RL's Megatron-policy log-prob unit on a bitwise megatron-core GPTModel (CPU), run by
tests/test_nemo_rl_logprobs.py in a process of its own with NeMo RL's pins first on the path
(`.cache/nemo_rl_site`: NeMo RL 0.6.0 at commit 7ea279a refuses transformers >= 5.12).

NeMo RL's code runs through `benchmarks/nemo_rl_megatron_scorer.NemoRLMegatronScorer`; its docstring
says what is not NeMo RL's own (the Ray worker, Megatron-Bridge's build; the module stand-ins of
benchmarks/nemo_rl_path.py; on CPU the forward step instead of megatron-core's schedule). The
reference is `token_logprobs(gpt, ..., temperature=T)`: the engine's log-probs, with the pure-torch
kernels on CPU.

Unlike the DTensor unit, NeMo RL's Megatron unit composes its own log-softmax (max, exp-sum, log)
instead of calling torch's, so even on CPU its unpatched log-probs are not the engine's bits: the
checks see the patch change them, and NeMo RL's packing, padding to a length multiple, unpacking
and re-ordering around the bitwise model.

Stood in for on CPU, and nothing else: `BatchedDataDict.to("cuda")` moves to the CPU (NeMo RL's
`make_processed_microbatch_iterator` moves each micro-batch to CUDA). With CUDA (the GPU box, NeMo
RL's pins first on the path) the same checks run on the GPU through megatron-core's schedule, with
the engine's kernels on both sides.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from benchmarks.nemo_rl_megatron_scorer import NemoRLMegatronScorer  # first: the vendored tree and its stand-ins

import nemo_rl.distributed.model_utils as model_utils  # noqa: E402, I001
import nemo_rl.package_info  # noqa: E402
from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams  # noqa: E402
from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # noqa: E402
from nemo_rl.models.megatron import train  # noqa: E402

from fp8_align import FP8Config
from fp8_align.hf_training import patch_stack_logprobs, stack_patches, unpatch_stack_logprobs
from fp8_align.megatron_ext.bitwise import build_bitwise_gpt, token_logprobs
from tests.model_factory import tiny_hf_model
from tests.packed_sequences import PROMPT_LENS, SEQUENCES

CFG = FP8Config(on_policy="bitwise", precision="fp8")
#: A token budget of the longest sequence: the 3 sequences take 2 micro-batches, one of them two packed.
BUDGET = max(len(s) for s in SEQUENCES) + 8


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def cpu_batches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The module docstring's one stand-in (without CUDA), and NeMo RL's own functions back after each check."""
    if DEVICE == "cpu":
        to = BatchedDataDict.to
        monkeypatch.setattr(BatchedDataDict, "to", lambda self, device: to(self, "cpu" if str(device).startswith("cuda") else device))
    yield
    unpatch_stack_logprobs("nemo_rl_megatron")


@pytest.fixture(scope="module")
def gpt() -> torch.nn.Module:
    return build_bitwise_gpt(tiny_hf_model("qwen3").to(DEVICE), CFG).eval()


@pytest.mark.parametrize("multiple", [1, 8])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_nemo_rl_megatron_log_probs_of_the_bitwise_model_are_the_engines(
    gpt: torch.nn.Module, temperature: float, multiple: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed micro-batches (padded THD with `make_sequence_length_divisible_by=8`), re-ordered: the
    engine's bits, the engine's log-softmax called once per micro-batch."""
    calls = []
    engine = stack_patches.engine_label_logprobs
    monkeypatch.setattr(stack_patches, "engine_label_logprobs", lambda *args: calls.append(1) or engine(*args))
    scorer = NemoRLMegatronScorer(gpt, pad_id=0, max_tokens_per_microbatch=BUDGET, sequence_length_multiple=multiple)
    with torch.no_grad():
        expected = token_logprobs(gpt, SEQUENCES, PROMPT_LENS, temperature=temperature)
    for mine, theirs in zip(scorer.token_logprobs(SEQUENCES, PROMPT_LENS, temperature), expected, strict=True):
        assert mine.dtype == torch.float32 and torch.equal(mine, theirs.cpu())  # NeMo RL's worker returns host tensors
    assert len(calls) == 2, f"NeMo RL's Megatron unit called the engine's log-softmax {len(calls)} times for its 2 micro-batches"


def test_unpatched_nemo_rl_megatron_log_probs_are_not_the_engines(gpt: torch.nn.Module) -> None:
    """NeMo RL's own composed log-softmax, the patch undone: not the engine's bits, within float rounding."""
    scorer = NemoRLMegatronScorer(gpt, pad_id=0, max_tokens_per_microbatch=BUDGET)
    unpatch_stack_logprobs("nemo_rl_megatron")
    with torch.no_grad():
        expected = torch.cat(token_logprobs(gpt, SEQUENCES, PROMPT_LENS)).cpu()
    theirs = torch.cat(scorer.token_logprobs(SEQUENCES, PROMPT_LENS, 1.0))
    assert not torch.equal(theirs, expected)
    assert (theirs - expected).abs().max().item() < 1e-4


def test_the_nemo_rl_megatron_patch_applies_once_is_undone_and_refuses_what_it_cannot_do(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("DistributedLogprob", "ChunkedDistributedLogprob", "DistributedLogprobWithSampling", "ChunkedDistributedLogprobWithSampling")
    originals = (train.apply_temperature_scaling, *(getattr(model_utils, n) for n in names))
    assert patch_stack_logprobs("nemo_rl_megatron") is patch_stack_logprobs("nemo_rl_megatron")
    assert not {id(train.apply_temperature_scaling), *(id(getattr(model_utils, n)) for n in names)} & set(map(id, originals))
    logits = torch.randn(1, 3, 8)
    before = logits.clone()
    assert train.apply_temperature_scaling(logits, TrainingSamplingParams(temperature=0.6)) is logits  # in place: NeMo RL drops the result
    assert torch.equal(logits, before / torch.full((1, 3, 1), 0.6))
    with pytest.raises(ValueError, match="FP32 logits"):
        train.apply_temperature_scaling(torch.zeros(1, 2, 8, dtype=torch.bfloat16), TrainingSamplingParams(temperature=0.6))
    with pytest.raises(NotImplementedError, match="tensor parallel size 1 only"):
        model_utils.DistributedLogprob.apply(logits, torch.zeros(1, 3, dtype=torch.long), 0, 4, None)
    for name in names[1:]:
        with pytest.raises(NotImplementedError, match=f"refuses {name}"):
            getattr(model_utils, name).apply(logits, torch.zeros(1, 3, dtype=torch.long))
    unpatch_stack_logprobs("nemo_rl_megatron")
    assert (train.apply_temperature_scaling, *(getattr(model_utils, n) for n in names)) == originals
    monkeypatch.setattr(nemo_rl.package_info, "__shortversion__", "0.7.0")
    with pytest.raises(ValueError, match=r"nemo_rl_megatron 0\.7\.0: patch_stack_logprobs\('nemo_rl_megatron'\) is read from"):
        patch_stack_logprobs("nemo_rl_megatron")
    assert train.apply_temperature_scaling is originals[0]
