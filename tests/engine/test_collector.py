"""The garbage collector is paused while the engine core is built (engine/collector.py)."""

from __future__ import annotations

import gc

import pytest

from tidal_engine.engine.collector import collector_paused


def test_paused_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_restored_after_an_error_and_left_off_if_it_was_off() -> None:
    with pytest.raises(RuntimeError):
        with collector_paused():
            raise RuntimeError("construction failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
