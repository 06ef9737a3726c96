"""The start-up heap frozen out of garbage collection (engine/runtime/heap.py): what is alive at the end of
start-up no longer costs full collections; what serving allocates later still is collected; slow collections are
logged."""

import gc
import logging
import time

from engine.runtime.heap import freeze_startup_heap, warn_slow_collections


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_objects_leave_full_collections_and_new_garbage_is_still_collected():
    startup = [_Cycle() for _ in range(200_000)]  # a large long-lived heap, as imports and the model leave
    try:
        t = time.perf_counter()
        gc.collect()
        before = time.perf_counter() - t
        frozen = freeze_startup_heap("test")
        assert frozen == gc.get_freeze_count() >= len(startup)
        assert not any(o is startup for o in gc.get_objects())  # in the permanent generation
        t = time.perf_counter()
        gc.collect()
        after = time.perf_counter() - t
        assert after < before / 4  # the full collection no longer walks the frozen heap
        _Cycle()  # serving's cyclic garbage after the freeze
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()


def test_slow_collections_are_logged(caplog):
    callback = warn_slow_collections("test", threshold_s=0.0)
    try:
        with caplog.at_level(logging.WARNING, logger="engine.runtime.heap"):
            gc.collect()
        assert "test: a generation-2 garbage collection paused the process for" in caplog.text
    finally:
        gc.callbacks.remove(callback)
    caplog.clear()
    gc.collect()
    assert not caplog.text  # removed: no longer logs
