"""Speculative decoding mechanism on the GPU with a benchmark-only ORACLE proposer: random weights
never accept real drafts, so a first pass records the target's own greedy continuation, and the
oracle then proposes it with each draft token right with probability ``accept`` (wrong: the next
id; see ``OracleProposer``). Greedy verification must give the first pass's tokens again: checked
per case (``same_tokens``, ``first_diff``). Each case reports the measured acceptance next to the
nominal one (per token, and accepted drafts per verify row against the expected sum of accept^j).

Plain random weights (``load_format="dummy"``) are useless for that: their logits are nearly
tied, so the verify step (k + 1 rows a sequence: other GEMM shapes, other rounding) and the plain
decode step pick different argmaxes and the run drifts off the recording. ``make_chain_model``
therefore reshapes the random weights, with the same shapes and the same work per step, so that
the greedy continuation is well separated: the embedding is scaled up and every layer's output
projections (o_proj, down_proj) down, so the final hidden state is mostly the current token's
embedding; the LM head's row v is the embedding of token sigma(v) for a random permutation sigma.
The top logit (the token v with sigma(v) = current) is then ~|e|^2 against ~|e| for the rest, and
the continuation walks sigma's cycles: distinct tokens, not a repeated one. By construction the
next token depends on the current one only (attention still runs over the whole context, with
the same cost), so ``same_tokens`` checks the verify/accept/emit/rollback plumbing on real
shapes, not attention numerics (the tiny-model GPU tests do those).

  PYTHONPATH=engine python benchmarks/spec_decode_oracle.py --shape qwen3-8b --out r.json
Cases: single stream 128 -> 256 at k = 4, acceptance 1.0 / 0.5 / 0.0, and 64 x (256 -> 256) at 0.7;
each in two modes: drafts from the host with a synchronous engine (``single_k4_acc0``: a
draft model's mode, and every engine's before async speculation), and ``..._async``: drafts made
on the device with async scheduling (the engine's default for n-gram on a GPU; ``DeviceOracle``).
The baseline is the same engine without drafts and with async scheduling (the engine's default
on a GPU without speculation). Output tok/s, wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

EMBED_SCALE = 50.0  # embedding entries ~1 instead of ~0.02
LAYER_OUT_SCALE = 0.01  # each layer adds ~1% of the embedding's size to the residual stream
HEAD_SCALE = 0.02  # LM head rows: sigma's embeddings, scaled to logits of ~80 (top) vs ~1 (rest)


def make_chain_model(model: Any, seed: int = 0) -> None:
    """Reshape a dummy-weight model in place so its greedy continuation is well separated (see
    the module docstring). Same shapes, dtypes and addresses: CUDA graphs stay valid."""
    import torch

    params = dict(model.named_parameters())
    embed = next(p for n, p in params.items() if n.endswith("embed_tokens.weight"))
    head = next((p for n, p in params.items() if n.endswith("lm_head.weight")), None)
    if head is None or head.data_ptr() == embed.data_ptr():
        raise ValueError("the chain model needs an untied LM head")
    outputs = [p for n, p in params.items() if n.endswith(("o_proj.weight", "down_proj.weight"))]
    if len(outputs) != 2 * len(getattr(model, "layers", [])):
        raise ValueError(f"expected an o_proj and a down_proj weight per layer, found {len(outputs)}")
    with torch.no_grad():
        embed.mul_(EMBED_SCALE)
        for p in outputs:
            p.mul_(LAYER_OUT_SCALE)
        gen = torch.Generator(device=embed.device).manual_seed(seed)
        sigma = torch.randperm(embed.shape[0], generator=gen, device=embed.device)
        head.copy_(embed.index_select(0, sigma) * HEAD_SCALE)


GOLDEN = 0.6180339887498949  # the golden ratio's fractional part: the most even additive sequence


def expected_accepted_per_row(accept: float, k: int) -> float:
    """Expected leading-run length of k drafts, each right with probability ``accept``
    independently: sum over j = 1..k of accept^j (0.94 at 0.5, 1.77 at 0.7 for k = 4)."""
    return sum(accept ** j for j in range(1, k + 1))


def leading_run(u: float, accept: float, cap: int) -> int:
    """How many leading drafts are right for a uniform ``u`` in [0, 1): the run is >= j exactly
    when u < accept^j, so P(run >= j) = accept^j, as for independent per-token coin flips."""
    run = 0
    while run < cap and u < accept ** (run + 1):
        run += 1
    return run


class OracleProposer:
    """Proposes the recorded greedy continuation; each draft token right with probability
    ``accept``, independently of the others (the verifier stops at the first wrong one).

    The leading run of right drafts of a proposal comes from one uniform number per proposal
    (``leading_run``; the tokens after the first wrong one are then independent coin flips, so the
    joint law is that of k independent flips), and those uniform numbers are a golden-ratio
    (Weyl) sequence from a seeded start rather than independent draws: each is uniform, and over
    the ~150 proposals of a 256-token run their run lengths match the stated distribution far
    closer than independent draws do. (The first version drew independent flips from seed 0,
    whose first ~620 numbers give 0.64 accepted drafts per row at 0.5 against the expected 0.94,
    a ~3-sigma draw, so its 50% case measured a lower acceptance than it stated.)

    A wrong draft is the right one's successor in the vocabulary (never the right token).
    ``intended_accepted`` counts the leading runs it proposed, to check the engine's count."""

    def __init__(self, k: int, recorded: dict[tuple[int, ...], list[int]], accept: float, vocab_size: int,
                 seed: int = 0) -> None:
        self.num_speculative_tokens = k
        self.vocab_size = vocab_size
        self.recorded = recorded  # prompt → its greedy output
        self.accept = accept
        self.rng = np.random.default_rng(seed)
        self._u = float(self.rng.random())  # the Weyl sequence's start
        # The flips after the first wrong draft (they never count): Python's generator costs
        # ~1 us a proposal where numpy's costs several, and the proposer's time is in the case's.
        self._flips = random.Random(seed)
        self.proposals = 0
        self.intended_accepted = 0
        self._by_request: dict[str, tuple[int, list[int]]] = {}  # request id → (prompt length, output)

    def release(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def _find(self, tokens: np.ndarray) -> tuple[int, list[int]] | None:
        for prompt, output in self.recorded.items():
            n = len(prompt)
            if len(tokens) >= n and tuple(tokens[:n].tolist()) == prompt:
                return n, output
        return None

    def _right(self, count: int) -> list[bool]:
        """Which of ``count`` drafts are right: a leading run from the Weyl sequence, then a wrong
        one, then independent flips (they never count: verification stops at the wrong one)."""
        self._u = (self._u + GOLDEN) % 1.0
        run = leading_run(self._u, self.accept, count)
        self.proposals += 1
        self.intended_accepted += run
        flip, accept = self._flips.random, self.accept
        tail = [flip() < accept for _ in range(count - run - 1)]
        return [True] * run + [False] * (run < count) + tail

    def propose(self, token_ids: list[np.ndarray], max_drafts: list[int],
                request_ids: list[str] | None = None) -> list[np.ndarray]:
        out = []
        for i, (tokens, cap) in enumerate(zip(token_ids, max_drafts)):
            rid = request_ids[i] if request_ids is not None else None
            found = self._by_request.get(rid) if rid is not None else None
            if found is None:
                found = self._find(tokens)
                if found is not None and rid is not None:
                    self._by_request[rid] = found
            drafts: list[int] = []
            if found is not None:
                n, output = found
                done = len(tokens) - n
                truth = output[done : done + min(cap, self.num_speculative_tokens)]
                if truth:
                    drafts = [t if ok else (t + 1) % self.vocab_size for t, ok in zip(truth, self._right(len(truth)))]
            out.append(np.asarray(drafts, dtype=np.int64))
        return out


class DeviceOracle:
    """The oracle on the device (async scheduling: the drafts of step N+1 are made right after
    step N on the device, spec_decode/device_drafts.py): each row's recorded sequence is found
    by its prompt, the drafts are its next k recorded tokens, and each proposal's leading run of
    right drafts comes from the same Weyl sequence as ``OracleProposer`` (precomputed, consumed
    in order by a device counter); the drafts after the run are wrong (the next id)."""

    def __init__(self, k: int, recorded: dict[tuple[int, ...], list[int]], accept: float, vocab_size: int,
                 device: Any, seed: int = 0, num_runs: int = 1 << 16) -> None:
        import torch

        self.num_speculative_tokens = k
        prompts = list(recorded)
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("the device oracle wants prompts of one length")
        self.prompt_len = len(prompts[0])
        width = max(len(p) + len(o) for p, o in recorded.items()) + k + 1
        seqs = torch.zeros((len(prompts), width), dtype=torch.int64)
        for i, p in enumerate(prompts):
            full = list(p) + list(recorded[p])
            seqs[i, : len(full)] = torch.tensor(full)
        self.prompts = torch.tensor(prompts, dtype=torch.int64, device=device)
        self.seqs = seqs.to(device)
        u = float(np.random.default_rng(seed).random())
        runs = []
        for _ in range(num_runs):
            u = (u + GOLDEN) % 1.0
            runs.append(leading_run(u, accept, k))
        self.runs = torch.tensor(runs, dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.vocab_size = vocab_size

    def propose_on_device(self, tokens: Any, lens: Any, rows: Any) -> Any:
        import torch

        b, k, p = tokens.shape[0], self.num_speculative_tokens, self.prompt_len
        head = tokens[:, :p] if tokens.shape[1] >= p else torch.nn.functional.pad(tokens, (0, p - tokens.shape[1]))
        which = (head[:, None, :] == self.prompts[None]).all(dim=2).long().argmax(dim=1)
        j = torch.arange(k, device=tokens.device)
        at = (lens[:, None] + j[None, :]).clamp(max=self.seqs.shape[1] - 1)
        truth = self.seqs.index_select(0, which).gather(1, at)
        run = self.runs[(self.counter + torch.arange(b, device=tokens.device)) % self.runs.shape[0]]
        self.counter += b
        return torch.where(j[None, :] < run[:, None], truth, (truth + 1) % self.vocab_size)


class StepTimer:
    """GPU time per step, from CUDA events recorded around each ``runner.execute`` call (no
    synchronisation until ``finish``). The start event runs when the stream reaches it: right
    away in a synchronous step, after the previous step's work with async scheduling, so in
    both cases end - start is this step's device time (launch gaps inside it included). Wall
    time per step minus it is the host time that the device waited for."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.pairs: list[tuple[Any, Any]] = []
        self.steps = 0
        self._execute = runner.execute

    def __enter__(self) -> "StepTimer":
        import torch

        cuda = torch.cuda.is_available()

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.steps += 1
            if not cuda:
                return self._execute(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self._execute(*args, **kwargs)
            end.record()
            self.pairs.append((start, end))
            return out

        self.runner.execute = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        if "execute" in vars(self.runner):
            del self.runner.execute

    def ms_per_step(self) -> float | None:
        if not self.pairs:
            return None
        self.pairs[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs) / len(self.pairs)


def _first_diff(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first output index where any request differs (None: identical)."""
    diffs = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None if len(p) == len(q) else min(len(p), len(q)))
             for p, q in zip(a, b)]
    found = [d for d in diffs if d is not None]
    return min(found) if found else None


