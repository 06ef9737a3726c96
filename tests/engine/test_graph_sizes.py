"""Which decode batch sizes the runner captures in CUDA graphs (sizing only; no GPU needed).

By default every batch the scheduler may run (up to --max-running-requests) has a graph: a larger
batch runs eagerly, and a 27-layer model's eager decode step is several times slower (measured on
an H100 serving DeepSeek-V2-Lite at concurrency 256: ITL p50 55 ms with graphs up to 160).
"""

from types import SimpleNamespace

import pytest
import torch

from engine.args import EngineArgs
from engine.errors import UsageError
from engine.runner.model_runner import ModelRunner


def _sizes(**flags) -> list[int]:
    args = EngineArgs.of(model="tiny", **flags)
    args.validate()
    runner = SimpleNamespace(device=torch.device("cuda"), args=args,
                             max_running_requests=args.scheduler.max_running_requests, _rows_per_request=lambda: 1)
    return ModelRunner._graph_batch_sizes(runner)


def test_default_covers_every_running_batch():
    assert _sizes()[-1] == EngineArgs.of(model="tiny").scheduler.max_running_requests
    sizes = _sizes(max_running_requests=100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 100 and all(b % 8 == 0 for b in sizes[3:-1])


def test_default_steps_of_16_above_128():
    """Each size is a capture at start-up (60 layers: about 0.3 s each); above 128 rows a padded row costs little
    of a step, so the default steps by 16 there: 27 sizes up to 256 instead of 35."""
    sizes = _sizes(max_running_requests=256)
    assert len(sizes) == 27 and sizes[:4] == [1, 2, 4, 8]
    assert [b for b in sizes if b <= 128] == [1, 2, 4] + list(range(8, 129, 8))
    assert [b for b in sizes if b > 128] == list(range(144, 257, 16))
    assert _sizes(max_running_requests=200)[-2:] == [192, 200]


def test_explicit_max_and_list_win():
    assert _sizes(cuda_graph_max_bs=160)[-1] == 160
    assert _sizes(cuda_graph_bs="1,3,17") == [1, 3, 17]
    assert _sizes(cuda_graph_max_bs=512, max_running_requests=64)[-1] == 64  # never above what can run


def test_rejects_non_positive_max():
    with pytest.raises(UsageError):
        _sizes(cuda_graph_max_bs=0)
