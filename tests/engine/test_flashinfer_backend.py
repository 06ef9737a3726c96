"""The FlashInfer MLA backend on CPU: its metadata, its start-up checks, and its plumbing through the
whole model against the torch reference, with `tests/engine/fake_flashinfer.py` standing in for the
real kernels (which tests/gpu/test_flashinfer.py runs on a GPU)."""

import importlib.util
import logging

import pytest
import torch

from engine.engine import Engine
from engine.errors import UsageError
from engine.model import attention_flashinfer as fi
from engine.sampling import SamplingParams
from tests.engine import fake_flashinfer


def test_csr_lengths():
    qo, kv, lens = fi.csr_lengths([3, 1, 5], [10, 1, 7])
    assert qo.tolist() == [0, 3, 4, 9] and kv.tolist() == [0, 10, 11, 18] and lens.tolist() == [10, 1, 7]
    assert {qo.dtype, kv.dtype, lens.dtype} == {torch.int32} and qo.device.type == "cpu"


def test_kv_page_indices_gathers_each_requests_slots():
    g = torch.Generator().manual_seed(0)
    table = torch.randint(1, 10_000, (9, 50), generator=g, dtype=torch.int32)
    rows = torch.tensor([4, 0, 4, 8, 2])  # a row may repeat (padding rows do)
    lens = torch.randint(1, 51, (5,), generator=g)
    total = int(lens.sum())
    want = torch.cat([table[r, :n] for r, n in zip(rows.tolist(), lens.tolist())])
    got = fi.kv_page_indices(table, rows, lens, total)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    out = torch.full((total + 7,), -1, dtype=torch.int32)
    view = fi.kv_page_indices(table, rows, lens, total, out)
    assert torch.equal(view, want) and view.data_ptr() == out.data_ptr() and (out[total:] == -1).all()


CUDA = torch.device("cuda")
# flashinfer-decode's other forwards run its Triton backend, here on CPU tensors: Triton's interpreter
CPU_TRITON = pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton fallback on CPU tensors (the "
                                "interpreter); on a GPU tests/gpu/test_flashinfer.py runs flashinfer-decode")


@pytest.mark.parametrize("kw,needle", [
    (dict(device=torch.device("cpu")), "needs a CUDA GPU"),
    (dict(dtype=torch.float32), "--dtype bfloat16"),
    (dict(kv_dtype=torch.float8_e5m2), "--kv-cache-dtype fp8_e4m3"),
    (dict(kv_lora_rank=128, rope_dim=32), "kv_lora_rank 512 + rope 64"),
])
def test_unsupported_setups_are_rejected_with_a_fix(monkeypatch, kw, needle):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else None)
    args = dict(device=CUDA, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, kv_lora_rank=512, rope_dim=64)
    fi.check_supported(**args)  # the DeepSeek setup passes
    with pytest.raises(UsageError, match="--attention-backend") as err:
        fi.check_supported(**{**args, **kw})
    assert needle in str(err.value)


def test_missing_flashinfer_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UsageError, match="pip install flashinfer-python.*--attention-backend triton"):
        fi.check_supported(CUDA, torch.bfloat16, torch.bfloat16, 512, 64)


def test_alias_conflicts_with_another_backend():
    with pytest.raises(UsageError, match="--enable-flashinfer-mla .* --attention-backend triton"):
        Engine(model="tiny", device="cpu", enable_flashinfer_mla=True, attention_backend="triton")


def _generate(eng, prompts, n=6):
    sp = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
    return [(o.token_ids, o.logprobs) for o in eng.generate(input_ids=prompts, sampling_params=sp)]


def _rounds(eng):
    """Three rounds: fresh prompts, then prompts sharing cached prefixes (extend over a prefix), then decode-heavy."""
    g = torch.Generator().manual_seed(1)
    base = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 9, 40)]
    second = [base[0] + [5, 6, 7], base[2][:30] + [1, 2], base[1]]
    return _generate(eng, base) + _generate(eng, second) + _generate(eng, [[3, 4]], n=20)


def _fake_backend_engine(monkeypatch, **backend_kw):
    """The torch reference's outputs of `_rounds`, and an engine whose attention is the FlashInfer backend over
    tests/engine/fake_flashinfer.py (float32, tiny)."""
    kw = dict(model="tiny", device="cpu", dtype="float32", attention_backend="torch", moe_backend="torch")
    ref = _rounds(Engine(**kw))
    eng, backend = _fake_engine(monkeypatch, kw, **backend_kw)
    return ref, eng, backend


def _fake_engine(monkeypatch, engine_kw: dict, internals: bool = True, **backend_kw):
    """An engine whose attention is the FlashInfer backend over tests/engine/fake_flashinfer.py, and that backend."""
    fake_flashinfer.install(monkeypatch, internals)
    eng = Engine(**engine_kw)
    r, cfg = eng.runner, eng.runner.config
    backend = fi.FlashInferAttentionBackend(cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                            cfg.softmax_scale, torch.float32, torch.float32, 1.0, r.device,
                                            r.req_to_token.table.shape[1], **backend_kw)
    r.forward_ctx.attn_backend = backend
    return eng, backend


def _assert_same(ref, got) -> None:
    for (rt, rl), (gt, gl) in zip(ref, got):
        assert gt == rt
        assert max(abs(a - b) for a, b in zip(gl, rl)) < 1e-4  # float32: absorbed vs expanded rounding only


