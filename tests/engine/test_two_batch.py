"""Two-batch overlap (engine/model/two_batch.py): the split, the micro-batches, the interleaving of their steps,
and one process's engine running every forward it can as two micro-batches with the tokens it runs whole.

Across processes (gloo: DP attention, EP by gather and by all-to-all, CUDA-graph-shaped decodes) it runs in
tests/distributed/test_engine_tp.py `test_redundant_experts_and_routing_counts`."""

from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from engine.distributed.comm import Pending, finish
from engine.distributed.dp_attention import DPGather, uniform
from engine.engine import Engine
from engine.errors import UsageError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model.layers import solo_group
from engine.model.two_batch import TwoBatchOverlap, interleave, requests_before, split_batch, split_point
from engine.sampling import SamplingParams


def _extend(lens: list[int]) -> ForwardBatch:
    n = sum(lens)
    return ForwardBatch.build(ForwardMode.EXTEND, list(range(n)), list(range(len(lens))), [3] * len(lens), lens,
                              torch.arange(100, 100 + n), [n - 1], torch.device("cpu"))


def _decode(b: int) -> ForwardBatch:
    return ForwardBatch.build(ForwardMode.DECODE, list(range(b)), list(range(b)), [5] * b, [1] * b,
                              torch.arange(b), list(range(b)), torch.device("cpu"))


def test_split_points():
    assert split_point(_decode(5)) == (3, 3) and split_point(_decode(1)) == (0, 0)
    assert split_point(_extend([10, 1, 2, 9])) == (2, 11)  # boundaries 10, 11, 13: 11 is half of 22
    assert split_point(_extend([30, 2])) == (1, 30)
    assert split_point(_extend([7])) == (0, 0)
    mtp = _decode(4)
    mtp.spec_hidden = torch.zeros(4, 8)
    assert split_point(mtp) == (0, 0)
    assert requests_before(_extend([10, 1, 1, 9]), 12) == 3 and requests_before(_extend([4]), 0) == 0
    with pytest.raises(ValueError, match="do not end a request"):
        requests_before(_extend([10, 1]), 5)


def test_micro_batches_are_the_batch_cut_at_a_request():
    fb = _extend([4, 2, 3])
    fb.real_tokens = 5  # padded: rows from 5 on are padding
    first, second = split_batch(fb, 1, 4)
    assert first.input_ids.tolist() == [0, 1, 2, 3] and second.input_ids.tolist() == [4, 5, 6, 7, 8]
    assert second.positions.tolist() == fb.positions[4:].tolist() and second.out_cache_loc[0] == 104
    assert first.extend_lens_cpu == [4] and second.extend_lens_cpu == [2, 3] and second.req_rows_cpu == [1, 2]
    assert second.seq_lens.tolist() == [5, 6] and (first.real_tokens, second.real_tokens) == (4, 1)
    empty, whole = split_batch(fb, 0, 0)
    assert empty.mode is ForwardMode.IDLE and empty.num_tokens == 0 and whole.num_tokens == 9


def test_rule_needs_both_halves_and_enough_tokens():
    rule = TwoBatchOverlap(min_tokens=8)
    assert rule.splits(4, 8) and not rule.splits(3, 7) and not rule.splits(0, 20) and not rule.splits(20, 20)


def test_dp_gathers_split_per_group():
    g = solo_group()
    gather = DPGather(g, [7, 0, 5], [3, 0, 5])
    a, b = gather.halves()
    assert (a.counts, b.counts) == ([3, 0, 5], [4, 0, 0])
    assert uniform(g, 5).splits == [3]


class _Step:
    """A Pending whose wait is logged."""

    def __init__(self, log: list, name: str, value):
        self.log, self.name, self.value = log, name, value

    def wait(self):
        self.log.append(f"wait {self.name}")
        return self.value


def _stages(log: list, name: str, n: int):
    total = 0
    for i in range(n):
        log.append(f"{name} computes {i}")
        total += yield _Step(log, f"{name}{i}", i + 1)
    log.append(f"{name} done")
    return f"{name}={total}"


def test_interleave_alternates_and_waits_only_when_resuming():
    log = []
    assert interleave(_stages(log, "a", 2), _stages(log, "b", 3)) == ("a=3", "b=6")
    assert log == ["a computes 0", "b computes 0", "wait a0", "a computes 1", "wait b0", "b computes 1",
                   "wait a1", "a done", "wait b1", "b computes 2", "wait b2", "b done"]
    log.clear()
    assert finish(_stages(log, "a", 2)) == "a=3"
    assert log == ["a computes 0", "wait a0", "a computes 1", "wait a1", "a done"]
    assert Pending(torch.ones(2), then=lambda t: t * 3).wait().tolist() == [3.0, 3.0]


FLAGS = dict(device="cpu", dtype="float32", chunked_prefill_size=16, max_prefill_tokens=48, max_running_requests=8,
             max_total_tokens=2048, attention_backend="torch", moe_backend="torch")


def test_one_process_split_forwards_give_the_same_tokens():
    """Every forward of two or more requests run as two micro-batches (in one process their collectives are
    no-ops, so this checks the split, the per-micro-batch planning and the reassembly): the same greedy tokens
    and log-probs within float32 reordering."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (1 + (7 * i) % 37,), generator=g).tolist() for i in range(8)]
    params = [SamplingParams(max_new_tokens=3 + i % 4, temperature=0, ignore_eos=True, logprobs=True)
              for i in range(8)]
    ref = Engine(EngineArgs.of(model="tiny", **FLAGS)).generate(input_ids=prompts, sampling_params=params)
    eng = Engine(EngineArgs.of(model="tiny", **FLAGS))
    eng.runner.forward_ctx.two_batch = TwoBatchOverlap(min_tokens=2)  # the flag needs --tp 2 or more
    got = eng.generate(input_ids=prompts, sampling_params=params)
    assert eng.runner.two_batch_forwards > 4
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    gap = max(abs(a - b) for o, p in zip(ref, got) for a, b in zip(o.logprobs, p.logprobs))
    assert 0 <= gap < 1e-4


@pytest.mark.parametrize("flags, message", [
    (dict(enable_two_batch_overlap=True), "--tp 1 has none"),
    (dict(enable_two_batch_overlap=True, tp_size=2, attention_backend="flashinfer"), "FlashInfer"),
    (dict(enable_two_batch_overlap=True, tp_size=2, disable_mla=True), "--disable-mla"),
    (dict(two_batch_overlap_min_tokens=1), "must be >= 2"),
])
def test_bad_two_batch_flags_are_refused(flags, message):
    with pytest.raises(UsageError, match=message):
        EngineArgs.of(model="tiny", device="cpu", **flags).validate()
