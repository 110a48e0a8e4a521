"""KV offload to host memory on the CPU backend: the runner's KV cache is the "device" pool and
the connector's host pool a separate tensor, so the tier logic runs for real here.

A prompt evicted from the small device pool comes back from the host pool: its outputs equal
those of an engine without offload, and only its unaligned tail is computed (counters).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal_engine import LLM, SamplingParams
from tidal_engine.kv_transfer.base import KVTransferPlan
from tidal_engine.kv_transfer.offload_worker import OffloadConnectorWorker

from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, save_byte_tokenizer

BLOCK_BYTES = 2 * 2 * 16 * 2 * 32 * 4  # K and V × layers × block × KV heads × head_dim × fp32
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-offload")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(folder, vocab_size=1000)
    return folder


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two adapters of other weights for the model (the same seeded model, rebuilt)."""
    from test_lora_support import make_peft_adapter  # peft: only this test needs it

    
    folder = tmp_path_factory.mktemp("offload-adapters")
    hf = make_tiny_model("qwen3", folder / "base", eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    for seed in (1, 2):
        make_peft_adapter(hf, folder / f"adapter-{seed}", rank=4, alpha=8, seed=seed, std=0.3)
    return folder


def prompt(seed: int, length: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50, 1000) for _ in range(length)]


def make_llm(folder: Path, host_blocks: int | None = 64, device_blocks: int = 10, **options: Any) -> LLM:
    defaults: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=128, num_gpu_blocks_override=device_blocks)
    if host_blocks is not None:
        defaults["kv_offloading_size"] = host_blocks * BLOCK_BYTES / 2**30
    defaults.update(options)
    return LLM(str(folder), **defaults)


def tokens(llm: LLM, prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, **kwargs)]


_REFERENCE: dict[Path, LLM] = {}


def reference_llm(model_dir: Path) -> LLM:
    """No offload and a device pool that never evicts."""
    if model_dir not in _REFERENCE:
        _REFERENCE[model_dir] = make_llm(model_dir, host_blocks=None, device_blocks=64)
    return _REFERENCE[model_dir]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[int, list[int]]:
    llm = reference_llm(model_dir)
    seeds = list(range(8))
    return dict(zip(seeds, tokens(llm, [prompt(s) for s in seeds])))


@pytest.mark.parametrize("save", ["write-through", "eviction"])
def test_prefix_evicted_from_device_is_served_from_host(model_dir: Path, reference: dict[int, list[int]],
                                                        save: str) -> None:
    llm = make_llm(model_dir, kv_offloading_save=save)
    engine = llm.engine
    assert tokens(llm, [prompt(0)]) == [reference[0]]
    for seed in (1, 2, 3):  # fill the 10-block device pool with other prompts: prompt 0 is evicted there
        assert tokens(llm, [prompt(seed)]) == [reference[seed]]
    before = engine.get_stats()
    assert tokens(llm, [prompt(0)]) == [reference[0]]
    after = engine.get_stats()
    assert after.prefix_cache_hits == before.prefix_cache_hits  # nothing left on the device
    assert after.external_prefix_cache_hits - before.external_prefix_cache_hits == 96  # 6 full blocks
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == 4  # only the unaligned tail
    assert after.kv_offload_bytes_loaded - before.kv_offload_bytes_loaded == 6 * BLOCK_BYTES
    if save == "write-through":
        assert after.kv_offload_bytes_saved >= 4 * 6 * BLOCK_BYTES  # every prompt's full blocks
    else:  # only blocks the device pool reused: prompt 0's, not all of the last prompt's
        assert 6 * BLOCK_BYTES <= after.kv_offload_bytes_saved < 4 * 6 * BLOCK_BYTES


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_concurrent_loads_preemption_and_aborts(model_dir: Path, reference: dict[int, list[int]],
                                                async_scheduling: bool) -> None:
    # 8 device blocks: prompts of 3 blocks growing to 5 preempt each other, and come back
    # through host loads while others compute.
    llm = make_llm(model_dir, device_blocks=8, async_scheduling=async_scheduling)
    long = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)
    short = [prompt(s, 40) for s in range(4)]
    expected = [o.outputs[0].token_ids for o in reference_llm(model_dir).generate(short, long)]
    assert [o.outputs[0].token_ids for o in llm.generate(short, long)] == expected
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.external_prefix_cache_hits > 0
    # Aborts while loads are in flight: nothing leaks, later requests are still right.
    engine = llm.engine
    seeds = [0, 1, 2, 3]
    assert tokens(llm, [prompt(s) for s in seeds]) == [reference[s] for s in seeds]  # now in the host pool
    for s in seeds[:4]:
        engine.add_request(f"abort-{s}", prompt(s), GREEDY)
    engine.step()
    for s in seeds[:4]:
        engine.abort_request(f"abort-{s}")
    assert tokens(llm, [prompt(5)]) == [reference[5]]
    engine.core.settle()
    engine.core.finish_kv_transfers()
    assert engine.kv_cache_manager.num_free_blocks == 8


