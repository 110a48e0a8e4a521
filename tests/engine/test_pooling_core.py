"""Pooling requests in the engine core: the shared scheduler's rules for them, the one-step-in-
flight loop, and the queue gauges the autoscaler reads."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_pooling_models import make_bert_cross_encoder  # noqa: E402

from tidal_engine.core.kv_cache_manager import KVCacheManager  # noqa: E402
from tidal_engine.core.request import Request, RequestStatus  # noqa: E402
from tidal_engine.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from tidal_engine.engine.async_engine import EngineSnapshot  # noqa: E402
from tidal_engine.pooling.core import PoolingEngineCore  # noqa: E402
from tidal_engine.pooling.params import PoolingParams  # noqa: E402
from tidal_engine.pooling.runner import PoolingInput  # noqa: E402
from tidal_engine.server.pooling_metrics import PoolingMetrics  # noqa: E402


def pooling_request(request_id: str, length: int) -> Request:
    return Request(request_id, list(range(1, length + 1)), pooling_params=PoolingParams())


def test_scheduler_admits_pooling_prompts_whole_without_blocks() -> None:
    # Chunked prefill is on, yet a pooling prompt is never split: it waits for a step it fits.
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=12, max_model_len=12, block_size=4)
    scheduler = Scheduler(config, KVCacheManager(num_blocks=3, block_size=4))
    for request_id, length in (("a", 5), ("b", 5), ("c", 5), ("d", 12)):
        scheduler.add_request(pooling_request(request_id, length))

    first = scheduler.schedule()
    assert [(c.request.request_id, c.num_new_tokens, c.block_ids, c.samples) for c in first.chunks] == [
        ("a", 5, [], False), ("b", 5, [], False)]
    assert scheduler.kv_cache_manager.num_free_blocks == 3  # no KV for a pooling forward
    scheduler.update_from_output(first, {})
    second = scheduler.schedule()  # a and b (computed, not yet finished) take no tokens
    assert [c.request.request_id for c in second.chunks] == ["c"]  # d (12) does not fit the 7 left
    scheduler.update_from_output(second, {})
    for request_id in ("a", "b", "c"):
        scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
    assert [(c.request.request_id, c.num_new_tokens) for c in scheduler.schedule().chunks] == [("d", 12)]


def test_generation_and_pooling_share_the_budget() -> None:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=16, block_size=4)
    scheduler = Scheduler(config, KVCacheManager(num_blocks=8, block_size=4))
    scheduler.add_request(Request("chat", list(range(1, 11))))
    scheduler.add_request(pooling_request("embed", 8))
    out = scheduler.schedule()
    assert [(c.request.request_id, c.num_new_tokens, len(c.block_ids)) for c in out.chunks] == [("chat", 10, 3)]
    scheduler.update_from_output(out, {"chat": 7})
    # The chat decode takes 1 token; the 8-token pooling prompt fits the 15 left, whole.
    assert [(c.request.request_id, c.num_new_tokens) for c in scheduler.schedule().chunks] == [("chat", 1), ("embed", 8)]


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> PoolingEngineCore:
    folder = tmp_path_factory.mktemp("cross-encoder")
    make_bert_cross_encoder(folder)
    return PoolingEngineCore.from_model(str(folder), "reranker", device="cpu", max_num_seqs=2)


def test_one_step_in_flight_and_the_queue_gauges_autoscaling_reads(core: PoolingEngineCore) -> None:
    from tidal_operator.api.types import AutoscalingSpec
    from tidal_operator.engine_client import EngineMetrics
    from tidal_operator.scaling.decide import Reading, metric_value, replicas_needed

    def scrape() -> EngineMetrics:
        client = SimpleNamespace(snapshot=EngineSnapshot(stats=core.get_stats()))
        return EngineMetrics.parse(PoolingMetrics(client, "reranker").render().decode())  # type: ignore[arg-type]

    expected = core.encode_offline([PoolingInput([101, 7, 8, 102])])[0]
    for i in range(5):
        core.add_pooling_request(f"r{i}", [101, 7, 8, 102], PoolingParams())
    assert (scrape().running, scrape().waiting) == (0, 5)
    assert core.step() == []  # r0, r1 launched; nothing collected yet
    assert (scrape().running, scrape().waiting) == (2, 3)
    spec = AutoscalingSpec(max_replicas=4, metric="requestsInFlight", target=2)
    assert replicas_needed(Reading(0.0, {"pod": metric_value(scrape(), "requestsInFlight")}), spec) == 3

    done = core.step()  # r2, r3 launched, r0, r1 back: the step in flight holds no scheduler slot
    assert [o.request_id for o in done] == ["r0", "r1"] and core.get_stats().num_running == 2
    core.abort_request("r2")  # in flight: its result is dropped
    outputs = done + core.step() + core.step()
    assert [o.request_id for o in outputs] == ["r0", "r1", "r3", "r4"]
    assert not core.has_unfinished_requests() and (scrape().running, scrape().waiting) == (0, 0)
    for out in outputs:
        torch.testing.assert_close(torch.frombuffer(bytearray(out.data), dtype=torch.float32), expected)
    assert scrape().activity and core.get_stats().pooling_requests_total >= 4


def test_bad_pooling_input_is_a_value_error(core: PoolingEngineCore) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        core.add_pooling_request("empty", [], PoolingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        core.add_pooling_request("oov", [core.vocab_size], PoolingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_pooling_request("long", [1] * (core.max_model_len + 1), PoolingParams())
    with pytest.raises(ValueError, match="does not generate"):
        core.add_request("chat", [1, 2])


def test_the_client_fails_pooling_requests_the_core_ends(core: PoolingEngineCore) -> None:
    """Outputs, refusals and sleep-aborts from the core reach the API server's pending inputs."""
    import asyncio

    from tidal_engine.engine.async_engine import EngineSleepingError
    from tidal_engine.engine.core_proc import CoreAddresses, core_info
    from tidal_engine.engine.messages import EngineCoreOutputs, PooledOutput
    from tidal_engine.pooling.client import PoolingClient

    async def scenario() -> tuple[torch.Tensor, BaseException | None, BaseException | None]:
        client = PoolingClient(core.tokenizer, core_info(core), CoreAddresses("ipc://unused", ["ipc://unused"]))
        loop = asyncio.get_running_loop()
        done, refused, aborted = loop.create_future(), loop.create_future(), loop.create_future()
        client._pooled.update(done=done, refused=refused, aborted=aborted)
        client._handle(EngineCoreOutputs(
            pooled=[PooledOutput("done", torch.tensor([0.6, 0.8]).numpy().tobytes())],
            rejected={"refused": ("ValueError", "token ids must be in [0, 10)", 400)}, aborted=["aborted"]))
        return done.result(), refused.exception(), aborted.exception()

    vector, refused, aborted = asyncio.run(scenario())
    assert vector.tolist() == pytest.approx([0.6, 0.8])
    assert isinstance(refused, ValueError) and "token ids" in str(refused)
    assert isinstance(aborted, EngineSleepingError)  # the server answers 503 with Retry-After
