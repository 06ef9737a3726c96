"""Shared test helper: run a test module's small tensors on one torch thread (on CI's two shared cores the
thread pool only adds spinning)."""

from __future__ import annotations

import pytest
import torch


def one_thread_fixture():
    """A module-scoped autouse fixture setting torch to one thread and restoring the count after; a test
    module uses it with `one_thread = one_thread_fixture()`."""

    @pytest.fixture(scope="module", autouse=True)
    def one_thread():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)

    return one_thread