def test_salts_never_hit_across_tenants_in_the_host_tier(model_dir: Path, reference: dict[int, list[int]]) -> None:
    llm = make_llm(model_dir)
    assert tokens(llm, [prompt(0)], cache_salt="alice") == [reference[0]]
    llm.engine.core.kv_cache_manager.reset_prefix_cache()  # the device tier forgets; the host tier keeps it
    before = llm.engine.get_stats()
    assert tokens(llm, [prompt(0)], cache_salt="bob") == [reference[0]]
    mid = llm.engine.get_stats()
    assert mid.external_prefix_cache_hits == before.external_prefix_cache_hits
    llm.engine.core.kv_cache_manager.reset_prefix_cache()
    assert tokens(llm, [prompt(0)], cache_salt="alice") == [reference[0]]
    assert llm.engine.get_stats().external_prefix_cache_hits - mid.external_prefix_cache_hits == 96


def test_full_host_pool_evicts_least_recently_used(model_dir: Path, reference: dict[int, list[int]]) -> None:
    llm = make_llm(model_dir, host_blocks=12)  # two prompts' 6 full blocks each
    for seed in (0, 1, 2):  # 0 is the least recently used when 2 arrives
        assert tokens(llm, [prompt(seed)]) == [reference[seed]]
    llm.engine.core.settle()
    llm.engine.core.finish_kv_transfers()
    llm.engine.core.kv_cache_manager.reset_prefix_cache()
    before = llm.engine.get_stats()
    assert tokens(llm, [prompt(0)]) == [reference[0]]  # gone from host: recomputed
    mid = llm.engine.get_stats()
    assert mid.external_prefix_cache_hits == before.external_prefix_cache_hits
    llm.engine.core.kv_cache_manager.reset_prefix_cache()
    assert tokens(llm, [prompt(2)]) == [reference[2]]
    assert llm.engine.get_stats().external_prefix_cache_hits - mid.external_prefix_cache_hits == 96


def test_reloaded_adapter_never_hits_kv_of_its_old_weights(model_dir: Path, adapter_dir: Path) -> None:
    options = dict(enable_lora=True, max_lora_rank=4, allowed_lora_roots=[str(adapter_dir)])
    llm = make_llm(model_dir, **options)
    fresh = make_llm(model_dir, host_blocks=None, device_blocks=64, **options)  # no cache at all to hit
    engine = llm.engine
    engine.core.load_lora("a", str(adapter_dir / "adapter-1"))
    first = tokens(llm, [prompt(0)], lora_name="a")
    engine.core.remove_lora("a")
    engine.core.load_lora("a", str(adapter_dir / "adapter-2"))  # same name, other weights
    fresh.engine.core.load_lora("a", str(adapter_dir / "adapter-2"))
    before = engine.get_stats()
    second = tokens(llm, [prompt(0)], lora_name="a")
    after = engine.get_stats()
    assert after.prefix_cache_hits == before.prefix_cache_hits  # no device hit
    assert after.external_prefix_cache_hits == before.external_prefix_cache_hits  # no host hit
    assert second == tokens(fresh, [prompt(0)], lora_name="a") != first
    # The same adapter load does hit (device tier here, host tier after a device reset).
    engine.core.kv_cache_manager.reset_prefix_cache()
    assert tokens(llm, [prompt(0)], lora_name="a") == second
    assert engine.get_stats().external_prefix_cache_hits - after.external_prefix_cache_hits == 96


