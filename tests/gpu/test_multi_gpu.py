"""Two or more GPUs: every parallel layout (TP, DP attention, EP) through NCCL and CUDA graphs gives the
greedy tokens of one GPU, in float32 (skipped below 2 GPUs).

DeepSeek-V2-Lite truncated to 4 layers, dummy float32 weights (each rank holds its slice of the TP-1
values), 8 prompts in one batch, each layout in its own rank processes (benchmarks/multi_gpu_check.py).
In bf16 a different split reorders sums enough to flip tokens where these flat random-weight
distributions are nearly tied (docs/perf.md, "Two GPUs"); in float32 (tf32 dots in the Triton kernels)
the log-probs must agree closely and any divergence must be a tie. A wrong shard moves log-probs by
tenths to whole nats.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs")

TIE_GAP = 0.02  # nats: the reference's own gap at a divergence that counts as a rounding tie
LOGPROB_ATOL = 0.02  # chosen tokens' log-probs before any divergence


@pytest.fixture(scope="module")
def check():
    from benchmarks import multi_gpu_check

    return multi_gpu_check


@pytest.fixture(scope="module")
def base(check):
    from engine.checkpoint.config import parse_config
    from engine.checkpoint.registry import lookup

    vocab = parse_config(lookup("deepseek-v2-lite").config_dict()).vocab_size
    flags = dict(model="deepseek-v2-lite", load_format="dummy", device="cuda", dtype="float32",
                 max_model_len=512, num_layers=4)
    return flags, check.prompts(vocab, 8)


@pytest.fixture(scope="module")
def reference(check, base):
    flags, ids = base
    return check.run_layout(flags, "tp1", "eager", ids, 16)


# tbo2: two-batch overlap with every forward of two or more requests split (NCCL's asynchronous collectives, in
# and out of CUDA graphs)
@pytest.mark.parametrize("layout", ["tp2", "tp2-dp2", "tp2-ep2", "tp2-dp2-ep2-a2a-tbo2", "tp2-ep2-tbo2"])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_layout_matches_one_gpu(check, base, reference, layout, mode):
    _matches(check, base, reference, layout, mode)


@pytest.mark.parametrize("layout", ["tp2-dp2-ep2-a2a", "tp2-dp2-ep2-a2a-tbo2"])
def test_compiled_graphs_match_one_gpu(check, base, reference, layout):
    """CUDA graphs of torch.compile'd decode forwards: the collectives traced inside them, and with two-batch
    overlap the split graphs (their layers run uncompiled)."""
    _matches(check, base, reference, layout, "graph+compile", compile_max_bs=8)


def _matches(check, base, reference, layout: str, mode: str, **kw) -> None:
    flags, ids = base
    run = check.run_layout(flags, layout, mode, ids, 16, **kw)
    assert not reference.failed and not run.failed, (reference.failed, run.failed)
    c = check.compare(reference, run)
    assert c.max_dlogprob < LOGPROB_ATOL, c
    assert check.verdict(run, c, TIE_GAP), c


def test_ranks_with_nccl_in_cuda_graphs_exit_promptly(base):
    """A rank whose CUDA graphs captured NCCL collectives must free them before leaving the process group,
    or `destroy_process_group` waits forever (the ranks then outlived every shutdown by the 30 s timeout)."""
    import time

    from engine.args import EngineArgs
    from engine.runtime.offline import RankedEngine
    from engine.sampling import SamplingParams

    flags, ids = base
    eng = RankedEngine(EngineArgs.of(**flags, tp_size=2, cuda_graph_bs="1,4"))
    outs = eng.generate(input_ids=ids[:4], sampling_params=SamplingParams(max_new_tokens=4, temperature=0,
                                                                          ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in outs)
    t0 = time.monotonic()
    eng.close(timeout=20)
    took = time.monotonic() - t0
    assert took < 15, f"the ranks took {took:.1f} s to exit after the shutdown request"
