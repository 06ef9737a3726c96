"""ForwardBatch.build: positions, lengths and token ids packed from host lists, for decode batches, extends
with and without a prefix, mixed batches (chunks and 1-token extends), empty requests and empty batches."""

from __future__ import annotations

import random

import pytest
import torch

from engine.forward_batch import ForwardBatch, ForwardMode


def _reference_positions(prefix, extend):
    return [p + i for p, n in zip(prefix, extend) for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_build_matches_the_per_token_definition(seed):
    rnd = random.Random(seed)
    for _ in range(60):
        b = rnd.randint(0, 24)
        prefix = [rnd.randint(0, 5000) for _ in range(b)]
        kind = rnd.choice(["decode", "mixed", "any"])
        if kind == "decode":
            extend = [1] * b
        elif kind == "mixed":  # a few chunks, then 1-token extends
            extend = [rnd.randint(1, 300) for _ in range(min(b, 2))] + [1] * max(b - 2, 0)
        else:
            extend = [rnd.choice([0, 1, 2, 17, 100]) for _ in range(b)]
        t = sum(extend)
        ids = [rnd.randint(0, 2**40) for _ in range(t)]  # large ids: no truncation to 32 bits
        logits = sorted(rnd.sample(range(t), min(t, 5)))
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, list(range(b)), prefix, extend, torch.arange(t),
                                logits, torch.device("cpu"))
        assert fb.positions.tolist() == _reference_positions(prefix, extend)
        assert fb.input_ids.tolist() == ids
        assert fb.seq_lens.tolist() == fb.seq_lens_cpu == [p + n for p, n in zip(prefix, extend)]
        assert fb.extend_lens.tolist() == extend and fb.prefix_lens.tolist() == prefix
        assert fb.logits_indices.tolist() == logits and fb.req_pool_indices.tolist() == list(range(b))
        for x in (fb.input_ids, fb.positions, fb.seq_lens, fb.extend_lens, fb.prefix_lens, fb.logits_indices):
            assert x.dtype == torch.int64
        assert fb.out_cache_loc.tolist() == list(range(t)) and fb.req_rows_cpu == list(range(b))


def test_build_sends_the_host_columns_in_one_copy(monkeypatch):
    # One host-to-device transfer per batch (pinned and non-blocking on a GPU: forward_batch.tensor_to_device),
    # not one blocking copy per column, each of which would wait for the forward in flight.
    import engine.forward_batch as fbm

    sent = []
    monkeypatch.setattr(fbm, "tensor_to_device", lambda t, device: sent.append(t.numel()) or t.clone())
    fb = ForwardBatch.build(ForwardMode.DECODE, [5, 6, 7], [2, 0, 1], [10, 11, 12], [1, 1, 1],
                            torch.tensor([40, 41, 42], dtype=torch.int32), [0, 1, 2], torch.device("cpu"))
    assert sent == [3 * 8]  # 7 columns of the batch + the KV slots, 3 values each
    assert fb.input_ids.tolist() == [5, 6, 7] and fb.positions.tolist() == [10, 11, 12]
    assert fb.out_cache_loc.tolist() == [40, 41, 42] and fb.out_cache_loc.dtype == torch.int64
    assert fb.seq_lens.tolist() == [11, 12, 13] and fb.req_pool_indices.tolist() == [2, 0, 1]
