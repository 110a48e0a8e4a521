"""The scheduler's side of the KV connector interface, with a fake connector (fake_connector.py).

A prompt is computed once (the connector saves its blocks), the device prefix cache is reset
(its blocks "evicted"), and the prompt comes again: the connector loads what the device lost.
The fake model reads every token back through the block tables, so a wrong load corrupts
the output; loads may be delayed or fail (then the request recomputes, nothing lost).
"""

from __future__ import annotations

from tidal_engine.core.kv_cache_manager import KVCacheManager
from tidal_engine.core.request import Request, RequestStatus
from tidal_engine.core.scheduler import Scheduler, SchedulerConfig
from tidal_engine.sampling_params import SamplingParams

from fake_connector import FakeConnector, FakeConnectorWorker
from test_scheduler import BS, FakeModel, check_output, reference_output


class ConnectorHarness:
    def __init__(self, num_blocks: int = 32, delay: int = 0, fail: bool = False, fuses_loads: bool = False,
                 **config: object) -> None:
        params: dict[str, object] = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=BS)
        params.update(config)
        self.config = SchedulerConfig(**params)  # type: ignore[arg-type]
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
        self.connector = FakeConnector(self.kv, BS)
        self.connector.fuses_loads = fuses_loads
        self.scheduler = Scheduler(self.config, self.kv, self.connector)
        self.model = FakeModel(num_blocks, BS)
        self.worker = FakeConnectorWorker(self.connector, self.model.kv, delay, lambda t: fail)

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 4, **kwargs: object) -> Request:
        req = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), **kwargs)  # type: ignore[arg-type]
        self.scheduler.add_request(req)
        return req

    def step(self) -> None:
        output = self.scheduler.schedule()
        check_output(self.config, output)
        if output.kv_transfer is not None:
            self.worker.start(output.kv_transfer)  # before the forward, as the worker does
        sampled = self.model.execute(output)
        for req in self.scheduler.update_from_output(output, sampled):
            if req.num_output_tokens >= (req.sampling_params.max_tokens or 0):
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
        self.scheduler.update_from_kv_transfer(self.worker.poll())

    def run(self) -> None:
        for _ in range(500):
            if not self.scheduler.has_unfinished_requests() and not self.scheduler.has_pending_transfers():
                return
            self.step()
        raise AssertionError("no progress")

    def evict_device_cache(self) -> None:
        self.kv.reset_prefix_cache()


PROMPT = [(7 * i + 3) % 1000 for i in range(70)]  # 4 full blocks + 6 tokens


def test_delayed_load_waits_in_its_own_state_and_resumes_at_the_loaded_position() -> None:
    h = ConnectorHarness(delay=3)
    h.add("first", PROMPT)
    h.run()
    assert len(h.connector.store) == 4  # the prompt's full blocks were saved
    h.evict_device_cache()
    computed_before = h.scheduler.num_prompt_tokens_computed
    again = h.add("again", PROMPT)
    other = h.add("other", [5, 6, 7], max_tokens=6)
    h.step()
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KV and again.request_id in h.scheduler.loading
    assert other.status == RequestStatus.RUNNING  # others run while the load is in flight
    assert h.scheduler.num_waiting == 1
    for _ in range(3):
        h.step()
        assert again.status in (RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.RUNNING)
    h.run()
    assert again.output_token_ids == reference_output(PROMPT, 4)
    assert again.num_cached_tokens == 64
    # Only the unaligned tail of "again" (70 - 64) and the 3 tokens of "other" were computed.
    assert h.scheduler.num_prompt_tokens_computed - computed_before == 6 + 3
    stats = h.scheduler.external_cache_stats
    assert (stats.queries, stats.hits) == (70 + 70 + 3, 64)
    assert h.kv.num_free_blocks == h.num_blocks  # every hold was released


