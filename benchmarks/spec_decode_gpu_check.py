"""Is the GPU verify path exact? A tiny random Qwen3 in float32 (the CPU tests' model) on CUDA:
greedy outputs with n-gram speculation against the same engine without drafts, eager and with
CUDA graphs for the plain steps. Prints JSON. Needs transformers (to write the tiny model)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))


def main() -> None:
    from tiny_models import make_tiny_model
    from tiny_tokenizer import EOS_ID, SAMPLE_PROMPTS, save_byte_tokenizer

    from tidal_engine import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp())
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(folder, vocab_size=1000)
    prompts = [p * 3 for p in SAMPLE_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    out: dict[str, object] = {"commit": os.environ.get("TIDAL_COMMIT"), "date": os.environ.get("TIDAL_BENCH_DATE")}
    for dtype in ("float32", "bfloat16"):
        for eager in (True, False):
            llm = LLM(str(folder), dtype=dtype, device="cuda", max_model_len=256, enforce_eager=eager, gpu_memory_utilization=0.1,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
            core = llm.engine.core
            proposer, core.proposer = core.proposer, None
            base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            core.proposer = proposer
            spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            s = llm.engine.get_stats()
            first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(base, spec)]
            out[f"{dtype}_eager{eager}"] = {"same_tokens": base == spec, "first_diff": first_diff,
                                             "draft_tokens": s.spec_decode_num_draft_tokens,
                                             "accepted_tokens": s.spec_decode_num_accepted_tokens}
            llm.engine.core.shutdown()
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
