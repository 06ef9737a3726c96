"""Tree attention as a batched decode: the scratch table rows, and the FlashInfer backend's page-table
path (a pure-torch stand-in for flashinfer, tests/engine/fake_flashinfer.py) under speculative decoding."""

import pytest
import torch

from engine.engine import Engine
from engine.model import attention_flashinfer as fi
from engine.sampling import SamplingParams
from engine.speculative.draft import _select
from engine.speculative.tree_table import build_tree_table
from tests.engine import fake_flashinfer
from tests.speculative.helpers import FLAGS, SPEC, prompts


def test_tree_table_rows_are_prefix_then_ancestors():
    req = torch.arange(100, dtype=torch.int32).view(4, 25)  # row r holds slots 25r .. 25r + 24
    rows, prefix = torch.tensor([2, 0, 2]), torch.tensor([5, 3, 0])
    extra = torch.tensor([[90, 91, 92], [80, 0, 0], [70, 71, 0]])
    t = build_tree_table(req, rows, prefix, extra, int(prefix.max())).table  # lists of 3, 1 and 2 extra slots
    assert t.dtype == req.dtype and t.shape == (3, 8)
    assert t[0, :8].tolist() == [50, 51, 52, 53, 54, 90, 91, 92]
    assert t[1, :4].tolist() == [0, 1, 2, 80]
    assert t[2, :2].tolist() == [70, 71]


def test_selection_keeps_parents_and_orders_them_first():
    # candidates: the root (token 7), 2 at depth 1 (scores -1, -3), 4 at depth 2 under candidate 1 / 2
    tok = torch.tensor([[7, 10, 11, 12, 13, 14, 15]])
    score = torch.tensor([[float("inf"), -1.0, -3.0, -1.5, -1.0, -3.5, -9.0]])  # a child ties its parent (-1.0)
    parent = torch.tensor([[-1, 0, 0, 1, 1, 2, 2]])
    depth = torch.tensor([[0, 1, 1, 2, 2, 2, 2]])
    unselected = torch.full((1, 8), -1)
    tokens, parents, depths = _select(tok, score, parent, depth, unselected, torch.arange(5)[None]).tolist()
    assert tokens[0] == [7, 10, 11, 12, 13] and parents[0] == [-1, 0, 0, 1, 1] and depths[0] == [0, 1, 1, 2, 2]


CPU_TRITON = pytest.mark.skipif(torch.cuda.is_available(), reason="flashinfer-decode's verify forwards run Triton on "
                                "CPU tensors (the interpreter)")


@pytest.mark.parametrize("decode_only,graphs", [(False, False), pytest.param(True, False, marks=CPU_TRITON),
                                                pytest.param(True, True, marks=CPU_TRITON)],
                         ids=["flashinfer", "flashinfer-decode", "flashinfer-decode-graphs"])
def test_flashinfer_page_table_path_identical(monkeypatch, decode_only, graphs):
    """Speculative decoding over the FlashInfer backend: tree forwards' KV lists become page tables; with
    decode_only ('flashinfer-decode') the verify forwards run the Triton backend and the draft's decode steps
    FlashInfer's. With graphs (padded static batches, run eagerly on CPU) the tree forwards run from the request
    table's scratch rows, which the graph wrappers read in place."""
    off = Engine(model="tiny", **FLAGS)
    ps = prompts(off.config.vocab_size, n=4, seed=6)
    sp = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    ref = off.generate(input_ids=ps, sampling_params=sp)
    fake_flashinfer.install(monkeypatch)
    eng = Engine(model="tiny", **FLAGS, **SPEC)
    r, cfg = eng.runner, eng.runner.config
    r.forward_ctx.attn_backend = fi.FlashInferAttentionBackend(
        cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.softmax_scale, torch.float32,
        torch.float32, 1.0, r.device, r.req_to_token.table.shape[1], decode_only=decode_only, max_graph_bs=16)
    if graphs:
        r.build_graph_runner([1, 2, 4, 8, 16], capture=False)
    before = fake_flashinfer.BatchMLAPagedAttentionWrapper.plans + fake_flashinfer.BatchMLAPagedAttentionWrapper.replans
    got = eng.generate(input_ids=ps, sampling_params=sp)
    assert fake_flashinfer.BatchMLAPagedAttentionWrapper.plans + fake_flashinfer.BatchMLAPagedAttentionWrapper.replans \
        > before
    assert r.forward_ctx.attn_backend.in_place is (True if graphs else None)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