def test_metrics_split_the_prefix_cache_by_tier(model_dir: Path, reference: dict[int, list[int]]) -> None:
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from tidal_engine.server.metrics import _EngineStatsCollector, metric_value

    llm = make_llm(model_dir)
    for seed in (0, 1, 2, 3, 0):  # prompt 0 comes back from the host pool
        assert tokens(llm, [prompt(seed)]) == [reference[seed]]
    stats = llm.engine.get_stats()
    registry = CollectorRegistry()
    snapshot = SimpleNamespace(stats=stats, peak_running=1, sleep_level=0, updated_at=0.0)
    registry.register(_EngineStatsCollector(SimpleNamespace(snapshot=snapshot), "tiny"))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()

    def read(name: str, **labels: str) -> float | None:
        return metric_value(text, name, model_name="tiny", **labels)

    assert read("tidal:external_prefix_cache_hits_total") == 96
    assert read("tidal:external_prefix_cache_queries_total") == 5 * 100 - stats.prefix_cache_hits
    assert read("tidal:prefix_cache_tier_hits_total", tier="host") == 96
    assert read("tidal:prefix_cache_tier_hits_total", tier="device") == stats.prefix_cache_hits
    assert read("tidal:kv_offload_bytes_total", direction="host_to_device") == 6 * BLOCK_BYTES
    assert read("tidal:kv_offload_bytes_total", direction="device_to_host") == stats.kv_offload_bytes_saved > 0
    assert read("tidal:kv_offload_transfer_seconds_total", direction="host_to_device") > 0
    assert 0 < read("tidal:kv_offload_usage_perc") <= 1
    assert read("tidal:prompt_tokens_computed_total") == 4 * 100 + 4


