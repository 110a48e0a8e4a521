"""Tiny random HF models and a hand-built paged-attention driver for model tests.

``make_tiny_model`` saves a seeded random Llama / Qwen2 / Qwen3 (hidden 64, 2 layers,
GQA) with ``save_pretrained``; ``run_chunks`` and ``forward_batch`` run our model over a
paged KV cache the way the model runner will, building AttentionMetadata by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config, Qwen3Config

from tidal_engine.layers.attention import AttentionMetadata
from tidal_engine.models.llama import LlamaForCausalLM

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

# name → (config class, overrides). Together they cover: plain Llama, llama3 rope
# scaling with tied embeddings, Qwen2's q/k/v bias (tied, as Qwen2-0.5B is), and
# Qwen3's q/k norm with a head_dim that is not hidden / heads.
TINY_MODELS: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (LlamaConfig, dict(vocab_size=320, rope_theta=10000.0)),
    "llama3_rope_tied": (
        LlamaConfig,
        dict(
            vocab_size=500,
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "qwen2_tied": (Qwen2Config, dict(vocab_size=256, tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": (Qwen3Config, dict(vocab_size=1000, head_dim=32, tie_word_embeddings=False)),
}


def make_tiny_model(name: str, folder: Path, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Build the named tiny random model in float32, save it to ``folder``, return it (eval mode)."""
    config_cls, kwargs = TINY_MODELS[name]
    config = config_cls(**{**_COMMON, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF's default init is tiny (std 0.02), which makes logits nearly flat; widen it so
    # that a wrong rotary or mask shows up as a large logit difference.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
            elif "norm" in param_name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)  # biases
    model.save_pretrained(folder)
    return model.eval()


@dataclass
class SeqStep:
    """One sequence's share of a step: ``new_tokens`` at positions ``start..start+len``."""

    new_tokens: list[int]
    start: int
    block_table: list[int]


def build_metadata(steps: list[SeqStep], block_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, AttentionMetadata) for a flat batch of sequences."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    for step in steps:
        for offset, token in enumerate(step.new_tokens):
            pos = step.start + offset
            input_ids.append(token)
            positions.append(pos)
            slots.append(step.block_table[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + len(step.new_tokens))
        seq_lens.append(step.start + len(step.new_tokens))
    width = max(len(step.block_table) for step in steps)
    block_tables = torch.zeros(len(steps), width, dtype=torch.int32)
    for i, step in enumerate(steps):
        block_tables[i, : len(step.block_table)] = torch.tensor(step.block_table, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(len(step.new_tokens) for step in steps),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta


def allocate_kv_caches(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    cfg = model.config
    dtype = model.embed_tokens.weight.dtype
    shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    # NaN-filled, so reading a slot that was never written poisons the output visibly.
    return [torch.full(shape, float("nan"), dtype=dtype) for _ in range(cfg.num_hidden_layers)]


@torch.no_grad()
def forward_batch(
    model: LlamaForCausalLM, kv_caches: list[torch.Tensor], steps: list[SeqStep], block_size: int
) -> list[torch.Tensor]:
    """Run one step; returns each sequence's logits for its new tokens ``[n_i, vocab]``."""
    input_ids, positions, meta = build_metadata(steps, block_size)
    logits = model.compute_logits(model(input_ids, positions, kv_caches, meta))
    starts = meta.query_start_loc_cpu
    return [logits[starts[i] : starts[i + 1]] for i in range(len(steps))]


def scattered_block_table(num_blocks_needed: int, first_block: int = 1) -> list[int]:
    """Non-contiguous, descending block ids, so a gather that ignores the table fails."""
    return [first_block + 2 * (num_blocks_needed - 1 - i) for i in range(num_blocks_needed)]


def run_chunks(
    model: LlamaForCausalLM, token_ids: list[int], chunk_sizes: list[int] | int, block_size: int
) -> torch.Tensor:
    """Feed one sequence in chunks (a list of sizes, or one size repeated) through a fresh
    paged cache; returns the logits of every token ``[len(token_ids), vocab]``."""
    if isinstance(chunk_sizes, int):
        sizes = [chunk_sizes] * (len(token_ids) // chunk_sizes)
        if len(token_ids) % chunk_sizes:
            sizes.append(len(token_ids) % chunk_sizes)
    else:
        sizes = list(chunk_sizes)
    assert sum(sizes) == len(token_ids), "chunk sizes must cover the sequence exactly"
    blocks_needed = -(-len(token_ids) // block_size)
    block_table = scattered_block_table(blocks_needed)
    kv_caches = allocate_kv_caches(model, num_blocks=max(block_table) + 2, block_size=block_size)
    outputs: list[torch.Tensor] = []
    start = 0
    for size in sizes:
        step = SeqStep(token_ids[start : start + size], start, block_table)
        outputs.append(forward_batch(model, kv_caches, [step], block_size)[0])
        start += size
    return torch.cat(outputs)


@torch.no_grad()
def hf_logits(hf_model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """The reference: HF's logits for every position of one unpadded sequence."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()
