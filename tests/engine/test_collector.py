"""The garbage collector is paused while the engine core is built (engine/collector.py)."""

from __future__ import annotations

import gc

import pytest

from tidal_engine.engine.collector import collector_paused, freeze_heap, unfreeze_heap


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


def test_freeze_collects_garbage_first_and_unfreeze_hands_the_survivors_back() -> None:
    import weakref

    class Node:
        pass

    garbage = Node()
    garbage.self = garbage  # a cycle: only the collector frees it
    gone = weakref.ref(garbage)
    kept = Node()
    kept.self = kept
    del garbage
    frozen_before = gc.get_freeze_count()
    freeze_heap()
    try:
        assert gone() is None  # collected, not frozen
        assert gc.get_freeze_count() > frozen_before
        kept_ref = weakref.ref(kept)
        del kept
        gc.collect()
        assert kept_ref() is not None  # frozen: the collector no longer walks it
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert kept_ref() is None  # back in the collector's reach, and freed