def copy_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU copies that finish as late as CUDA's may: a transfer runs at the first poll after
    its start, one per poll, unless its plan names it ``before_forward`` (then it runs before
    the forward, as the device orders it). A request computing on blocks before their load
    ran would read stale KV."""
    late: list[tuple[OffloadConnectorWorker, Any, bool]] = []
    poll = OffloadConnectorWorker.poll

    def start(self: OffloadConnectorWorker, plan: KVTransferPlan) -> None:
        for transfers, is_load in ((plan.saves, False), (plan.loads, True)):
            for t in transfers:
                if t.transfer_id in plan.before_forward:
                    self._run([t], is_load)
                else:
                    late.append((self, t, is_load))

    def poll_late(self: OffloadConnectorWorker, wait: bool = False) -> Any:
        mine = [item for item in late if item[0] is self]
        if mine:
            late.remove(mine[0])
            self._run([mine[0][1]], mine[0][2])
        return poll(self, wait)

    monkeypatch.setattr(OffloadConnectorWorker, "start", start)
    monkeypatch.setattr(OffloadConnectorWorker, "poll", poll_late)


@pytest.mark.parametrize(("async_scheduling", "save"), [(False, "write-through"), (True, "eviction")])
def test_late_copies_are_waited_for(model_dir: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool,
                                    save: str) -> None:
    copy_late(monkeypatch)
    llm = make_llm(model_dir, device_blocks=10, kv_offloading_save=save, async_scheduling=async_scheduling)
    seeds = [0, 1, 2, 3, 0, 2, 1]
    expected = tokens(reference_llm(model_dir), [prompt(s) for s in seeds])
    assert [tokens(llm, [prompt(s)])[0] for s in seeds] == expected  # one at a time: fused loads
    assert tokens(llm, [prompt(s) for s in seeds]) == expected  # all at once: loads wait for reports
    assert llm.engine.get_stats().external_prefix_cache_hits >= 3 * 96


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("async_scheduling", "save", "eager"),
                         [(False, "write-through", True), (True, "write-through", False), (True, "eviction", False)])
def test_cuda_streams_serve_evicted_prefixes_exactly(model_dir: Path, async_scheduling: bool, save: str,
                                                     eager: bool) -> None:
    """The GPU path: pinned pool, side-stream copies, events, forwards waiting for fused loads
    (one request at a time) and evicted blocks' saves; outputs equal a no-offload run. Run it
    compiled: ``TRITON_INTERPRET=0 pytest tests/engine/test_kv_offload.py -k cuda_streams``."""
    options: dict[str, Any] = dict(device="cuda", async_scheduling=async_scheduling, enforce_eager=eager)
    if not eager:
        options["cuda_graph_sizes"] = [1, 2, 4, 8]
    plain = make_llm(model_dir, host_blocks=None, device_blocks=64, **options)
    llm = make_llm(model_dir, device_blocks=10, kv_offloading_save=save, **options)
    assert llm.engine.core.executor.collective_rpc("kv_connector_info")[0]["pinned"]
    seeds = [0, 1, 2, 3, 0, 2, 1]
    expected = tokens(plain, [prompt(s) for s in seeds])
    got = [tokens(llm, [prompt(s)])[0] for s in seeds]  # one at a time: each evicts the older ones
    assert got == expected
    assert tokens(llm, [prompt(s) for s in seeds]) == expected  # and all at once
    stats = llm.engine.get_stats()
    assert stats.external_prefix_cache_hits >= 3 * 96 and stats.kv_offload_load_seconds > 0


def test_host_tier_survives_sleep_level_1_and_is_cleared_by_level_2(model_dir: Path,
                                                                      reference: dict[int, list[int]]) -> None:
    llm = make_llm(model_dir, enable_sleep_mode=True)
    engine = llm.engine
    assert tokens(llm, [prompt(0)]) == [reference[0]]
    engine.sleep(1)  # the device cache goes; the host pool and its blocks stay
    engine.wake_up()
    before = engine.get_stats()
    assert tokens(llm, [prompt(0)]) == [reference[0]]
    after = engine.get_stats()
    assert after.external_prefix_cache_hits - before.external_prefix_cache_hits == 96
    engine.sleep(2)  # the weights are reloaded on wake: host KV may no longer match them
    engine.wake_up()
    assert tokens(llm, [prompt(0)]) == [reference[0]]
    assert engine.get_stats().external_prefix_cache_hits == after.external_prefix_cache_hits


def test_fp8_kv_cache_moves_through_the_host_tier_unchanged(model_dir: Path) -> None:
    plain = make_llm(model_dir, host_blocks=None, device_blocks=64, kv_cache_dtype="fp8")
    llm = make_llm(model_dir, kv_cache_dtype="fp8")  # half the bytes per block: the pool holds twice as many
    seeds = [0, 1, 2, 3, 0]
    expected = tokens(plain, [prompt(s) for s in seeds])
    assert [tokens(llm, [prompt(s)])[0] for s in seeds] == expected
    assert llm.engine.get_stats().external_prefix_cache_hits == 96


def test_users_returning_in_turn_with_save_on_eviction_keep_their_host_blocks(
        model_dir: Path, reference: dict[int, list[int]]) -> None:
    """Users come back in a fixed order (a multi-turn chat), the device pool holds about one
    conversation and the host pool the others. Admitting a returning user allocates device
    blocks, which evicts (and, under ``eviction``, saves) someone else's: those saves must not
    push the returning user's own host blocks out between the lookup and the load."""
    llm = make_llm(model_dir, host_blocks=20, device_blocks=10, kv_offloading_save="eviction")
    users = (0, 1, 2, 3)
    before = llm.engine.get_stats()
    for _ in range(3):
        for seed in users:
            assert tokens(llm, [prompt(seed)]) == [reference[seed]]
    hits = llm.engine.get_stats().external_prefix_cache_hits - before.external_prefix_cache_hits
    assert hits > 0  # later turns were served from the host tier
