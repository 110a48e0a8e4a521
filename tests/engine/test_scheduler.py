"""Scheduler, driven by a fake model that reads its inputs back through the block tables.

The fake model writes each scheduled token into a paged "KV cache" (one list per block) at the
slot the block table gives, then, for sampling chunks, reads the whole sequence back through
the block table. It asserts what it reads equals the request's tokens and derives the next
token from what it read, so a wrong block table, a bad prefix hit or a block reused while still
referenced changes the generated text.
"""

from __future__ import annotations

import random

import pytest

from tidal_engine.core.kv_cache_manager import KVCacheManager
from tidal_engine.core.request import Request, RequestStatus
from tidal_engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tidal_engine.sampling_params import SamplingParams

BS = 16


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) + 7 * len(tokens)) % 1000


class FakeModel:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        for chunk in output.chunks:  # write all KV first, like one forward pass
            req = chunk.request
            assert len(chunk.block_ids) * self.block_size >= chunk.start + chunk.num_new_tokens
            for pos in range(chunk.start, chunk.start + chunk.num_new_tokens):
                block, offset = self._slot(chunk.block_ids, pos)
                self.kv[block][offset] = req.all_token_ids[pos]
        sampled: dict[str, int] = {}
        for chunk in output.chunks:
            if chunk.samples:
                end = chunk.start + chunk.num_new_tokens
                seen = [self.kv[b][o] for b, o in (self._slot(chunk.block_ids, p) for p in range(end))]
                assert seen == chunk.request.all_token_ids[:end], f"corrupt KV for {chunk.request}"
                sampled[chunk.request.request_id] = next_token(seen)  # type: ignore[arg-type]
        return sampled


def check_output(config: SchedulerConfig, output: SchedulerOutput) -> None:
    assert output.num_batched_tokens == sum(c.num_new_tokens for c in output.chunks)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.chunks) <= config.max_num_seqs
    assert len({c.request.request_id for c in output.chunks}) == len(output.chunks)
    for chunk in output.chunks:
        assert chunk.num_new_tokens >= 1
        assert chunk.start + chunk.num_new_tokens <= chunk.request.num_tokens
        assert chunk.samples == (chunk.start + chunk.num_new_tokens == chunk.request.num_tokens)
        if not config.enable_chunked_prefill:
            assert chunk.samples


class Harness:
    def __init__(self, num_blocks: int, **config: object) -> None:
        params: dict[str, object] = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=BS)
        params.update(config)
        self.config = SchedulerConfig(**params)  # type: ignore[arg-type]
        self.kv = KVCacheManager(num_blocks, self.config.block_size, enable_prefix_caching=True)
        self.scheduler = Scheduler(self.config, self.kv)
        self.model = FakeModel(num_blocks, self.config.block_size)
        self.steps = 0

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8, **kwargs: object) -> Request:
        req = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), **kwargs)  # type: ignore[arg-type]
        self.scheduler.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        check_output(self.config, output)
        sampled = self.model.execute(output)
        got = self.scheduler.update_from_output(output, sampled)
        for req in got:  # the engine's length check
            if req.num_output_tokens >= (req.sampling_params.max_tokens or 0) or req.num_tokens >= self.config.max_model_len:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
        self.steps += 1
        return output

    def run(self, max_steps: int = 5000) -> None:
        while self.scheduler.has_unfinished_requests():
            self.step()
            assert self.steps < max_steps, "scheduler made no progress"


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def test_single_request_matches_reference() -> None:
    h = Harness(num_blocks=32)
    req = h.add("a", list(range(1, 41)), max_tokens=20)
    h.run()
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == reference_output(list(range(1, 41)), 20)
    assert h.kv.num_free_blocks == 32


