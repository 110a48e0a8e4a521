"""Adapter files, path confinement, the manager's caches and the scheduler's adapter limit."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_lora_support import chunk, random_lora_tensors, write_adapter  # noqa: E402

from tidal_engine.core.kv_cache_manager import KVCacheManager  # noqa: E402
from tidal_engine.core.request import Request  # noqa: E402
from tidal_engine.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from tidal_engine.lora import BaseModelShape, LoRAError, LoRAManager, LoRASettings, confine_path, read_adapter  # noqa: E402
from tidal_engine.lora.adapter import parse_adapter_config  # noqa: E402
from tidal_engine.lora.layers import LoRAModelSlots  # noqa: E402

SHAPE = BaseModelShape(num_layers=2, dims={
    "q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
    "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64),
})
Q = {"self_attn.q_proj": (64, 64)}


def test_scaling_alpha_over_r_and_rslora(tmp_path: Path) -> None:
    tensors = random_lora_tensors(Q, rank=4)
    plain = read_adapter("p", str(write_adapter(tmp_path / "p", tensors, rank=4, alpha=8)), SHAPE, max_rank=16)
    rs = read_adapter("r", str(write_adapter(tmp_path / "r", tensors, rank=4, alpha=8, use_rslora=True)), SHAPE,
                      max_rank=16)
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    a, b_plain = plain.weights[(0, "self_attn.qkv_proj")]["q"]
    torch.testing.assert_close(b_plain, b * (8 / 4))
    torch.testing.assert_close(rs.weights[(0, "self_attn.qkv_proj")]["q"][1], b * (8 / math.sqrt(4)))
    torch.testing.assert_close(a, tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    assert plain.rank == 4 and plain.targets == ["q_proj"]


def test_alpha_pattern_applies_per_module(tmp_path: Path) -> None:
    tensors = random_lora_tensors({"self_attn.q_proj": (64, 64), "mlp.down_proj": (128, 64)}, rank=2, layers=1)
    folder = write_adapter(tmp_path / "a", tensors, rank=2, alpha=2, targets=["q_proj", "down_proj"],
                           alpha_pattern={"down_proj": 8})
    adapter = read_adapter("a", str(folder), SHAPE, max_rank=4)
    down_b = tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    torch.testing.assert_close(adapter.weights[(0, "mlp.down_proj")][None][1], down_b * 4)
    q_b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    torch.testing.assert_close(adapter.weights[(0, "self_attn.qkv_proj")]["q"][1], q_b * 1)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"r": 0}, "'r' must be a positive integer"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "train biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens do not exist"),
        ({"peft_type": "IA3"}, "only LORA"),
    ],
)
def test_config_errors(config: dict[str, object], message: str) -> None:
    base = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    with pytest.raises(LoRAError, match=message):
        parse_adapter_config({**base, **config}, "adapter 'x'")


def test_all_linear_targets_everything() -> None:
    config = parse_adapter_config({"r": 4, "target_modules": "all-linear"}, "x")
    assert len(config.target_modules) == 7


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, "does not belong to a supported target"),
        ({"base_model.model.model.layers.0.self_attn.qkv.lora_A.weight": torch.zeros(4, 64)}, "does not exist"),
        ({"base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
          "base_model.model.model.layers.5.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}, "2 layers"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}, "no lora_B"),
        ({"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 64),
          "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": torch.zeros(64, 4)},
         "maps 64 → 64 features, the base model's k_proj maps 64 → 32"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 64), float("nan")),
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}, "NaN"),
    ],
)
def test_tensor_errors(tmp_path: Path, tensors: dict[str, torch.Tensor], message: str) -> None:
    folder = write_adapter(tmp_path / "a", tensors, rank=4, targets=["q_proj", "k_proj"])
    with pytest.raises(LoRAError, match=message):
        read_adapter("a", str(folder), SHAPE, max_rank=16)


def test_rank_above_maximum(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", random_lora_tensors(Q, rank=8), rank=8)
    with pytest.raises(LoRAError, match="rank 8 exceeds the maximum LoRA rank 4"):
        read_adapter("a", str(folder), SHAPE, max_rank=4)


def test_pickle_weights_are_not_loaded(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", random_lora_tensors(Q, rank=2), rank=2)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(LoRAError, match="is a pickle"):
        read_adapter("a", str(folder), SHAPE, max_rank=4)


def test_confine_path(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "ok").mkdir(parents=True)
    (outside / "secret").mkdir(parents=True)
    os.symlink(outside / "secret", root / "link")
    os.symlink(root / "ok", tmp_path / "link-into-root")
    assert confine_path(str(root / "ok"), [str(root)]) == (root / "ok").resolve()
    assert confine_path(str(tmp_path / "link-into-root"), [str(root)]) == (root / "ok").resolve()
    for bad, message in [(str(root / "link"), "outside the allowed roots"),
                         (str(root / ".." / "outside" / "secret"), "must not contain '..'"),
                         (str(outside / "secret"), "outside the allowed roots"),
                         (str(tmp_path / "rootx"), "outside the allowed roots"),  # a sibling with the root's prefix
                         (str(root / "missing"), "does not exist"),
                         ("", "non-empty")]:
        with pytest.raises(LoRAError, match=message):
            confine_path(bad, [str(root)])
    # Outside the roots, existence is never revealed.
    with pytest.raises(LoRAError, match="outside the allowed roots"):
        confine_path(str(outside / "nope"), [str(root)])
    # A symlinked weights file that leads out of the roots is refused too.
    folder = write_adapter(root / "sneaky", random_lora_tensors(Q, rank=2), rank=2)
    (folder / "adapter_model.safetensors").rename(outside / "w.safetensors")
    os.symlink(outside / "w.safetensors", folder / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="links outside the allowed roots"):
        read_adapter("s", str(folder), SHAPE, max_rank=4, allowed_roots=[str(root)])


def _manager(tmp_path: Path, max_loras: int = 1, max_cpu_loras: int = 2) -> LoRAManager:
    from tiny_models import make_tiny_model

    from tidal_engine.models.loader import load_model, resolve_model

    make_tiny_model("llama", tmp_path / "base")
    source = resolve_model(str(tmp_path / "base"))
    model = load_model(source, torch.float32, "cpu")
    slots = LoRAModelSlots(model, max_loras=max_loras, max_rank=4)
    return LoRAManager(BaseModelShape.from_arch(source.arch_config),
                       LoRASettings(max_loras=max_loras, max_lora_rank=4, max_cpu_loras=max_cpu_loras), slots)


def test_host_cache_lru_pins_in_flight_and_rereads(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    for name in ("a", "b", "c"):
        manager.load(name, str(write_adapter(tmp_path / name, random_lora_tensors(Q, rank=2), rank=2)))
    assert manager.host_cached() == ["b", "c"]  # a was evicted (LRU, size 2)
    manager.acquire("a")  # re-read from disk and pinned
    manager.acquire("b")
    manager.acquire("c")
    assert sorted(manager.host_cached()) == ["a", "b", "c"]  # pinned ones stay, over the limit
    for name in ("a", "b", "c"):
        manager.release(name)
    assert len(manager.host_cached()) == 2
    # A step maps adapters into the single slot in turn.
    assert manager.begin_step([chunk("a", 2), chunk(None, 1)])
    assert manager.slot_table() == ["a"]
    manager.end_step()
    manager.begin_step([chunk("c", 1)])
    assert manager.slot_table() == ["c"]
    manager.end_step()


def test_pending_unload_and_errors(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    folder = str(write_adapter(tmp_path / "a", random_lora_tensors(Q, rank=2), rank=2))
    manager.load("a", folder)
    with pytest.raises(LoRAError, match="already been loaded"):
        manager.load("a", folder)
    manager.acquire("a")
    assert manager.remove("a") is False  # waits for its request
    with pytest.raises(LoRAError) as refused:
        manager.acquire("a")
    assert refused.value.status == 404
    with pytest.raises(LoRAError, match="being unloaded"):
        manager.load("a", folder)
    assert [i.name for i in manager.list_adapters(include_unloading=True)] == ["a"]
    assert manager.list_adapters() == []
    manager.release("a")
    assert manager.get("a") is None
    with pytest.raises(LoRAError) as unknown:
        manager.remove("a")
    assert unknown.value.status == 404


def test_scheduler_admits_at_most_max_loras_adapters() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=64, block_size=4, max_loras=1),
                          kv)
    order = [("r1", "a"), ("r2", "b"), ("r3", None), ("r4", "a"), ("r5", "b")]
    for rid, lora in order:
        scheduler.add_request(Request(rid, [1, 2, 3], lora_name=lora))
    first = scheduler.schedule()
    assert [c.request.request_id for c in first.chunks] == ["r1", "r3", "r4"]  # b is skipped, keeps its place
    assert [r.request_id for r in scheduler.waiting] == ["r2", "r5"]