def use_engine_mode(llm: Any, proposer: Any, device_proposer: Any) -> None:
    """No speculation (both None: async scheduling, the GPU default), speculation with drafts
    from the host (a synchronous engine), or with drafts made on the device (async scheduling)."""
    from tidal_engine.spec_decode.device_drafts import DeviceDrafts

    core, runner = llm.engine.core, llm.engine.runner
    core.proposer = proposer
    core.device_drafts = device_proposer is not None
    core.async_scheduling = proposer is None or device_proposer is not None
    runner.batch.device_drafts = None if device_proposer is None else \
        DeviceDrafts(device_proposer, runner.batch.capacity + 1, runner.max_model_len, runner.device)


def run_case(llm: Any, prompts: list[list[int]], max_tokens: int, k: int, accept: float,
             on_device: bool = False) -> dict[str, Any]:
    from tidal_engine import SamplingParams

    core = llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    use_engine_mode(llm, None, None)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm
    start = time.perf_counter()
    with StepTimer(llm.engine.runner) as base_timer:
        base = llm.generate(prompts, params)
    base_s = time.perf_counter() - start
    recorded = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, base)}
    oracle = OracleProposer(k, recorded, accept, core.vocab_size)
    device_oracle = DeviceOracle(k, recorded, accept, core.vocab_size, llm.engine.runner.device) if on_device else None
    use_engine_mode(llm, oracle, device_oracle)
    before = llm.engine.get_stats()
    runner = llm.engine.runner
    replays = runner.verify_graphs.num_replays if runner.verify_graphs is not None else None
    start = time.perf_counter()
    with StepTimer(runner) as spec_timer:
        spec = llm.generate(prompts, params)
    spec_s = time.perf_counter() - start
    after = llm.engine.get_stats()
    use_engine_mode(llm, None, None)
    base_ids = [o.outputs[0].token_ids for o in base]
    spec_ids = [o.outputs[0].token_ids for o in spec]
    tokens = sum(len(t) for t in spec_ids)
    drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    verify_steps = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    per_pos = [a - b for a, b in zip(after.spec_decode_num_accepted_tokens_per_pos,
                                     before.spec_decode_num_accepted_tokens_per_pos + [0] * k)]
    return {"accept_target": accept, "k": k, "requests": len(prompts), "max_tokens": max_tokens,
            "drafts_on_device": on_device, "async_scheduling": on_device,
            "same_tokens": spec_ids == base_ids, "first_diff": _first_diff(base_ids, spec_ids),
            "distinct_tokens_first_request": len(set(base_ids[0])),
            "baseline_s": base_s, "spec_s": spec_s, "baseline_tok_s": tokens / base_s, "spec_tok_s": tokens / spec_s,
            "speedup": base_s / spec_s, "verify_rows": verify_steps, "draft_tokens": drafts,
            "accepted_tokens": accepted, "acceptance": accepted / max(1, drafts),
            "accepted_per_pos": per_pos,
            "per_token_acceptance_measured": per_token_acceptance(per_pos, verify_steps),
            "accepted_per_verify_row_expected": expected_accepted_per_row(accept, k),
            "accepted_per_verify_row_measured": accepted / max(1, verify_steps),
            "oracle_proposals": oracle.proposals, "oracle_intended_accepted": oracle.intended_accepted,
            "tokens_per_verify_row": (accepted + verify_steps) / max(1, verify_steps),
            "verify_graph_replays": None if replays is None else runner.verify_graphs.num_replays - replays,
            "baseline_steps": base_timer.steps, "spec_steps": spec_timer.steps,
            "baseline_wall_ms_per_step": 1e3 * base_s / max(1, base_timer.steps),
            "spec_wall_ms_per_step": 1e3 * spec_s / max(1, spec_timer.steps),
            "baseline_gpu_ms_per_step": base_timer.ms_per_step(), "spec_gpu_ms_per_step": spec_timer.ms_per_step()}