def test_budgets_respected_under_mixed_load() -> None:
    rng = random.Random(0)
    h = Harness(num_blocks=64, max_num_seqs=5, max_num_batched_tokens=48, max_model_len=200)
    reqs = []
    for i in range(30):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 120))]
        reqs.append((h.add(f"r{i}", prompt, max_tokens=rng.randrange(1, 30)), prompt))
    h.run()  # check_output asserts the budgets every step
    for req, prompt in reqs:
        assert req.output_token_ids == reference_output(prompt, req.sampling_params.max_tokens or 0)
    assert h.kv.num_free_blocks == 64 and h.kv.usage == 0.0


def test_chunked_prefill_does_not_stall_decodes() -> None:
    h = Harness(num_blocks=64, max_num_batched_tokens=32)
    decode = h.add("decode", [5, 6, 7], max_tokens=50)
    h.step()  # prefill of the short prompt; it is decoding from now on
    assert decode.num_output_tokens == 1
    long_prompt = list(range(100))
    long = h.add("long", long_prompt, max_tokens=3)
    chunk_sizes = []
    while long.num_output_tokens == 0:
        before = decode.num_output_tokens
        out = h.step()
        by_id = {c.request.request_id: c for c in out.chunks}
        assert by_id["decode"].num_new_tokens == 1 and by_id["decode"].samples
        assert decode.num_output_tokens == before + 1  # a token every step
        chunk_sizes.append(by_id["long"].num_new_tokens)
        assert out.num_batched_tokens <= 32
    assert chunk_sizes == [31, 31, 31, 7]
    h.run()
    assert long.output_token_ids == reference_output(long_prompt, 3)
    assert decode.output_token_ids == reference_output([5, 6, 7], 50)


def test_without_chunked_prefill_prompt_waits_for_budget() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, enable_chunked_prefill=False)
    h = Harness(num_blocks=64, max_num_batched_tokens=128, max_model_len=128, enable_chunked_prefill=False)
    a = h.add("a", list(range(100)), max_tokens=4)
    b = h.add("b", list(range(500, 550)), max_tokens=4)  # 100 + 50 > 128: waits a step
    out = h.step()
    assert [c.request.request_id for c in out.chunks] == ["a"]
    out = h.step()
    assert {c.request.request_id: c.num_new_tokens for c in out.chunks} == {"a": 1, "b": 50}
    h.run()
    assert a.output_token_ids == reference_output(list(range(100)), 4)
    assert b.output_token_ids == reference_output(list(range(500, 550)), 4)


def test_prefix_cache_hit_on_shared_prefix() -> None:
    h = Harness(num_blocks=64, max_num_batched_tokens=256)
    prefix = [(i * 37) % 1000 for i in range(200)]
    first = h.add("first", prefix + [1, 2, 3], max_tokens=2)
    h.run()
    assert first.num_cached_tokens == 0
    second = h.add("second", prefix + [9, 9], max_tokens=2)
    out = h.step()
    assert second.num_cached_tokens == 192  # 200 shared tokens: 12 full blocks of 16
    assert out.chunks[0].num_new_tokens == 202 - 192
    h.run()
    assert second.output_token_ids == reference_output(prefix + [9, 9], 2)
    stats = h.kv.prefix_cache_stats
    assert (stats.queries, stats.hits) == (203 + 202, 192)


@pytest.mark.parametrize(
    ("first_kwargs", "second_kwargs"),
    [
        ({"cache_salt": "alice"}, {"cache_salt": "bob"}),
        ({"cache_salt": "alice"}, {}),
        ({"lora_name": "sql"}, {"lora_name": "chat"}),
        ({}, {"lora_name": "chat"}),
    ],
)
def test_no_hits_across_salts_and_adapters(first_kwargs: dict[str, str], second_kwargs: dict[str, str]) -> None:
    h = Harness(num_blocks=64, max_num_batched_tokens=256)
    prefix = list(range(200))
    h.add("first", prefix + [1], **first_kwargs)
    h.run()
    second = h.add("second", prefix + [2], **second_kwargs)
    h.run()
    assert second.num_cached_tokens == 0
    assert h.kv.prefix_cache_stats.hits == 0
    # The same salt / adapter does hit.
    third = h.add("third", prefix + [3], **first_kwargs)
    h.run()
    assert third.num_cached_tokens == 192


