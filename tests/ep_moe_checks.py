"""What the expert-parallel MoE engine tests (tests/test_gpu_ep_moe.py on 2 GPUs,
tests/test_vllm_plugin_ep.py on CPU) share: where vLLM puts each expert under
`enable_expert_parallel=True`, the worker-side reader of each rank's routed experts, and the
checks of what each rank holds against `fp8_align.quant` of the checkpoint.

Expert parallelism in vLLM (0.22 CUDA, 0.32 CPU; `FusedMoEParallelConfig.make`): with
`tensor_parallel_size=T` and `enable_expert_parallel=True`, the routed experts are not split by
tensor parallelism (their tp_size becomes 1) but distributed whole over ep_size = T ranks, ep_rank =
tp_rank. The default "linear" placement (`expert_map_manager.determine_expert_map`) gives rank r
the contiguous global ids [r * E/T, (r + 1) * E/T) when T divides E, stored in local slots
0 .. E/T - 1 in that order; the layer's `expert_map` [E] holds each global id's local slot, -1
for the other ranks' experts. Attention and the other dense layers stay tensor parallel.

`local_expert_state` runs in the workers (`llm.apply_model`); nothing here imports vLLM or
touches CUDA at import.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8_align.quant import quantize_weight_blockwise
from fp8_align.quant.moe import expert_shard_rows
from fp8_align.vllm_plugin.inspection import portable_fp8_codes
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer
from tests.gpu_models import assert_same_storage, fp8_state
from tests.tp_slices import assert_rank_holds

#: Checkpoint projection of each expert shard, in vLLM's loader terms (gate w1, up w3, down w2).
HF_SHARDS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
#: The attention projections of a decoder layer, tensor parallel under expert parallelism too.
ATTENTION = ("self_attn.qkv_proj", "self_attn.o_proj")


def linear_placement(num_experts: int, ep_size: int, ep_rank: int) -> list[int]:
    """Global expert ids rank `ep_rank` of `ep_size` holds under vLLM's "linear" placement, in
    local-slot order (an even split, the first `num_experts % ep_size` ranks one more)."""
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return list(range(start, start + base + (1 if ep_rank < extra else 0)))


def expected_expert_map(num_experts: int, ep_size: int, ep_rank: int) -> list[int]:
    """The layer's `expert_map` under linear placement: global id -> local slot, -1 elsewhere."""
    local = linear_placement(num_experts, ep_size, ep_rank)
    return [local.index(e) if e in local else -1 for e in range(num_experts)]


