"""MoE models in megatron-core: which settings make routed experts quantize as generation does.

Read from megatron-core 0.19.2 (paths under megatron/core/):

- Routed experts run through TransformerEngine inside the same per-layer FP8 context as the dense
  linears (`fp8_utils.py:774`, `transformer/transformer_layer.py:529`), so the blockwise recipe
  and the first/last BF16 layers from `shim.fp8_fields` cover them with no MoE-specific field.
  With `moe_grouped_gemm=True` (`transformer/transformer_config.py:829`) the experts are a
  `TEGroupedMLP` (`transformer/moe/experts.py:182`) of TE `GroupedLinear`s holding one weight
  per local expert (`weight0`, `weight1`, ...; `extensions/transformer_engine.py:2106`); with
  False a `SequentialMLP` (`experts.py:1260`) of TE linears, one MLP per expert
  (`extensions/transformer_engine_spec_provider.py:75-107`). Either way each local expert weight
  is its own tensor with its own 128x128 grid, so fp8_align leaves the choice to you.
- The grid is per shard: the experts' tensor-parallel size is `expert_tensor_parallel_size`
  (`model_parallel_config.py:130`, defaulting to `tensor_model_parallel_size` at line 506), and
  `TEGroupedLinear` divides fc1's output and fc2's input by it (`extensions/transformer_engine.py:2191`).
  `linear_fc1` holds each expert's gate rows then its up rows (twice `moe_ffn_hidden_size`
  with a gated linear unit, `experts.py:212-214`; `moe_ffn_hidden_size` defaults to
  `ffn_hidden_size`, `transformer_config.py:719` and 1534). Generation quantizes gate, up and
  down each on its own 128x128 grid, so the per-partition size `moe_ffn_hidden_size /
  expert_tensor_parallel_size` must be a multiple of 128 (unless experts are ungated and
  unsharded), and so must a GLU interleave block (`moe_mlp_glu_interleave_size`, line 969);
  `check_moe_alignment` refuses anything else.
- The router is never FP8: its weight is a plain parameter (`transformer/moe/router.py:61`) and
  its logits come from `RouterGatingLinearFunction` (`transformer/moe/moe_utils.py:1294`), a torch
  matmul that TE's autocast does not touch; the shared-expert gate is an `F.linear`
  (`transformer/moe/shared_experts.py:134`, 199). fp8_align's generation side keeps both BF16
  (`fp8_align.layer_selection.is_router`). `moe_router_dtype` (`transformer_config.py:790`) is a
  routing-precision choice outside the FP8 recipe and is left alone: None gives BF16 logits like
  vLLM's and HF's Qwen-MoE gates, 'fp32'/'fp64' give unrounded logits.
- Token padding needs no setting: without `moe_router_padding_for_quantization` (line 750; the
  alias `moe_router_padding_for_fp8`, line 755) the experts pad each expert's tokens themselves
  (`experts.py:304-309`, 1304-1315). Padding rows are zero tokens in their own 1x128 activation
  groups, so they change no other token's codes.
- FP8 only reaches the experts through TE: `transformer_impl` (`transformer_config.py:1220`)
  must be 'transformer_engine'. megatron-core itself refuses MoE FP8 without TE >= 1.7, FP8
  grouped GEMM without TE >= 1.11 (lines 2294-2306) and `moe_single_grouped_weight` with the
  blockwise recipe (line 1567).

Known difference that no setting removes: `TEGroupedMLP` multiplies the routing probabilities
into fc2's input before it is quantized (`bias_act_func`, `experts.py:807-879`), while generation
(vLLM's fused MoE, `fp8_align.quant.moe.block_fp8_moe_reference`) weights fc2's output. Weights
and scales still agree; fc2's activation codes can differ by rounding.
"""

from __future__ import annotations

from typing import Any

from fp8_align.config import FP8Config
from fp8_align.megatron_ext.te_emulation import TE_BLOCK_LEN
from fp8_align.megatron_ext.validation import TrainingSetupError

#: Expert tensor-parallel sizes offered in the error message when the configured one breaks the grid.
_CANDIDATE_EXPERT_TP_SIZES = (1, 2, 4, 8)


def check_moe_alignment(config: Any, cfg: FP8Config) -> None:
    """Raise TrainingSetupError, listing what to change, when `config` (a megatron-core
    TransformerConfig after its `__post_init__`) would quantize routed experts differently from
    generation. Nothing is checked for dense models (`num_moe_experts` None), BF16 training
    (`cfg.fp8` None) or with `cfg.allow_recipe_mismatch`."""
    if config.num_moe_experts is None or cfg.fp8 is None or cfg.allow_recipe_mismatch:
        return
    problems = moe_problems(config)
    if problems:
        raise TrainingSetupError(
            "routed experts would not be quantized as on the generation side:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
            + "\n(or set allow_recipe_mismatch=True to accept the difference)"
        )


def moe_problems(config: Any) -> list[str]:
    """Why `config`'s MoE settings break the expert alignment with generation (empty: none)."""
    problems = []
    if config.transformer_impl != "transformer_engine":
        problems.append(
            f"transformer_impl='{config.transformer_impl}' builds experts without TransformerEngine, "
            "so they train in BF16 while generation runs them in block FP8; set "
            "transformer_impl='transformer_engine'."
        )
    problems += _expert_grid_problems(
        config.moe_ffn_hidden_size, config.expert_tensor_parallel_size, config.gated_linear_unit
    )
    interleave = getattr(config, "moe_mlp_glu_interleave_size", None)
    if interleave is not None and interleave % TE_BLOCK_LEN:
        problems.append(
            f"moe_mlp_glu_interleave_size={interleave} puts gate and up rows into the same 128-row "
            "weight blocks, but generation quantizes gate and up on separate 128x128 grids; use a "
            "multiple of 128 or None."
        )
    return problems


def _expert_grid_problems(moe_ffn_hidden_size: int, expert_tp_size: int, gated: bool) -> list[str]:
    """The per-partition check of `_expert_grid_aligned`, with the sizes that would pass."""
    if _expert_grid_aligned(moe_ffn_hidden_size, expert_tp_size, gated):
        return []
    valid = [size for size in _CANDIDATE_EXPERT_TP_SIZES if _expert_grid_aligned(moe_ffn_hidden_size, size, gated)]
    advice = (
        f"use expert_tensor_parallel_size in {valid}"
        if valid
        else "no expert_tensor_parallel_size aligns a gated expert whose moe_ffn_hidden_size is not a multiple of 128"
    )
    return [
        f"moe_ffn_hidden_size={moe_ffn_hidden_size} / expert_tensor_parallel_size={expert_tp_size} "
        "is not a multiple of 128 per partition: TransformerEngine quantizes each rank's expert "
        "shards (linear_fc1: gate rows then up rows; linear_fc2) on 128x128 blocks that would "
        "straddle gate and up rows or shard edges, unlike generation's per-projection grids; "
        f"{advice}."
    ]


def _expert_grid_aligned(moe_ffn_hidden_size: int, expert_tp_size: int, gated: bool) -> bool:
    """Each rank's expert shards start on 128 boundaries: the up rows of a stacked linear_fc1
    (when `gated`) and every shard edge (when `expert_tp_size` > 1)."""
    per_partition, remainder = divmod(moe_ffn_hidden_size, expert_tp_size)
    if remainder:
        return False
    return per_partition % TE_BLOCK_LEN == 0 or (expert_tp_size == 1 and not gated)
