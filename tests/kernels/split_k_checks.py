"""One GPU check the split-K tests of both kernels share (tests/kernels/test_fp8.py, test_split_k.py)."""

import torch

from kernels.split_k import arrivals


def same_bits_every_launch_and_replay(run, whole: torch.Tensor, rel: float = 1e-2) -> None:
    """`run(out=None)` launches a split GEMM: five launches give the same bits, within `rel` (norm-wise) of the
    unsplit result `whole`, and a CUDA graph of it replays those bits three times; the arrival counts end at 0."""
    outs = [run() for _ in range(5)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert (outs[0].float() - whole.float()).norm() / whole.float().norm() < rel
    buf = torch.empty_like(outs[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out=buf)
    for _ in range(3):
        buf.fill_(float("nan"))
        graph.replay()
        assert torch.equal(buf, outs[0])
    torch.cuda.synchronize()
    assert not arrivals(whole.device).any()