def _run_workload(num_blocks: int, budget: int = 64) -> tuple[dict[str, list[int]], Harness]:
    rng = random.Random(1)
    h = Harness(num_blocks=num_blocks, max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=128)
    shared = [rng.randrange(1000) for _ in range(24)]
    reqs = []
    for i in range(16):
        prompt = (shared if i % 2 else []) + [rng.randrange(1000) for _ in range(rng.randrange(5, 60))]
        reqs.append(h.add(f"r{i}", prompt, max_tokens=rng.randrange(10, 40), arrival_time=float(i)))
    h.run()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert h.kv.num_free_blocks == num_blocks
    return {r.request_id: r.output_token_ids for r in reqs}, h


def test_preemption_gives_identical_outputs() -> None:
    big_outputs, big = _run_workload(num_blocks=256)
    assert big.scheduler.num_preemptions == 0
    small_outputs, small = _run_workload(num_blocks=8)  # 128 tokens: one max_model_len sequence
    assert small.scheduler.num_preemptions > 0
    assert small_outputs == big_outputs


def test_preempts_newest_and_requeues_at_front() -> None:
    # 4 blocks of 4 tokens; three requests of 5 tokens take 2 blocks each once decoding.
    h = Harness(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=16)
    old = h.add("old", [1, 2, 3, 4], max_tokens=10, arrival_time=1.0)
    new = h.add("new", [5, 6, 7, 8], max_tokens=10, arrival_time=2.0)
    h.step()  # both prefill: 1 block each
    h.step()  # both decode the 5th token: 2 blocks each, cache full
    late = h.add("late", [9, 9], max_tokens=2, arrival_time=3.0)
    for _ in range(3):
        h.step()  # positions 5..7 still fit the second blocks; "late" finds no free block
    assert late.status == RequestStatus.WAITING
    out = h.step()  # position 8 needs a third block for "old": the newest running one goes
    assert out.preempted == [new]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and h.scheduler.num_preemptions == 1
    assert list(h.scheduler.waiting)[:2] == [new, late]  # the victim goes first
    assert [c.request for c in out.chunks] == [old]
    h.run()
    assert old.output_token_ids == reference_output([1, 2, 3, 4], 10)
    assert new.output_token_ids == reference_output([5, 6, 7, 8], 10)
    assert late.output_token_ids == reference_output([9, 9], 2)


def test_a_held_request_is_never_preempted() -> None:
    # As above, but the newest request is held (pipeline parallelism: its batch is still in
    # flight, writing its blocks): the request that needs a block gives up its own instead.
    h = Harness(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=16)
    old = h.add("old", [1, 2, 3, 4], max_tokens=10, arrival_time=1.0)
    new = h.add("new", [5, 6, 7, 8], max_tokens=10, arrival_time=2.0)
    for _ in range(5):
        h.step()  # both decoding, 2 blocks each, cache full
    out = h.scheduler.schedule(hold={"new"})  # position 8 needs a third block for "old"
    assert out.preempted == [old] and not out.chunks
    assert new.status == RequestStatus.RUNNING and len(h.kv.get_block_ids("new")) == 2
    assert old.status == RequestStatus.PREEMPTED and old.num_computed_tokens == 0
    h.run()  # once nothing is held, both finish with the right tokens
    assert old.output_token_ids == reference_output([1, 2, 3, 4], 10)
    assert new.output_token_ids == reference_output([5, 6, 7, 8], 10)