def expert_names(layer: int, experts: list[int]) -> list[str]:
    """Checkpoint names of the gate, up and down weights of `experts` in decoder layer `layer`."""
    return [f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight" for e in experts for hf in HF_SHARDS.values()]


def local_expert_state(model: torch.nn.Module) -> dict[str, Any]:
    """Worker side: per fp8_align routed-experts layer, the rank's expert-parallel coordinates
    (`ep_rank`, `ep_size`, `tp_size` of the experts), `global_experts`, `local_experts`,
    `expert_map` (list, None without expert parallelism), quant method and kernel, the codes
    (`w13`, `w2`: uint8 CPU copies, [local E, 2I, H] / [local E, H, I]; FP8 tensors do not survive
    the trip out of a worker process, see `portable_fp8_codes`), the scales (float32 CPU copies)
    and the data pointers of codes and scales."""
    layers: dict[str, Any] = {}
    for name, m in model.named_modules():
        if not is_fp8_align_layer(m, "experts"):
            continue
        parallel = m.moe_config.moe_parallel_config
        expert_map = m.expert_map
        layers[name] = {
            "ep_rank": parallel.ep_rank, "ep_size": parallel.ep_size, "tp_size": parallel.tp_size,
            "global_experts": m.global_num_experts, "local_experts": m.local_num_experts,
            "expert_map": None if expert_map is None else expert_map.cpu().tolist(),
            "method": type(m.quant_method).__name__, "kernel": m.quant_method.kernel_name,
            "w13": portable_fp8_codes(m.w13_weight)["weight"], "w2": portable_fp8_codes(m.w2_weight)["weight"],
            "w13_scale_inv": m.w13_weight_scale_inv.detach().cpu(), "w2_scale_inv": m.w2_weight_scale_inv.detach().cpu(),
            "pointers": [m.w13_weight.data_ptr(), m.w2_weight.data_ptr(), m.w13_weight_scale_inv.data_ptr(),
                         m.w2_weight_scale_inv.data_ptr()],
        }  # fmt: skip
    return layers


def assert_rank_placement(state: dict[str, Any], rank: int, ep_size: int, num_experts: int, num_layers: int) -> None:
    """Every MoE layer of rank `rank` (`local_expert_state`) is expert parallel over `ep_size`
    ranks with this rank's ep_rank, holds num_experts / ep_size whole experts (no tensor split)
    and maps them as vLLM's linear placement does."""
    assert len(state) == num_layers, sorted(state)
    for name, entry in state.items():
        where = (rank, name)
        assert (entry["ep_rank"], entry["ep_size"], entry["tp_size"]) == (rank, ep_size, 1), (where, entry["ep_rank"], entry["ep_size"])
        assert entry["global_experts"] == num_experts, where
        assert entry["local_experts"] == len(linear_placement(num_experts, ep_size, rank)), where
        assert entry["w13"].shape[0] == entry["w2"].shape[0] == entry["local_experts"], where
        assert entry["expert_map"] == expected_expert_map(num_experts, ep_size, rank), where


def assert_local_experts_hold(state: dict[str, Any], weights: dict[str, torch.Tensor], rank: int, pow2: bool = False) -> None:
    """Every local slot of every MoE layer of rank `rank` holds `quantize_weight_blockwise` of
    its global expert's checkpoint tensors in `weights` (linear placement), codes and scales bit for
    bit, and nothing else: the layer has exactly those slots."""
    for name, entry in state.items():
        layer = int(name.split(".")[2])
        hidden, inter = entry["w2"].shape[1], entry["w2"].shape[2]
        ids = linear_placement(entry["global_experts"], entry["ep_size"], rank)
        assert entry["w13"].shape[0] == len(ids), (rank, name)
        for slot, expert in enumerate(ids):
            for shard, hf in HF_SHARDS.items():
                where = expert_shard_rows(shard, inter, hidden)
                hf_weight = weights[f"model.layers.{layer}.mlp.experts.{expert}.{hf}.weight"]
                codes, scales = quantize_weight_blockwise(hf_weight, pow2_scale=pow2)
                what = (rank, layer, f"slot {slot} = expert {expert}", shard)
                held_scales = entry[f"{where.param}_scale_inv"][slot, where.scale_rows]
                assert torch.equal(entry[where.param][slot, where.rows], codes.view(torch.uint8)), what
                assert torch.equal(held_scales.view(torch.int32), scales.view(torch.int32)), what


def assert_attention_slices(
    linear_state: dict[str, Any], weights: dict[str, torch.Tensor], layers: range, rank: int, tp: int, pow2: bool = False
) -> None:
    """Rank `rank`'s FP8 attention projections (`tests.gpu_models.fp8_state` of one worker) hold
    `fp8_align.quant` of its tensor-parallel slice of `weights` (`tests.tp_slices.expected_rank_fp8`)."""
    assert_rank_holds(linear_state, weights, layers, rank, tp, ATTENTION, pow2)


def assert_same_expert_storage(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    """Every rank's expert codes and scales still live where they did (in-place writes only)."""
    assert len(before) == len(after)
    for rank, (old, new) in enumerate(zip(before, after)):
        assert new.keys() == old.keys(), rank
        moved = [name for name, entry in old.items() if new[name]["pointers"] != entry["pointers"]]
        assert not moved, f"rank {rank}: expert storage moved: {moved}"


def moe_batch(tokens: int, hidden: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed routed-experts input on the host: (x [T, H] bf16, routing weights [T, k] float32
    summing to 1 per token, global expert ids [T, k] int32, k distinct per token), the same in
    every process that asks (CPU generator, seed 0)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return x, weights, ids


def experts_layer_share(model: torch.nn.Module, tokens: int, top_k: int) -> dict[str, Any]:
    """Worker side: the first fp8_align routed-experts layer's output on `moe_batch` (global expert
    ids, as vLLM's router hands them to the quant method's `apply`): this rank's share of the
    layer, the sum over its local experts only, before vLLM's all-reduce. Returns the layer `name`
    and `out` (a CPU copy, x's dtype)."""
    name, layer = next((n, m) for n, m in model.named_modules() if is_fp8_align_layer(m, "experts"))
    x, weights, ids = moe_batch(tokens, layer.w2_weight.shape[1], layer.global_num_experts, top_k)
    device = layer.w13_weight.device
    with torch.no_grad():
        out = layer.quant_method.apply(layer, x.to(device), weights.to(device), ids.to(device), None, None)
    return {"name": name, "out": out.detach().cpu()}


def reference_experts(weights: dict[str, torch.Tensor], layer: int, num_experts: int, pow2: bool = False) -> tuple[torch.Tensor, ...]:
    """(c13, s13, c2, s2) of ALL `num_experts` experts of decoder layer `layer`, quantized from the
    checkpoint `weights` by `fp8_align.quant.moe.quantize_experts` (the recipe, per shard), indexed
    by global expert id."""
    from fp8_align.quant.moe import quantize_experts

    prefix = f"model.layers.{layer}.mlp.experts"
    gate_up = [torch.cat([weights[f"{prefix}.{e}.gate_proj.weight"], weights[f"{prefix}.{e}.up_proj.weight"]]) for e in range(num_experts)]
    w13 = torch.stack(gate_up)
    w2 = torch.stack([weights[f"{prefix}.{e}.down_proj.weight"] for e in range(num_experts)])
    return quantize_experts(w13, w2, pow2)


def share_vs_reference(
    shares: list[dict[str, Any]], weights: dict[str, torch.Tensor], num_experts: int, top_k: int, act_pow2: bool = False
) -> dict[str, Any]:
    """Each rank's share (`experts_layer_share`, in rank order) against `block_fp8_moe_reference`
    on the checkpoint's reference experts with the batch's expert ids masked to that rank's
    experts (linear placement; the others -1, skipped); and the ranks' shares summed (what vLLM's
    all-reduce makes of them) against the reference over all experts. Per rank `ranks[r]` and for the
    sum `sum`: largest and mean |difference| and |reference| (`assert_within_moe_tolerance`'s keys)."""
    from fp8_align.quant.moe import block_fp8_moe_reference

    layer = int(shares[0]["name"].split(".")[2])
    c13, s13, c2, s2 = reference_experts(weights, layer, num_experts)
    x, routing, ids = moe_batch(shares[0]["out"].shape[0], c2.shape[1], num_experts, top_k)

    def compare(got: torch.Tensor, ids_used: torch.Tensor) -> dict[str, float]:
        ref = block_fp8_moe_reference(x, routing, ids_used, c13, s13, c2, s2, act_pow2).float()
        diff = (got.float() - ref).abs()
        return {"max_abs_diff": float(diff.max()), "max_abs_ref": float(ref.abs().max()),
                "mean_abs_diff": float(diff.mean()), "mean_abs_ref": float(ref.abs().mean())}  # fmt: skip

    ranks = []
    for rank, share in enumerate(shares):
        local = torch.tensor(linear_placement(num_experts, len(shares), rank), dtype=ids.dtype)
        ranks.append(compare(share["out"], torch.where(torch.isin(ids, local), ids, torch.full_like(ids, -1))))
    total = torch.stack([share["out"].float() for share in shares]).sum(dim=0)
    return {"ranks": ranks, "sum": compare(total, ids)}


def assert_engine_holds(llm: Any, weights: dict[str, torch.Tensor], ranks: int, num_experts: int, num_layers: int) -> list[dict[str, Any]]:
    """Every rank of the expert-parallel engine `llm` holds vLLM's linear placement of experts, the
    reference of `weights`' local experts and of its attention slices; returns the expert states."""
    states = llm.apply_model(local_expert_state)
    linears = llm.apply_model(fp8_state)
    assert len(states) == len(linears) == ranks
    for rank in range(ranks):
        assert_rank_placement(states[rank], rank, ranks, num_experts, num_layers)
        assert_local_experts_hold(states[rank], weights, rank)
        assert_attention_slices(linears[rank], weights, range(num_layers), rank, ranks)
    return states


def assert_refit_writes_only_local_experts(
    llm: Any, checkpoints: dict[str, Any], weights: dict[str, dict[str, torch.Tensor]], ranks: int, num_experts: int, num_layers: int
) -> None:
    """From W1 in `llm`: `refit_weights` with only rank 1's experts of W2 rewrites rank 1's experts
    and leaves rank 0's as they were; with all of W2 every rank holds W2's local experts and
    attention slices; every code and scale stays in its storage."""
    from fp8_align.vllm_plugin.refit import refit_weights

    w1, w2 = weights["w1"], weights["w2"]
    before = llm.apply_model(local_expert_state)
    linears_before = llm.apply_model(fp8_state)
    rank1_experts = {name: w2[name] for layer in range(num_layers) for name in expert_names(layer, linear_placement(num_experts, ranks, 1))}
    results = refit_weights(llm, rank1_experts)
    assert len(results) == ranks and all(r.fp8_tensors == len(rank1_experts) and r.reloaded_tensors == 0 for r in results)
    after = llm.apply_model(local_expert_state)
    assert_local_experts_hold(after[0], w1, rank=0)  # not one of rank 0's experts changed
    assert_local_experts_hold(after[1], w2, rank=1)
    assert_same_expert_storage(before, after)
    assert len(refit_weights(llm, checkpoints["w2"])) == ranks
    assert_same_expert_storage(before, assert_engine_holds(llm, w2, ranks, num_experts, num_layers))
    for rank, linears in enumerate(llm.apply_model(fp8_state)):
        assert_same_storage(linears_before[rank], linears)
