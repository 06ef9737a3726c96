"""Extend steps through the piecewise CUDA-graph path, on CPU: the runner built with capture=False pads each
extend (prefill and mixed) batch to its token bucket, copies every layer's attention inputs into the static
buffers at the cut and runs the real attention on the batch's own tokens between the pieces, eagerly, as a
replay does. Greedy tokens and log-probs equal the plain eager engine's, with prefix-cache hits, chunked
prompts and mixed batches; batches larger than the largest bucket still run eagerly. The GPU capture is
tests/gpu/test_cuda_paths.py's."""

import pytest
import torch

from engine.engine import Engine
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.runner.piecewise_graph import bucket_sizes
from engine.sampling import SamplingParams
from tests.same_outputs import logprob_gap

FLAGS = dict(device="cpu", dtype="float32", chunked_prefill_size=24, enable_mixed_chunk=True,
             prefill_burst=False)  # all prompts arrive at once: without this, one burst and no mixed steps


def _prompts(n=10, seed=3):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (20,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(0, 256, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        out.append((shared if i % 2 else []) + tail)
    return out


def test_bucket_sizes():
    assert bucket_sizes(0) == []
    assert bucket_sizes(100) == [16, 32, 64, 100]
    assert bucket_sizes(8192)[-1] == 8192 and bucket_sizes(8192) == sorted(set(bucket_sizes(8192)))


@pytest.mark.parametrize("model", ["tiny", "tiny-py"])
def test_piecewise_extend_identical(monkeypatch, model):
    ref_engine = Engine(model=model, **FLAGS)
    eng = Engine(model=model, **FLAGS)
    eng.runner.build_piecewise([16, 32], capture=False)  # steps of up to 24 tokens (a chunk)
    calls, real = [], eng.runner.piecewise.replay

    def counted(fb, *args):
        calls.append(fb.num_tokens)
        return real(fb, *args)

    monkeypatch.setattr(eng.runner.piecewise, "replay", counted)
    ps = _prompts()
    params = [SamplingParams(max_new_tokens=6 + i % 5, temperature=0, ignore_eos=True, logprobs=True)
              for i in range(len(ps))]
    ref = ref_engine.generate(input_ids=ps, sampling_params=params)
    got = eng.generate(input_ids=ps, sampling_params=params)
    assert logprob_gap(got, ref) < 1e-4
    # full steps fill the 16-token bucket exactly (the scheduler sizes them so); the last chunks pad
    assert 16 in calls and any(n < 16 for n in calls), calls
    assert eng.scheduler.stats()["mixed_steps"] > 0


def test_capped_steps_fill_a_bucket():
    eng = Engine(model="tiny", **FLAGS)
    sched = eng.scheduler
    assert sched._fill_bucket(30, 8) == 30  # no piecewise graphs: unchanged
    eng.runner.build_piecewise([16, 32], capture=False)
    assert eng.runner.extend_buckets == (16, 32)
    assert sched._fill_bucket(24, 8) == 24  # 32 tokens: a bucket already
    assert sched._fill_bucket(20, 8) == 8  # 28 tokens would pad to 32: fill 16 instead
    assert sched._fill_bucket(10, 8) == 8  # 18 -> 16
    assert sched._fill_bucket(5, 20) == 5  # the decodes alone exceed the bucket below: unchanged
    assert sched._fill_bucket(100, 4) == 100  # beyond the largest bucket: an eager step of any size


def test_piecewise_max_tokens_flag():
    from engine.args import EngineArgs
    from engine.errors import UsageError

    assert EngineArgs.of(model="tiny").piecewise_max_tokens() == 8192  # the step budget, 8192 tokens
    assert EngineArgs.of(model="tiny", chunked_prefill_size=2048).piecewise_max_tokens() == 2048
    assert EngineArgs.of(model="tiny", chunked_prefill_size=-1, max_prefill_tokens=4096).piecewise_max_tokens() == 4096
    assert EngineArgs.of(model="tiny", chunked_prefill_size=-1).piecewise_max_tokens() == 8192  # at most 8192
    assert EngineArgs.of(model="tiny", piecewise_cuda_graph_max_tokens=0).piecewise_max_tokens() == 0
    with pytest.raises(UsageError, match="piecewise-cuda-graph-max-tokens"):
        EngineArgs.of(model="tiny", piecewise_cuda_graph_max_tokens=-2).validate()


def test_dp_groups_share_the_prefill_step_budget():
    """Under DP attention the MoE layers run every group's tokens at once: each group's prefill step (and its
    piecewise graphs' largest bucket) takes 1 / dp of the budget, so a step's activations are one budget's, as
    without DP attention (V2 at full depth on 2 x H200 ran out of memory capturing 2 x 8192 rows)."""
    from engine.args import EngineArgs

    def dp(n, **kw):
        return EngineArgs.of(model="tiny", tp_size=n, enable_dp_attention=True, **kw)

    assert dp(2).attention_groups() == 2 and EngineArgs.of(model="tiny", tp_size=2).attention_groups() == 1
    assert dp(2).piecewise_max_tokens() == 4096 and dp(4).piecewise_max_tokens() == 2048
    assert EngineArgs.of(model="tiny", tp_size=2, ep_size=2).piecewise_max_tokens() == 8192  # no DP attention
    assert dp(2, chunked_prefill_size=-1).scheduler.step_budget(2) == 8192  # --max-prefill-tokens 16384, shared
    assert dp(2, piecewise_cuda_graph_max_tokens=8192).piecewise_max_tokens() == 8192  # asked for: as given
    assert dp(2, chunked_prefill_size=1).scheduler.step_budget(2) == 1  # never 0


def test_a_dp_groups_scheduler_prefills_its_share(monkeypatch):
    """The scheduler of one DP group (of 2) chunks a long prompt at half of --chunked-prefill-size."""
    from tests.scheduler.failing_runner import use_runner

    eng = Engine(model="tiny", device="cpu", dtype="float32", chunked_prefill_size=32, prefill_burst=False)
    runner, steps = eng.runner, []

    class Recording:  # the real runner, its prefill steps' token counts noted
        def __getattr__(self, name):
            return getattr(runner, name)

        def forward(self, fb):
            if not fb.mode.is_decode:
                steps.append(sum(fb.extend_lens_cpu))
            return runner.forward(fb)

    sched = use_runner(eng, Recording(), tp_size=2, enable_dp_attention=True)  # one group's scheduler of 2
    assert sched.step_budget == 16
    eng.generate(input_ids=[list(range(1, 41))], sampling_params=SamplingParams(max_new_tokens=2, temperature=0))
    assert steps == [16, 16, 8]


def test_padding_marks_every_groups_rows_past_its_own():
    """DP attention pads every group's block to one width; the marks say which rows of the MoE input are padding
    (the router gives them no expert: tests/kernels/test_moe_gate.py). Marks equal to the buffer's last are not
    written again; a forward starts unmarked."""
    from engine.model.context import ForwardContext

    ctx = ForwardContext(None, None, None, None, None)
    ctx.reserve_padding(12, torch.device("cpu"))
    ctx.mask_padding([2, 0, 3], 4)
    assert ctx.pad_rows.tolist() == [False, False, True, True] + [True] * 4 + [False, False, False, True]
    ctx.mask_padding([3], 4)
    assert ctx.pad_rows.tolist() == [False, False, False, True]
    ctx.pad_buffer[:4] = True  # what the marks of ([3], 4) no longer are: kept, as nothing else writes the buffer
    ctx.mask_padding([3], 4)
    assert ctx.pad_rows.tolist() == [True] * 4
    ctx.mask_padding([4], 4)
    assert not ctx.pad_rows.any()
    with pytest.raises(RuntimeError, match="before any graph"):
        ctx.reserve_padding(24, torch.device("cpu"), captured=True)
    ctx.begin_forward(ForwardBatch.build(ForwardMode.IDLE, [], [], [], [], torch.empty(0, dtype=torch.int64), [],
                                         torch.device("cpu")))
    assert ctx.pad_rows is None  # a forward starts unmarked


def test_padding_rows_reach_no_expert(monkeypatch):
    """Through the piecewise cut and the decode graphs' padded batches (capture=False), the rows a step pads to
    its bucket or graph size route to no expert; its own rows do."""
    eng = Engine(model="tiny", **FLAGS)
    eng.runner.build_graph_runner([1, 2, 4, 8], capture=False)
    eng.runner.build_piecewise([16, 32], capture=False)
    ctx, seen, tokens = eng.runner.forward_ctx, [], []
    experts = ctx.moe_backend.experts

    def counted(replay):
        def run(fb, *args):
            tokens.append(fb.num_tokens)
            return replay(fb, *args)
        return run

    def recorded(moe, x, weights, ids):
        seen.append((tokens[-1] if ctx.pad_rows is not None else None, ids.clone()))
        return experts(moe, x, weights, ids)

    monkeypatch.setattr(eng.runner.piecewise, "replay", counted(eng.runner.piecewise.replay))
    monkeypatch.setattr(eng.runner.graphs, "replay", counted(eng.runner.graphs.replay))
    monkeypatch.setattr(ctx.moe_backend, "experts", recorded)
    eng.generate(input_ids=_prompts(7), sampling_params=SamplingParams(max_new_tokens=8, temperature=0))
    padded = [(t, ids) for t, ids in seen if t is not None and ids.shape[0] > t]
    sizes = {ids.shape[0] for _, ids in padded}
    assert sizes & {2, 4, 8} and sizes & {16, 32}, f"no padded decode graph or piecewise step: {sizes}"
    for t, ids in padded:
        routed = (ids >= 0).any(1)
        assert routed[:t].all() and not routed[t:].any(), (t, ids.shape)
