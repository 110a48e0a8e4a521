"""Who holds what: the pure arithmetic of splitting heads, rows, the vocabulary and layers.

Heads are split by KV group, so each rank's query heads read only its own KV heads:

- ``num_kv_heads >= tp``: the KV heads are dealt out in contiguous runs as evenly as
  possible (3 KV heads over 2 ranks: 2 and 1), each with its group's query heads. Uneven
  runs are allowed (SmolLM2's 9 heads / 3 KV heads run at TP=2).
- ``num_kv_heads < tp``: each KV head is replicated on ``tp / num_kv_heads`` ranks, which
  split its group's query heads (needs ``tp % num_kv_heads == 0`` and the group to divide).

Plain rows (the MLP's intermediate size, a vocabulary) are split in contiguous, nearly
equal runs; the vocabulary is padded to a multiple of tp so all-gathers see equal pieces.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    q_start: int  # first query head of this rank
    num_heads: int
    kv_start: int  # first KV head of this rank
    num_kv_heads: int


def even_runs(total: int, parts: int) -> list[tuple[int, int]]:
    """``total`` items in ``parts`` contiguous (start, size) runs, sizes differing by at most one."""
    base, extra = divmod(total, parts)
    runs, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        runs.append((start, size))
        start += size
    return runs


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, kv_count = even_runs(num_kv_heads, tp_size)[tp_rank]
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if tp_size % num_kv_heads or group % (tp_size // num_kv_heads):
        raise ValueError(
            f"tensor parallel size {tp_size} cannot split {num_heads} query heads over {num_kv_heads} KV heads: "
            f"with fewer KV heads than ranks, tp must be a multiple of the KV heads and divide each group"
        )
    replicas = tp_size // num_kv_heads
    kv = tp_rank // replicas
    per_rank = group // replicas
    return HeadShard(kv * group + (tp_rank % replicas) * per_rank, per_rank, kv, 1)


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """This rank's (start, size) of the padded vocabulary; rows past ``vocab_size`` are padding."""
    per_rank = padded_vocab(vocab_size, tp_size) // tp_size
    return tp_rank * per_rank, per_rank


def layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """This pipeline stage's [start, end) decoder layers (contiguous, nearly equal)."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline parallel size {pp_size} exceeds the model's {num_layers} layers")
    start, size = even_runs(num_layers, pp_size)[pp_rank]
    return start, start + size


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> None:
    """Raise ValueError (before any process starts) when the model cannot be split ``tp_size`` ways."""
    if intermediate_size < tp_size or num_heads < tp_size:
        raise ValueError(f"tensor parallel size {tp_size} exceeds the model's {num_heads} attention heads "
                         f"or its intermediate size {intermediate_size}")
    for rank in range(tp_size):
        head_shard(num_heads, num_kv_heads, tp_size, rank)
