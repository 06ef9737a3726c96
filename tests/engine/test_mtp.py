"""The MTP/NextN module loads from the checkpoint and runs over its own KV cache layer."""

import torch

from engine.engine import Engine
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.speculative.draft_runner import DraftRunner


def _run(eng, mode, ids, prefix, row, slots, spec_hidden=None, mtp=False):
    fb = ForwardBatch.build(mode, ids, [row], [prefix], [len(ids)], slots, list(range(len(ids))), eng.runner.device)
    fb.spec_hidden = spec_hidden
    eng.runner.req_to_token.set(row, prefix, slots)
    return DraftRunner(eng.runner).forward(fb) if mtp else eng.runner.forward(fb)


def test_mtp_layer_loaded_and_consistent_across_chunks():
    eng = Engine(model="tiny", device="cpu")
    r = eng.runner
    assert r.mtp is not None
    mtp_cache_layer = r.num_layers
    ids = list(range(60, 90))
    row = r.req_to_token.alloc()
    slots = r.kv_pool.alloc(len(ids))
    main = _run(eng, ForwardMode.EXTEND, ids, 0, row, slots)
    before = [b[slots].clone() for b in r.kv_pool.buffer[:mtp_cache_layer]]
    # MTP input at position i: the next token ids[i+1] and the main model's hidden state at i.
    nxt, hid = ids[1:], main.hidden[:-1]
    full = _run(eng, ForwardMode.DRAFT_EXTEND, nxt, 0, row, slots[:-1], hid, mtp=True)
    assert full.logits.shape == (len(nxt), r.config.vocab_size) and torch.isfinite(full.logits).all()
    assert all(torch.equal(b[slots], was) for b, was in zip(r.kv_pool.buffer[:mtp_cache_layer], before))  # main layers' cache untouched
    assert r.kv_pool.buffer[mtp_cache_layer][slots[:-1]].abs().sum() > 0
    # Same result when the MTP layer runs in two chunks (second chunk attends to the cached first).
    k = 11
    _run(eng, ForwardMode.DRAFT_EXTEND, nxt[:k], 0, row, slots[:k], hid[:k], mtp=True)
    second = _run(eng, ForwardMode.DRAFT_EXTEND, nxt[k:], k, row, slots[k:-1], hid[k:], mtp=True)
    torch.testing.assert_close(second.logits, full.logits[k:], atol=1e-4, rtol=1e-4)
    # Its prediction depends on the hidden-state input, not only on the token.
    other = _run(eng, ForwardMode.DRAFT_EXTEND, nxt, 0, row, slots[:-1], torch.randn_like(hid), mtp=True)
    assert (other.logits - full.logits).abs().max() > 1e-2
