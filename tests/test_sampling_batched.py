"""The batched sampler (engine/sampling.py) against a plain per-row reference written here.

The reference applies each definition to one row at a time with Python loops over the row's tokens:
repetition penalty (CTRL / HF: divide a positive logit, multiply a negative one, over prompt + output),
presence / frequency penalties (OpenAI: minus presence once for a token in the output, minus frequency
times its count), logit_bias, min_tokens bans, then temperature, top-k, min-p, top-p. Greedy rows must
match exactly; rows that sample are compared by their distributions, and by a chi-square test of many
draws.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.sampling import History, SampleResult, SamplingParams, adjusted_logits, distribution, sample_async
from engine.scheduler.processor import OutputProcessor
from engine.scheduler.request import Request
from tests.scheduler.test_output_processor import EOS, TOK

V = 50
EOS_ID = 3


# ---- reference ----------------------------------------------------------------------------------------
def ref_adjust(row: torch.Tensor, p: SamplingParams, ids: list[int], prompt_len: int) -> torch.Tensor:
    x = row.double().clone()
    for t in set(ids):
        if p.repetition_penalty != 1:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(ids[prompt_len:]).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    for t, b in p.logit_bias.items():
        x[t] += b
    if len(ids) - prompt_len < p.min_tokens:
        banned = x.clone()
        for t in p.stop_token_ids + ([] if p.ignore_eos else [EOS_ID]):
            banned[t] = -math.inf
        if banned.max() > -math.inf:
            x = banned
    return x


def ref_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The normalised distribution of one row (float64) after temperature, top-k, min-p, top-p."""
    probs = torch.softmax(x / p.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_k > 0:
        keep &= probs >= probs.topk(p.top_k).values[-1]
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    if p.top_p < 1:
        mass = 0.0
        for t in probs.argsort(descending=True).tolist():
            if not keep[t]:
                continue
            if mass > p.top_p:
                keep[t] = False
            mass += float(probs[t])
    probs = torch.where(keep, probs, 0)
    return probs / probs.sum()


# ---- inputs -------------------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(seed: int, n: int = 8):
    g = _gen(seed)
    logits = torch.randn(n, V, generator=g) * 2
    logits[1, torch.randperm(V, generator=g)[:10]] = -math.inf  # a grammar mask
    ids = [torch.randint(0, V, (int(torch.randint(3, 12, (), generator=g)),), generator=g).tolist() for _ in range(n)]
    prompt_lens = [len(t) // 2 for t in ids]
    masked = (logits[1] == -math.inf).nonzero()[:, 0].tolist()
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0.8, top_k=7, repetition_penalty=0.6, frequency_penalty=0.4, seed=1,
                       logit_bias={masked[0]: 50.0, 5: -3.0}),
        SamplingParams(temperature=1.2, top_p=0.6, presence_penalty=1.1, frequency_penalty=-0.7, seed=2),
        SamplingParams(temperature=0.7, min_p=0.1, logit_bias={9: 8.5}),
        SamplingParams(temperature=1.0, min_tokens=50, stop_token_ids=[11, 12], seed=4),
        SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.02, presence_penalty=-1.3, seed=5),
        SamplingParams(temperature=0, frequency_penalty=1.5, min_tokens=50, ignore_eos=True, stop_token_ids=[13]),
        SamplingParams(temperature=1.5),
    ][:n]
    return logits, params, History(ids, prompt_lens, [0] * n, eos_ids=(EOS_ID,))


def _reference(logits, params, history) -> list[torch.Tensor]:
    return [ref_adjust(logits[i], p, list(history.token_ids[i]), history.prompt_lens[i]) for i, p in enumerate(params)]


