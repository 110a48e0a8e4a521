"""n-gram speculation on the real SmolLM2-135M asked to repeat a committed passage: the same greedy
text as without speculation, and most drafts accepted. (Speed is measured in
benchmarks/spec_decode_copy.py, never asserted here.)"""

from __future__ import annotations

import os

import pytest
import torch

from tidal_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PASSAGE = ("The tide comes in twice a day. Fishermen wait on the harbour wall, mending nets and watching "
           "the water rise over the mud flats. When the boats float, they leave together, and the village is "
           "quiet until evening, when the catch is sold on the quay.")
COPY_PROMPT = f"Repeat the following passage exactly.\n\nPassage: {PASSAGE}\n\nRepeated passage: {PASSAGE[:20]}"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_ngram_copy_task_accepts_most_drafts_with_identical_text() -> None:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    params = SamplingParams(temperature=0.0, max_tokens=32)
    llm = LLM("smollm2-135m", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
              speculative_config=NGRAM)
    core = llm.engine.core
    proposer, core.proposer = core.proposer, None  # one load: the same engine without drafts first
    plain = llm.generate([COPY_PROMPT], params)[0].outputs[0]
    core.proposer = proposer
    ngram = llm.generate([COPY_PROMPT], params)[0].outputs[0]
    stats = llm.engine.get_stats()
    assert ngram.token_ids == plain.token_ids
    assert "Fishermen wait on the harbour wall" in ngram.text  # it does copy
    assert stats.spec_decode_num_draft_tokens >= 20
    assert stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens > 0.5
