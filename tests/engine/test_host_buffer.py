"""The level-1 host buffer: the weights' exact size, prepared once (on a thread when asked),
reused until released; a failed preparation falls back to preparing it when it is needed."""

from __future__ import annotations

import pytest
import torch

from tidal_engine.runner.host_buffer import HostBuffer


def test_prepared_on_a_thread_once_and_reused_until_released() -> None:
    buffer = HostBuffer(1000, torch.device("cpu"))
    buffer.prepare_in_background()
    buffer.prepare_in_background()  # a second ask starts nothing new
    first = buffer.get()
    assert buffer.ready and first.numel() == 1000 and first.dtype == torch.uint8
    assert buffer.get() is first
    buffer.release()
    assert not buffer.ready
    assert buffer.get().numel() == 1000  # asked for again: prepared at once


def test_a_failed_preparation_falls_back_when_the_buffer_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = HostBuffer(64, torch.device("cpu"))

    def broken() -> None:
        raise RuntimeError("no memory to lock")

    monkeypatch.setattr(buffer, "_prepare", broken)
    buffer.prepare_in_background()
    assert buffer.get().numel() == 64
    assert buffer.ready
