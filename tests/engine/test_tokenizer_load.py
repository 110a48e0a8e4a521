"""The engine core's tokenizer loads on a thread while the workers start (engine/tokenizer_load.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tidal_engine.config import EngineConfig
from tidal_engine.engine import core as core_module
from tidal_engine.engine.core import EngineCore
from tidal_engine.engine.tokenizer_load import SWITCH_INTERVAL_S, TokenizerLoad

from scripted_executor import BLOCK, ScriptedExecutor
from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, save_byte_tokenizer

GUARD_S = 30  # only a failing test waits this long


def test_the_load_runs_on_its_own_thread_with_a_short_switch_interval() -> None:
    before = sys.getswitchinterval()
    release = threading.Event()
    seen: dict[str, Any] = {}

    def load() -> str:
        seen["thread"] = threading.current_thread().name
        seen["interval"] = sys.getswitchinterval()
        assert release.wait(GUARD_S)
        return "tokenizer"

    pending = TokenizerLoad(load)
    assert not pending.done  # the constructor did not wait for the load
    release.set()
    assert pending.result() == "tokenizer"
    assert seen["thread"] == "tidal-tokenizer"
    assert seen["interval"] == pytest.approx(min(before, SWITCH_INTERVAL_S))
    assert sys.getswitchinterval() == pytest.approx(before)  # given back when the load ended


def test_a_failed_load_raises_from_result() -> None:
    def load() -> None:
        raise ValueError("no tokenizer here")

    pending = TokenizerLoad(load)
    with pytest.raises(ValueError, match="no tokenizer here"):
        pending.result()


def test_alongside_off_loads_in_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TokenizerLoad, "alongside", False)
    caller = threading.get_ident()
    pending = TokenizerLoad(lambda: threading.get_ident())
    assert pending.done
    assert pending.result() == caller


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-tokenizer-load")
    make_tiny_model("qwen3", folder, eos_token_id=EOS_ID, bos_token_id=None, max_position_embeddings=256)
    save_byte_tokenizer(folder, vocab_size=1000)
    return folder


class _Tokenizer:
    eos_token_id = 7


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128, block_size=BLOCK)


def test_the_workers_start_while_the_tokenizer_loads(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executor_started = threading.Event()

    def load_tokenizer(*args: Any) -> _Tokenizer:
        # Finishes only once the executor is being built: loading first, as before, would fail here.
        assert executor_started.wait(GUARD_S), "the executor was not started while the tokenizer loaded"
        return _Tokenizer()

    def build_executor(*args: Any) -> ScriptedExecutor:
        executor_started.set()
        return ScriptedExecutor(num_blocks=64)

    monkeypatch.setattr(core_module, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(core_module, "build_executor", build_executor)
    core = EngineCore(_config(model_dir))
    assert isinstance(core.tokenizer, _Tokenizer)
    assert core.eos_token_ids == {EOS_ID, _Tokenizer.eos_token_id}  # the config's and the tokenizer's
    assert {"tokenizer", "tokenizer_load", "executor"} <= set(core.startup_seconds)


def test_a_tokenizer_that_fails_shuts_the_workers_down(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shut: list[bool] = []

    class Recording(ScriptedExecutor):
        def shutdown(self) -> None:
            shut.append(True)
            super().shutdown()

    def load_tokenizer(*args: Any) -> None:
        raise ValueError("cannot load the tokenizer")

    monkeypatch.setattr(core_module, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(core_module, "build_executor", lambda *args: Recording(num_blocks=64))
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        EngineCore(_config(model_dir))
    assert shut == [True]


def test_skip_tokenizer_init_loads_nothing(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def load_tokenizer(*args: Any) -> None:
        raise AssertionError("no tokenizer wanted")

    monkeypatch.setattr(core_module, "load_tokenizer", load_tokenizer)
    core = EngineCore(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128,
                                   block_size=BLOCK, skip_tokenizer_init=True),
                      executor=ScriptedExecutor(num_blocks=64))
    assert core.tokenizer is None
    assert core.eos_token_ids == {EOS_ID}


def test_the_core_is_built_with_the_collector_paused(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    states: list[bool] = []

    def build_executor(*args: Any) -> ScriptedExecutor:
        states.append(gc.isenabled())
        return ScriptedExecutor(num_blocks=64)

    monkeypatch.setattr(core_module, "build_executor", build_executor)
    monkeypatch.setattr(core_module, "load_tokenizer", lambda *args: _Tokenizer())
    EngineCore(_config(model_dir))
    assert states == [False] and gc.isenabled()