def test_backend_plumbing_matches_torch_reference(monkeypatch):
    ref, eng, _ = _fake_backend_engine(monkeypatch)
    before = fake_flashinfer.BatchMLAPagedAttentionWrapper.plans
    got = _rounds(eng)
    assert fake_flashinfer.BatchMLAPagedAttentionWrapper.plans - before >= 3 + 20  # one plan per forward
    _assert_same(ref, got)


@CPU_TRITON
def test_decode_only_runs_extends_on_triton(monkeypatch):
    """'flashinfer-decode': decode forwards are planned and run by FlashInfer, every extend (fresh prompts, prompts
    over a cached prefix) by the Triton backend it keeps; outputs equal the torch reference's."""
    ref, eng, backend = _fake_backend_engine(monkeypatch, decode_only=True)
    modes = []
    plan = backend.begin_forward

    def begin_forward(fb, ctx, graph_bs=None):
        before = fake_flashinfer.BatchMLAPagedAttentionWrapper.plans
        plan(fb, ctx, graph_bs)
        modes.append((fb.mode.is_decode, fake_flashinfer.BatchMLAPagedAttentionWrapper.plans - before,
                      backend.active is None))

    monkeypatch.setattr(backend, "begin_forward", begin_forward)
    got = _rounds(eng)
    assert any(not d for d, _, _ in modes) and any(d for d, _, _ in modes)
    assert all(plans == (1 if decode else 0) and fallback == (not decode) for decode, plans, fallback in modes)
    _assert_same(ref, got)


@CPU_TRITON
def test_decode_only_leaves_the_batch_sizes_a_tuned_table_gives_triton(monkeypatch, caplog):
    """'flashinfer-decode' with this GPU's MLA decode table (`dsctl tune-mla`) saying the Triton kernel is faster at
    one request: those decode steps run the Triton backend (no FlashInfer plan), the others FlashInfer; outputs equal
    the torch reference's. The full 'flashinfer' backend ignores the table."""
    kw = dict(model="tiny", device="cpu", dtype="float32", attention_backend="torch", moe_backend="torch")
    prompts = [[5, 9, 11, 2], [7, 1], [3, 4, 8]]

    def rounds(eng):
        return _generate(eng, prompts, n=4) + _generate(eng, prompts[:1], n=4)

    ref = rounds(Engine(**kw))
    monkeypatch.setattr(fi, "tuned_entry", lambda rows, kv, batch, device: {"FLASHINFER": int(batch > 1)})
    with caplog.at_level(logging.INFO, logger=fi.__name__):
        eng, backend = _fake_engine(monkeypatch, kw, decode_only=True)
    assert "for decode batch sizes near 1: those steps decode with Triton" in caplog.text  # said at start-up
    steps = []
    plan = backend.begin_forward

    def begin_forward(fb, ctx, graph_bs=None):
        before = fake_flashinfer.BatchMLAPagedAttentionWrapper.plans
        plan(fb, ctx, graph_bs)
        if fb.mode.is_decode:
            steps.append((fb.batch_size, fake_flashinfer.BatchMLAPagedAttentionWrapper.plans - before))

    monkeypatch.setattr(backend, "begin_forward", begin_forward)
    got = rounds(eng)
    assert {bs for bs, _ in steps} == {1, 3}
    assert all(plans == (0 if bs == 1 else 1) for bs, plans in steps)
    _assert_same(ref, got)
    assert backend.decodes_at(1) is False and backend.decodes_at(8) is True
    backend.decode_only = False
    assert backend.decodes_at(1) is True


@pytest.mark.parametrize("internals", [True, False], ids=["in-place", "gathered"])
def test_graph_batches_plan_over_the_request_table(monkeypatch, internals):
    """Decode through padded static (CUDA-graph) batches, graphs run eagerly on CPU: with FlashInfer 0.7's planner
    internals the graph wrappers read the request table in place (no page buffer of their own; the raw planner
    re-plans every step and the backend copies its schedule), without them they gather each step's pages and plan
    through plan(). Greedy tokens and log-probs equal the torch reference's either way."""
    kw = dict(model="tiny", device="cpu", dtype="float32", attention_backend="torch", moe_backend="torch")
    ref = _rounds(Engine(**kw))
    eng, backend = _fake_engine(monkeypatch, kw, internals=internals, max_graph_bs=4)
    eng.runner.build_graph_runner([1, 2, 4], capture=False)
    wrapper_cls = fake_flashinfer.BatchMLAPagedAttentionWrapper
    plans, replans = wrapper_cls.plans, wrapper_cls.replans
    table = eng.runner.req_to_token.table.clone()
    got = _rounds(eng)
    assert backend.in_place is internals and set(backend.graph_wrappers) <= {1, 2, 4} and backend.graph_wrappers
    if internals:
        assert backend.graph_indices is None and wrapper_cls.replans - replans >= 20
        assert wrapper_cls.plans - plans == len(backend.graph_wrappers) + 3  # one per new wrapper, per round's prefill
    else:
        assert backend.graph_indices is not None and wrapper_cls.replans == replans
    assert eng.runner.req_to_token.table.shape == table.shape
    _assert_same(ref, got)