# ---- tests --------------------------------------------------------------------------------------------
def test_penalties_as_defined_on_a_small_row():
    """Hand-computed: prompt [2], output [0, 0, 1]; logits 2, -2, 1, 0.5."""
    row = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    hist = History([[2, 0, 0, 1]], [1], [0])
    rep = adjusted_logits(row, [SamplingParams(repetition_penalty=2.0)], hist)
    torch.testing.assert_close(rep, torch.tensor([[1.0, -4.0, 0.5, 0.5]]))
    fp = adjusted_logits(row, [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)], hist)
    torch.testing.assert_close(fp, torch.tensor([[2.0 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 1.0, 0.5]]))
    bias = adjusted_logits(row, [SamplingParams(logit_bias={3: -1.5, 1: 100.0})], None)
    torch.testing.assert_close(bias, torch.tensor([[2.0, 98.0, 1.0, -1.0]]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adjusted_logits_match_the_reference(seed):
    logits, params, hist = _batch(seed)
    got = adjusted_logits(logits.clone(), params, hist)
    for i, want in enumerate(_reference(logits, params, hist)):
        torch.testing.assert_close(got[i].double(), want, msg=f"row {i}")
    assert (got[1] == -math.inf).sum() == 10  # masked stays masked; the +50 bias cannot revive -inf


def test_the_token_in_flight_counts_as_output():
    logits, params, hist = _batch(3)
    extra = torch.randint(0, V, (len(params),), generator=_gen(9))
    extra[0] = -1  # row 0 has no token in flight
    flight = History(hist.token_ids, hist.prompt_lens, [0] + [1] * (len(params) - 1), extra, hist.eos_ids)
    host = History([list(t) + ([int(extra[i])] if i else []) for i, t in enumerate(hist.token_ids)],
                   hist.prompt_lens, [0] * len(params), eos_ids=hist.eos_ids)
    torch.testing.assert_close(adjusted_logits(logits, params, flight), adjusted_logits(logits, params, host))


@pytest.mark.parametrize("seed,rows", [(0, None), (1, None), (2, [1, 5]), (3, [1, 5, 2])])
def test_distributions_match_the_reference(seed, rows):
    """Whole batches (a full sort), rows that all have a small top_k (a partial sort), and no sort at all."""
    logits, params, hist = _batch(seed)
    x = adjusted_logits(logits, params, hist)
    want = [ref_probs(xi, p) if not p.greedy else None for p, xi in zip(params, _reference(logits, params, hist))]
    rows = rows or [i for i, p in enumerate(params) if not p.greedy]
    probs, order = distribution(x[rows], [params[i] for i in rows])
    if order is not None:
        assert order.shape[1] == (12 if rows == [1, 5] else V)  # partial sort: the largest top_k
        probs = torch.zeros(len(rows), V).scatter_(1, order, probs)
    probs = probs / probs.sum(-1, keepdim=True)
    for j, i in enumerate(rows):
        torch.testing.assert_close(probs[j].double(), want[i], atol=1e-6, rtol=1e-5, msg=f"row {i}")
    plain = [SamplingParams(temperature=0.6, min_p=0.05), SamplingParams(temperature=1.1)]
    probs, order = distribution(x[:2], plain)
    assert order is None
    for j, p in enumerate(plain):
        torch.testing.assert_close((probs[j] / probs[j].sum()).double(), ref_probs(x[j].double(), p))


def test_greedy_rows_are_the_argmax_of_the_adjusted_logits():
    logits, params, hist = _batch(4)
    got = sample_async(logits, params, [None] * len(params), hist).resolve()
    ref = _reference(logits, params, hist)
    for i, p in enumerate(params):
        if p.greedy:
            assert got.tokens[i] == int(ref[i].argmax())


def test_draws_follow_the_distribution():
    """Chi-square over many rows that share one row's logits and params (seeded and not)."""
    logits, params, hist = _batch(5)
    n = 3000
    for i in (1, 2, 5):
        p = params[i]
        want = ref_probs(_reference(logits, params, hist)[i], p)
        rows = [SamplingParams(**{**p.__dict__, "seed": None})] * n
        gens = [_gen(k) if k % 2 else None for k in range(n)]
        h = History([hist.token_ids[i]] * n, [hist.prompt_lens[i]] * n, [0] * n, eos_ids=(EOS_ID,))
        toks = sample_async(logits[i].expand(n, V).contiguous(), rows, gens, h).resolve().tokens
        counts = torch.bincount(torch.tensor(toks), minlength=V).double()
        assert counts[want == 0].sum() == 0, f"row {i} drew a token it cannot sample"
        live = want > 0
        chi2 = float(((counts[live] - n * want[live]) ** 2 / (n * want[live])).sum())
        dof = int(live.sum()) - 1
        assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, f"row {i}: chi2 {chi2:.1f} with {dof} dof"


def test_a_seeded_row_does_not_depend_on_its_batch():
    g = _gen(7)
    mine = SamplingParams(temperature=0.9, top_p=0.9, frequency_penalty=0.3, seed=42)
    runs = []
    for others, at in ((0, 0), (5, 3), (2, 2)):
        gens_mine = _gen(42)
        toks = []
        for step in range(6):
            row = torch.randn(V, generator=_gen(100 + step))
            logits = torch.randn(others + 1, V, generator=g)
            logits[at] = row
            params = [SamplingParams(temperature=1.0, seed=None)] * (others + 1)
            params[at] = mine
            gens = [None] * (others + 1)
            gens[at] = gens_mine
            hist = History([[1, 2] + toks] * (others + 1), [2] * (others + 1), [0] * (others + 1))
            toks.append(sample_async(logits, params, gens, hist).resolve().tokens[at])
        runs.append(toks)
    assert runs[0] == runs[1] == runs[2]


def test_min_tokens_bans_stops_until_reached_but_never_empties_a_row():
    logits = torch.randn(3, V, generator=_gen(11))
    logits[:, EOS_ID] = 40.0
    logits[:, 11] = 30.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[11])
    hist = History([[1, 2, 5], [1, 2, 5, 6], [1, 2]], [1, 1, 2], [0, 1, 0], eos_ids=(EOS_ID,))
    got = sample_async(logits, [p] * 3, [None] * 3, hist).resolve().tokens
    assert got[0] not in (EOS_ID, 11) and got[1] == EOS_ID and got[2] not in (EOS_ID, 11)
    only_eos = torch.full((1, V), -math.inf)
    only_eos[0, EOS_ID] = 0.0  # a grammar that allows only EOS: the ban gives way
    got = sample_async(only_eos, [p], [None], History([[1]], [1], [0], eos_ids=(EOS_ID,))).resolve().tokens
    assert got == [EOS_ID]


def test_top_logprobs_are_of_the_raw_distribution():
    logits, params, hist = _batch(6, n=4)
    params = [SamplingParams(**{**p.__dict__, "top_logprobs": k}) for p, k in zip(params, (0, 3, 5, 1))]
    got = sample_async(logits, params, [None] * 4, hist).resolve()
    logp = torch.log_softmax(logits, -1)
    for i, k in enumerate((0, 3, 5, 1)):
        assert [t for t, _ in got.top[i]] == logp[i].topk(k).indices.tolist() if k else got.top[i] == []
        assert got.logprobs[i] == pytest.approx(float(logp[i, got.tokens[i]]), abs=1e-5)


def test_the_processor_ignores_stops_before_min_tokens():
    """EOS and stop strings before min_tokens do not end the request; the stop string found after does."""
    proc = OutputProcessor(TOK, {EOS}, 64)
    # tokens: "ST" "OP" EOS "a" "S" "TOP" -> "STOP" completes first at token 2, again at token 6
    stream = [5, 6, EOS, 0, 7, 8]
    req = Request.new("r", [0], SamplingParams(min_tokens=4, stop=["STOP"], max_new_tokens=10, ignore_eos=False))
    for tok in stream:
        if not req.finished:
            proc.process([req], SampleResult([tok], [0.0], [[]]))
    assert req.finish_reason == "stop" and req.num_output == 6 and req.matched_stop == "STOP"


def test_overlap_scheduling_counts_the_token_in_flight():
    """One tiny engine, the same batch with and without overlap scheduling: with overlap each step's previous
    token is still on the device when the next is sampled, and the penalties must see it (they do not when
    History drops it: the outputs then differ)."""
    from engine.engine import Engine  # lazy: builds a model; only this test needs one
    from tests.scheduler.helpers import swap_scheduler  # lazy: with the engine above

    engine = Engine(model="tiny", device="cpu", dtype="float32")
    ids = [engine.encode("again and again"), engine.encode("other prompt")]
    params = [SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, frequency_penalty=1.5,
                             presence_penalty=0.5, logit_bias={66: 3.0}),
              SamplingParams(temperature=0.9, max_new_tokens=10, seed=3, repetition_penalty=1.5,
                             logit_bias={66: 2.0}, min_tokens=10)]
    outs = []
    for off in (False, True):
        assert swap_scheduler(engine, disable_overlap_schedule=off).overlap is not off
        outs.append([o.token_ids for o in engine.generate(input_ids=ids, sampling_params=params)])
    assert outs[0] == outs[1]