def test_preempting_a_request_scheduled_earlier_in_the_step_refunds_its_tokens() -> None:
    # Decodes are scheduled before prefill chunks, so an older request's chunk can need the
    # blocks of a newer request that already got its decode token this step.
    h = Harness(num_blocks=4, block_size=4, max_num_batched_tokens=9, max_model_len=16)
    new = h.add("new", [1, 2], max_tokens=10, arrival_time=2.0)
    h.step()
    old_prompt = list(range(20, 34))  # 14 tokens
    old = h.add("old", old_prompt, max_tokens=2, arrival_time=1.0)
    out = h.step()  # new decodes, old gets 8 tokens (2 blocks); 1 block left
    assert {c.request.request_id: c.num_new_tokens for c in out.chunks} == {"new": 1, "old": 8}
    out = h.step()  # old's last 6 tokens need 2 more blocks: new is preempted, its decode undone
    assert out.preempted == [new]
    assert [(c.request, c.num_new_tokens) for c in out.chunks] == [(old, 6)]
    assert out.num_batched_tokens == 6
    h.run()
    assert old.output_token_ids == reference_output(old_prompt, 2)
    assert new.output_token_ids == reference_output([1, 2], 10)


def test_max_num_seqs() -> None:
    h = Harness(num_blocks=64, max_num_seqs=2)
    for i in range(5):
        h.add(f"r{i}", [i + 1] * 10, max_tokens=3)
    out = h.step()
    assert len(out.chunks) == 2 and h.scheduler.num_running == 2 and h.scheduler.num_waiting == 3
    h.run()


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding"])
def test_abort_frees_blocks(when: str) -> None:
    h = Harness(num_blocks=32, max_num_batched_tokens=32)
    h.add("other", list(range(10)), max_tokens=30)
    victim = h.add("victim", list(range(100, 180)), max_tokens=30)
    if when != "waiting":
        h.step()  # other: 10 tokens, victim: first 22
        assert victim.status == RequestStatus.RUNNING and victim.num_computed_tokens == 22
    if when == "decoding":
        while victim.num_output_tokens == 0:
            h.step()
    out = h.scheduler.schedule()
    aborted = h.scheduler.abort_request("victim")
    assert aborted is victim and victim.status == RequestStatus.FINISHED_ABORTED
    assert h.scheduler.abort_request("victim") is None  # idempotent
    # The output scheduled before the abort is still applied safely.
    h.scheduler.update_from_output(out, h.model.execute(out) if when == "waiting" else {})
    h.scheduler.abort_request("other")
    assert not h.scheduler.has_unfinished_requests()
    assert h.kv.num_free_blocks == 32 and h.kv.usage == 0.0
    assert h.scheduler.num_running == 0 and h.scheduler.num_waiting == 0


def test_n_samples_share_prompt_blocks() -> None:
    h = Harness(num_blocks=64, max_num_batched_tokens=256)
    prompt = list(range(50))
    first = h.add("s0", prompt, max_tokens=5)
    h.step()  # prompt computed and cached; now the siblings start
    siblings = [h.add(f"s{i}", prompt, max_tokens=5) for i in range(1, 4)]
    h.step()
    shared_block_ids = h.kv.get_block_ids("s0")[:3]
    for sib in siblings:
        assert sib.num_cached_tokens == 48
        assert h.kv.get_block_ids(sib.request_id)[:3] == shared_block_ids
    assert all(h.kv.block_pool.blocks[b].ref_count == 4 for b in shared_block_ids)
    h.run()
    assert all(s.output_token_ids == first.output_token_ids for s in siblings)
    assert h.kv.num_free_blocks == 64


def test_reset_prefix_cache_between_requests() -> None:
    h = Harness(num_blocks=64, max_num_batched_tokens=256)
    h.add("a", list(range(64)), max_tokens=2)
    h.run()
    assert h.kv.reset_prefix_cache() is True
    b = h.add("b", list(range(64)), max_tokens=2)
    h.run()
    assert b.num_cached_tokens == 0