def test_load_in_an_idle_step_computes_its_tail_in_that_step() -> None:
    h = ConnectorHarness(delay=3, fuses_loads=True)
    h.add("first", PROMPT)
    h.run()
    h.evict_device_cache()
    again = h.add("again", PROMPT)
    output = h.scheduler.schedule()
    assert again.status == RequestStatus.RUNNING and not h.scheduler.loading
    assert [(c.request, c.start, c.num_new_tokens) for c in output.chunks] == [(again, 64, 6)]
    assert output.kv_transfer is not None and output.kv_transfer.before_forward == [output.kv_transfer.loads[0].transfer_id]
    h.worker.start(output.kv_transfer)
    for req in h.scheduler.update_from_output(output, h.model.execute(output)):
        assert req is again and again.output_token_ids == reference_output(PROMPT, 1)
    h.scheduler.update_from_kv_transfer(h.worker.poll())
    h.run()
    assert again.output_token_ids == reference_output(PROMPT, 4)
    assert again.num_cached_tokens == 64
    assert h.kv.num_free_blocks == h.num_blocks


def test_load_waits_for_its_report_while_others_compute() -> None:
    h = ConnectorHarness(delay=2, fuses_loads=True)
    h.add("first", PROMPT)
    h.run()
    h.evict_device_cache()
    other = h.add("other", [5, 6, 7], max_tokens=8)
    h.step()
    again = h.add("again", PROMPT)
    h.step()
    assert other.status == RequestStatus.RUNNING  # it computes in this step: no fusing
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KV
    h.run()
    assert again.output_token_ids == reference_output(PROMPT, 4)
    assert other.output_token_ids == reference_output([5, 6, 7], 8)
    assert h.kv.num_free_blocks == h.num_blocks


def test_failed_load_recomputes_with_nothing_lost() -> None:
    h = ConnectorHarness(delay=1, fail=True)
    h.add("first", PROMPT)
    h.run()
    h.evict_device_cache()
    again = h.add("again", PROMPT)
    h.run()
    assert h.worker.started_loads == 1
    assert again.output_token_ids == reference_output(PROMPT, 4)
    assert again.num_cached_tokens == 0
    assert h.kv.num_free_blocks == h.num_blocks


def test_abort_during_load_keeps_blocks_held_until_the_report() -> None:
    h = ConnectorHarness(delay=2)
    h.add("first", PROMPT)
    h.run()
    h.evict_device_cache()
    again = h.add("again", PROMPT)
    h.step()  # the load starts
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KV
    h.scheduler.abort_request("again")
    assert again.request_id not in h.scheduler.loading
    assert h.kv.num_free_blocks == h.num_blocks - 4  # the load's 4 blocks are still being written
    h.run()
    assert h.kv.num_free_blocks == h.num_blocks
    # A later request reuses those blocks safely and still gets the right answer.
    late = h.add("late", PROMPT)
    h.run()
    assert late.output_token_ids == reference_output(PROMPT, 4)


def test_preempted_request_reloads_instead_of_recomputing() -> None:
    # 12 blocks: two requests growing to 7 blocks each cannot both fit; the newer is
    # preempted, its blocks were saved, so it comes back through a load.
    h = ConnectorHarness(num_blocks=12, max_num_batched_tokens=128, max_model_len=128)
    a = h.add("a", PROMPT[:60], max_tokens=40)
    b = h.add("b", [(11 * i + 1) % 1000 for i in range(60)], max_tokens=40)
    h.run()
    assert h.scheduler.num_preemptions >= 1
    assert h.worker.started_loads >= 1
    assert a.output_token_ids == reference_output(PROMPT[:60], 40)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 40)
    assert h.kv.num_free_blocks == 12


def test_salts_never_hit_each_others_blocks() -> None:
    h = ConnectorHarness()
    h.add("alice", PROMPT, cache_salt="alice")
    h.run()
    h.evict_device_cache()
    bob = h.add("bob", PROMPT, cache_salt="bob")
    h.run()
    assert h.worker.started_loads == 0 and bob.num_cached_tokens == 0
    assert bob.output_token_ids == reference_output(PROMPT, 4)