def per_token_acceptance(accepted_per_pos: list[int], verify_rows: int) -> float:
    """The measured per-token rate: accepted drafts over drafts that were reached (position 0 of
    every verify row, position j of the rows that accepted j drafts). Slightly low when rows near
    ``max_tokens`` had fewer than k drafts and accepted them all (then counted as reaching one more)."""
    reached = verify_rows + sum(accepted_per_pos[:-1])
    return sum(accepted_per_pos) / max(1, reached)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    ap.add_argument("--cases", default="single_k4_acc100,single_k4_acc50,single_k4_acc0,batch64_k4_acc70")
    args = ap.parse_args()
    import logging

    # The start-up choice of one-row and few-row GEMVs per weight shape, with its timings.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("tidal_engine.kernels.gemv_choice").setLevel(logging.INFO)
    logging.getLogger("tidal_engine.runner.model_runner").setLevel(logging.INFO)
    from gpu_bench import make_config_folder

    from tidal_engine import LLM

    folder = make_config_folder(args.shape, Path(args.models))
    spec = {"method": "ngram", "num_speculative_tokens": args.k}  # turns the verifier on; the oracle replaces ngram
    results: dict[str, Any] = {"command": " ".join(sys.argv), "commit": os.environ.get("TIDAL_COMMIT"),
                               "date": os.environ.get("TIDAL_BENCH_DATE"), "shape": args.shape,
                               "weights": {"embed_scale": EMBED_SCALE, "layer_out_scale": LAYER_OUT_SCALE,
                                           "head_scale": HEAD_SCALE}, "cases": {}}

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=1))

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=64,
              speculative_config=spec)
    make_chain_model(llm.engine.runner.model)
    import torch

    results["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results["torch"] = torch.__version__
    results["llm_construct_s"] = time.perf_counter() - t0
    vocab = llm.engine.core.vocab_size
    single = [rng.integers(100, vocab - 100, 128).tolist()]
    batch = [rng.integers(100, vocab - 100, 256).tolist() for _ in range(64)]
    t0 = time.perf_counter()
    run_case(llm, single, 32, args.k, 0.5)  # warm-up, discarded
    run_case(llm, single, 32, args.k, 0.5, True)
    results["warm_up_s"] = time.perf_counter() - t0
    wanted = set(args.cases.split(","))
    for name, prompts, max_tokens, accept in (("single_k4_acc100", single, 256, 1.0),
                                              ("single_k4_acc50", single, 256, 0.5),
                                              ("single_k4_acc0", single, 256, 0.0),
                                              ("batch64_k4_acc70", batch, 256, 0.7)):
        for mode in ("", "_async"):  # drafts from the host (synchronous) / on the device (async)
            if name + mode not in wanted:
                continue
            try:
                results["cases"][name + mode] = run_case(llm, prompts, max_tokens, args.k, accept, bool(mode))
            except Exception as exc:  # noqa: BLE001 - recorded, the other cases still run
                results["cases"][name + mode] = {"error": repr(exc)[:2000]}
            save()
            print(name + mode, json.dumps(results["cases"][name + mode]), flush=True)


if __name__ == "__main__":
    main()