# ---- no host <-> device sync ---------------------------------------------------------------------------
_ATEN = torch.ops.aten
_READS_DEVICE_VALUES = {_ATEN._local_scalar_dense, _ATEN.nonzero, _ATEN.masked_select, _ATEN.multinomial,
                        _ATEN._unique2, _ATEN.unique_dim, _ATEN.unique_consecutive}  # item / tolist, data-sized
_WRITES = {_ATEN.index_put_, _ATEN.index_put, _ATEN._index_put_impl_, _ATEN.copy_}
_INDEXING = {_ATEN.index, _ATEN.index_put_, _ATEN.index_put, _ATEN._index_put_impl_}  # (self, [indices], ...)


class _SyncSpy(TorchDispatchMode):
    """On CPU, the GPU's sync-debug mode: follows which tensors stand for device ones (the logits, the token in
    flight, what tensor_to_device returns, and whatever is computed from those or written from them) and
    records each op that makes a GPU wait: a device value read on the host (item / tolist, nonzero, a bool
    mask, unique / multinomial / repeat_interleave with data-sized outputs), or host data written into a
    device tensor other than by tensor_to_device's pinned copy (e.g. `t[keys] = -inf`: a host scalar)."""

    def __init__(self, *device_tensors):
        super().__init__()
        self.device, self.syncs = {}, []
        for t in device_tensors:
            self.mark(t)

    def mark(self, t):
        if isinstance(t, torch.Tensor):
            self.device[id(t)] = t  # holds t: its id is not reused while the spy lives
        return t

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        dev = any(map(self.on_device, inputs))
        op = func.overloadpacket
        indices = args[1] if op in _INDEXING else []
        bool_index = any(t is not None and t.dtype == torch.bool for t in indices)
        if dev and (op in _READS_DEVICE_VALUES or bool_index
                    or (op is _ATEN.repeat_interleave and kwargs.get("output_size") is None)):
            self.syncs.append(str(func))
        if op in _WRITES and self.on_device(args[0]) and not self.on_device(args[2 if op is not _ATEN.copy_ else 1]):
            self.syncs.append(f"{func} of host data")
        out = func(*args, **kwargs)
        if dev:
            for t in tree_flatten(out)[0]:
                self.mark(t)
        return out


