"""Draft-model proposer: a small model that shares the target's tokenizer guesses the next k
tokens greedily, for the whole batch at once.

Per step: one forward over each row's tokens the draft has not seen yet (its catch-up: the
tokens the target emitted since, or the whole prompt the first time), then k - 1 one-token
forwards, each taking the argmax of the last. Greedy drafts are deterministic, so the verifier
treats them as one-hot (spec_decode/rejection_sampler.py) and stays exact for sampled rows too.

The draft has its own KV cache in a separate block pool (spec_decode/draft_kv.py), in the
engine-core process on the engine's device; its rollback on rejection is a prefix match against
the real sequence. The model is loaded with the target's loader, so its path passes the same
checks (an existing HF folder or .gguf file, or a bundled alias).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tidal_engine.layers.attention import set_attention_backend
from tidal_engine.models.loader import load_model, resolve_model
from tidal_engine.runner.model_runner import choose_attention_backend, kv_cache_spec
from tidal_engine.spec_decode.draft_kv import DraftKVPool, DraftRow

DRAFT_KV_BYTES = 256 << 20  # the draft pool's ceiling; rows that find no room get no drafts that step


class DraftModelProposer:
    def __init__(self, model: str, num_speculative_tokens: int, *, target_vocab_size: int, target_tokenizer: Any,
                 dtype: torch.dtype, device: torch.device, block_size: int, max_num_seqs: int,
                 max_model_len: int, cache_dir: str | None = None) -> None:
        source = resolve_model(model, cache_dir)  # the target's own path/alias checks; its start-up cache
        vocab = source.arch_config.vocab_size
        if vocab != target_vocab_size:
            raise ValueError(f"the draft model {model!r} has {vocab} logits, the target {target_vocab_size}: "
                             "a draft model must share the target's tokenizer and vocabulary")
        if target_tokenizer is not None and source.load_tokenizer(cache_dir).get_vocab() != target_tokenizer.get_vocab():
            raise ValueError(f"the draft model {model!r} has a different tokenizer vocabulary from the target's: "
                             "a draft model must share the target's tokenizer")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_positions = source.arch_config.max_position_embeddings  # the draft's context may be shorter
        self.model = load_model(source, dtype, device)
        set_attention_backend(self.model, choose_attention_backend(device))
        spec = kv_cache_spec(self.model, block_size, dtype)
        per_seq = -(-(max_model_len + num_speculative_tokens) // block_size)
        num_blocks = min(max_num_seqs * per_seq + 1, max(DRAFT_KV_BYTES // spec.bytes_per_block, per_seq + 1))
        self.pool = DraftKVPool(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
                                dtype, device)

    def release(self, request_id: str) -> None:
        self.pool.release(request_id)

    @torch.inference_mode()
    def propose(self, token_ids: Sequence[np.ndarray], max_drafts: Sequence[int],
                request_ids: Sequence[str]) -> list[np.ndarray]:
        out = [np.zeros(0, dtype=np.int64) for _ in token_ids]
        rows: list[DraftRow] = []
        index: list[int] = []  # the batch position of each draft row
        caps: list[int] = []
        keep = set(request_ids)
        for i, (seq, cap, rid) in enumerate(zip(token_ids, max_drafts, request_ids)):
            cap = min(int(cap), self.num_speculative_tokens, self.max_positions + 1 - len(seq))
            if cap <= 0:
                continue
            state = self.pool.state(rid)
            start = state.rollback_to(seq)
            # KV for the catch-up tokens and for all drafts but the last (never fed).
            if not self.pool.reserve(rid, len(seq) + cap - 1, keep=keep):
                self.pool.release(rid)
                continue
            rows.append(DraftRow(state, [int(t) for t in seq[start:]], start))
            index.append(i)
            caps.append(cap)
        if not rows:
            return out
        drafts: list[list[int]] = [[] for _ in rows]
        for step in range(max(caps)):
            live = [j for j in range(len(rows)) if caps[j] > step]
            if step:  # feed each live row its latest draft
                for j in live:
                    row = rows[j]
                    rows[j] = DraftRow(row.state, [drafts[j][-1]], row.start + len(row.new_tokens))
            batch = [rows[j] for j in live]
            ids, positions, meta = self.pool.metadata(batch)
            hidden = self.model(ids, positions, self.pool.caches, meta)
            last = torch.tensor([meta.query_start_loc_cpu[n + 1] - 1 for n in range(len(batch))], device=hidden.device)
            next_ids = self.model.compute_logits(hidden.index_select(0, last)).argmax(dim=-1).tolist()
            for j, token in zip(live, next_ids):
                rows[j].state.tokens.extend(rows[j].new_tokens)
                drafts[j].append(int(token))
        for j, i in enumerate(index):
            out[i] = np.asarray(drafts[j], dtype=np.int64)
        return out