def test_rejects_impossible_configs_and_requests() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, block_size=BS)
    with pytest.raises(ValueError):
        Scheduler(config, KVCacheManager(num_blocks=15, block_size=BS))  # 16 blocks needed
    with pytest.raises(ValueError):
        Scheduler(config, KVCacheManager(num_blocks=16, block_size=8))
    scheduler = Scheduler(config, KVCacheManager(num_blocks=16, block_size=BS))
    with pytest.raises(ValueError):
        scheduler.add_request(Request("long", list(range(257))))
    with pytest.raises(ValueError):
        scheduler.add_request(Request("empty", []))
    scheduler.add_request(Request("ok", [1]))
    with pytest.raises(ValueError):
        scheduler.add_request(Request("ok", [1]))
    with pytest.raises(ValueError):
        scheduler.finish_request("ok", RequestStatus.RUNNING)


def test_full_length_requests_do_not_deadlock() -> None:
    # The cache holds exactly one max_model_len sequence; several want all of it.
    h = Harness(num_blocks=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    reqs = [h.add(f"r{i}", [i + 1] * 30, max_tokens=40) for i in range(4)]
    h.run()
    for i, req in enumerate(reqs):
        assert req.num_tokens == 64  # finished by max_model_len
        assert req.output_token_ids == reference_output([i + 1] * 30, 34)
    assert h.kv.num_free_blocks == 4


def add_with_priority(h: Harness, request_id: str, prompt: list[int], priority: int, arrival: float,
                      max_tokens: int = 4) -> Request:
    req = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, priority=priority), arrival_time=arrival)
    h.scheduler.add_request(req)
    return req


def test_priority_policy_admits_lower_priority_values_first() -> None:
    h = Harness(num_blocks=32, max_num_seqs=1, policy="priority")
    first = add_with_priority(h, "first", [1, 2], priority=5, arrival=1.0)
    h.step()  # "first" runs; the others queue behind the one slot
    low = add_with_priority(h, "low", [3, 4], priority=9, arrival=2.0)
    urgent = add_with_priority(h, "urgent", [5, 6], priority=-1, arrival=3.0)
    same = add_with_priority(h, "same", [7, 8], priority=-1, arrival=4.0)
    assert list(h.scheduler.waiting) == [urgent, same, low]  # then arrival within a priority
    order: list[str] = []
    while h.scheduler.has_unfinished_requests():
        for chunk in h.step().chunks:
            if chunk.request.request_id not in order:
                order.append(chunk.request.request_id)
    assert order == ["first", "urgent", "same", "low"]
    assert low.output_token_ids == reference_output([3, 4], 4) and first.status == RequestStatus.FINISHED_LENGTH


def test_priority_policy_preempts_the_least_urgent() -> None:
    # As test_preempts_newest_and_requeues_at_front, but the older request is the less urgent one.
    h = Harness(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=16, policy="priority")
    relaxed = add_with_priority(h, "relaxed", [1, 2, 3, 4], priority=1, arrival=1.0, max_tokens=10)
    urgent = add_with_priority(h, "urgent", [5, 6, 7, 8], priority=0, arrival=2.0, max_tokens=10)
    preempted: list[Request] = []
    while not preempted:
        preempted = h.step().preempted
    assert preempted == [relaxed]
    h.run()
    assert urgent.output_token_ids == reference_output([5, 6, 7, 8], 10)
    assert relaxed.output_token_ids == reference_output([1, 2, 3, 4], 10)


def test_fcfs_ignores_priority_and_unknown_policies_are_refused() -> None:
    h = Harness(num_blocks=32, max_num_seqs=1)
    a = add_with_priority(h, "a", [1], priority=9, arrival=1.0)
    b = add_with_priority(h, "b", [2], priority=0, arrival=2.0)
    assert list(h.scheduler.waiting) == [a, b]
    with pytest.raises(ValueError, match="scheduling policy"):
        SchedulerConfig(policy="lifo")
