"""The draft model on the worker, next to the target, with its KV in the target's blocks.

A small model that shares the target's tokenizer guesses each drafting row's next k tokens
greedily, on the device, with no host round trip (so async scheduling keeps working):

- **Its KV lives in the target's block manager.** Every KV block id holds the target's and the
  draft's KV for the same token positions: the draft has its own per-layer caches with the
  target's number of blocks, indexed by the same block tables and slot mapping. The runner sizes
  the cache by the combined per-block bytes. There is no pool, no per-request state and no
  rollback of its own: a rejected position's draft KV is overwritten when that position is fed
  again, exactly like the target's.
- **After every target forward** (``forward_step``): one draft forward over the step's own
  tokens, positions and attention metadata, so the draft's KV follows the target's (prompt
  chunks, decodes, verified drafts; prefix-cache hits find both).
- **Before a verify step's target forward** (``propose_into``): for each row whose drafts the
  device makes, k one-token forwards from the row's first token of the step (the token the
  target emitted last, at its position: shifted on the device by what the previous step
  accepted when that step was still in flight), each feeding the argmax of the last. The drafts
  land in the step's input ids right after that token, where the verifier reads them. Their KV
  slots are the ones the step itself feeds, which the scheduler reserved with it.

Greedy drafts are deterministic, so the verifier treats them as one-hot (exact for sampled rows
too). The draft runs eagerly (no CUDA graphs) and unsharded (tensor parallel is refused).
"""

from __future__ import annotations

from typing import Any

import torch

from tidal_engine.layers.attention import AttentionMetadata, set_attention_backend
from tidal_engine.models.loader import ModelSource, load_model, resolve_model


def check_draft_model(model: str, *, target_vocab_size: int, target_tokenizer: Any, max_model_len: int,
                      cache_dir: str | None = None) -> ModelSource:
    """Resolve the draft (the target's own path/alias checks) and refuse one that cannot share
    the target's tokenizer or context; nothing is loaded (the engine core calls this before the
    workers start, so a bad draft fails fast)."""
    source = resolve_model(model, cache_dir)
    arch = source.arch_config
    if arch.vocab_size != target_vocab_size:
        raise ValueError(f"the draft model {model!r} has {arch.vocab_size} logits, the target {target_vocab_size}: "
                         "a draft model must share the target's tokenizer and vocabulary")
    if target_tokenizer is not None and source.load_tokenizer(cache_dir).get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"the draft model {model!r} has a different tokenizer vocabulary from the target's: "
                         "a draft model must share the target's tokenizer")
    if arch.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model {model!r} has a context of {arch.max_position_embeddings} tokens, "
                         f"shorter than max_model_len ({max_model_len}): lower --max-model-len")
    return source


class DraftModel:
    def __init__(self, model: str, num_speculative_tokens: int, *, dtype: torch.dtype, device: torch.device,
                 block_size: int, backend: Any, cache_dir: str | None = None, load_format: str = "auto") -> None:
        from tidal_engine.runner.model_runner import kv_cache_spec

        self.k = num_speculative_tokens
        self.device = device
        self.block_size = block_size
        # load_format "dummy" (benchmarks): random weights, like the target's
        self.model = load_model(resolve_model(model, cache_dir), dtype, device, load_format)
        set_attention_backend(self.model, backend)
        # The draft's caches keep the model dtype (the target's may be fp8, with per-layer scales).
        self.spec = kv_cache_spec(self.model, block_size, dtype)
        self.caches: list[torch.Tensor] = []

    @property
    def bytes_per_block(self) -> int:
        """What one KV block id costs on top of the target's: the draft's layers."""
        return self.spec.bytes_per_block

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate(self, num_blocks: int) -> None:
        """One cache per draft layer, as many blocks as the target's (same block ids)."""
        s = self.spec
        shape = (2, num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        self.caches = [torch.zeros(shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]

    def release(self) -> None:
        self.caches = []

    def forward_step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The draft's KV for a target step's tokens (its inputs and metadata, as staged)."""
        self.model(ids, positions, self.caches, meta)

    def propose_into(self, ids: torch.Tensor, positions: torch.Tensor, first: torch.Tensor,
                     block_tables: torch.Tensor, num_drafts: torch.Tensor, max_drafts: int) -> None:
        """Write each row's drafts into ``ids`` after its first token.

        ``ids``/``positions``: the step's staged flat inputs (device views, final for the row's
        first token); ``first`` [R]: each drafting row's first token in the flat batch;
        ``block_tables`` [R, W]: its blocks; ``num_drafts`` [R]: its draft slots (>= 1),
        ``max_drafts`` their maximum (host). Row r feeds its first token at position p, then
        each draft, at p + j for j < num_drafts[r]; past that a row repeats its last position
        with its KV written nowhere (slot -1), so nothing outside its allocation is touched."""
        rows = int(first.shape[0])
        bs = self.block_size
        dev = ids.device
        pos0 = positions.index_select(0, first)
        token = ids.index_select(0, first)
        last = (num_drafts - 1).clamp(min=0)
        qsl = torch.arange(rows + 1, dtype=torch.int64, device=dev)
        drafts: list[torch.Tensor] = []
        for j in range(max_drafts):
            pos = pos0 + torch.clamp(last, max=j)
            col = (pos // bs)[:, None]
            slots = block_tables.gather(1, col).view(-1) * bs + pos % bs
            slots = torch.where(num_drafts > j, slots, -1)
            seq_lens = pos + 1
            if dev.type == "cpu":  # the torch backend reads host copies; on CPU these are they
                seq_cpu = seq_lens.tolist()
                max_seq = max(seq_cpu)
            else:  # a bound (only the torch backend reads it)
                seq_cpu = [0] * rows
                max_seq = block_tables.shape[1] * bs
            meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
                                     block_tables=block_tables, max_query_len=1, max_seq_len=max_seq,
                                     query_start_loc_cpu=list(range(rows + 1)), seq_lens_cpu=seq_cpu)
            hidden = self.model(token, pos, self.caches, meta)
            token = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(token)
        # ids[first + 1 + j] = draft j for j < num_drafts; past that the first token again, in place.
        j = torch.arange(max_drafts, device=dev)
        valid = j[None, :] < num_drafts[:, None]
        at = torch.where(valid, first[:, None] + 1 + j[None, :], first[:, None])
        values = torch.where(valid, torch.stack(drafts, dim=1), ids.index_select(0, first)[:, None])
        ids.index_copy_(0, at.view(-1), values.view(-1))