def test_the_sampler_never_waits_for_the_device(monkeypatch):
    """Every parameter at once (the GPU test's rows, below) with a token in flight: no op that syncs on a GPU."""
    import engine.sampling

    n, v = 8, 300
    g = _gen(0)
    logits = torch.randn(n, v, generator=g) * 3
    ids = [torch.randint(0, v, (40,), generator=g).tolist() for _ in range(n)]
    params = [SamplingParams(**_EVERY_KIND[i % 4]) for i in range(n)]
    gens = [_gen(7) if p.seed is not None else None for p in params]
    hist = History(ids, [20] * n, [1] * n, torch.randint(0, v, (n,), generator=g), (EOS_ID,))
    want = sample_async(logits, params, [None] * n, hist).resolve()
    spy = _SyncSpy(logits, hist.in_flight)
    real = engine.sampling.tensor_to_device
    monkeypatch.setattr(engine.sampling, "tensor_to_device", lambda t, device: spy.mark(real(t, device)))
    with spy:
        pending = sample_async(logits, params, gens, hist)
    assert spy.syncs == []
    got = pending.resolve()  # (the host reads the results after the step, as the scheduler does)
    assert [t for t, p in zip(got.tokens, params) if p.greedy] == [t for t, p in zip(want.tokens, params) if p.greedy]
    with _SyncSpy(logits) as spy:  # the spy sees a sync where there is one
        logits[logits > 0].sum().item()  # a bool mask, then item
        logits.view(-1)[torch.tensor([1, 5])] = -math.inf  # index_put_ of a host scalar (the sampler did it)
    assert len(spy.syncs) == 3, spy.syncs


_EVERY_KIND = [dict(temperature=0, repetition_penalty=1.3), dict(temperature=0.8, top_p=0.9, top_k=40, seed=3),
               dict(temperature=1.0, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.5, logit_bias={5: 3.0}),
               dict(temperature=0.7, min_tokens=500, stop_token_ids=[9], top_logprobs=5)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_sampler_never_waits_for_the_device():
    """Every parameter at once, with a token in flight, at a real vocabulary: no host<->device sync (the
    overlap scheduler queues the next step behind it), and greedy rows equal the CPU result."""
    n, v = 64, 129280
    g = _gen(0)
    logits = (torch.randn(n, v, generator=g) * 3).cuda()
    ids = [torch.randint(0, v, (200,), generator=g).tolist() for _ in range(n)]
    params = [SamplingParams(**_EVERY_KIND[i % 4]) for i in range(n)]
    gens = [_gen(7) if p.seed is not None else None for p in params]
    flight = torch.randint(0, v, (n,), generator=g).cuda()
    hist = History(ids, [100] * n, [1] * n, flight, (EOS_ID,))
    sample_async(logits, params, gens, hist)  # warm-up (allocations, kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sample_async(logits, params, gens, hist)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = pending.start_copy().resolve()
    cpu_hist = History(ids, [100] * n, [1] * n, flight.cpu(), (EOS_ID,))
    want = sample_async(logits.cpu(), params, [None] * n, cpu_hist).resolve()
    assert [t for t, p in zip(got.tokens, params) if p.greedy] == [t for t, p in zip(want.tokens, params) if p.greedy]
