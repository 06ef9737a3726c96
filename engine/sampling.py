"""Sampling parameters and token sampling, batched on the device.

`sample_async` takes the logits [N, V] of one step and, with per-row parameter tensors for the
whole batch (no per-request pass over the vocabulary), in this order:

1. penalties: repetition (CTRL / HF: a positive logit is divided by it, a negative one multiplied,
   for every token of the prompt and the output), then presence (minus it once for every token that
   appears in the output) and frequency (minus it times the token's count in the output), as in the
   OpenAI API; then `logit_bias` (added);
2. min_tokens: EOS and the stop token ids at -inf until that many tokens were generated (not when
   that would leave the row with no token at all);
3. temperature, then top-k, min-p and top-p (in the probabilities of that distribution);
4. one token per row by inverse-CDF from one uniform per row. A row with a seed draws its uniform
   from its own torch.Generator, so its output does not depend on which other requests share the
   batch; other rows draw from the global generator. Greedy rows (temperature 0 or top-k 1) take
   the argmax of the adjusted logits.

Penalties and bans work on the flat logits at (row, token) keys (no [N, V] count tensor): a
repetition or presence penalty reads the values at its keys and writes the new values back (a token
seen many times is written many times with the same value), a frequency penalty adds its value once
per occurrence. A masked logit (-inf, from a grammar) stays -inf under every step.

Log-probabilities are those of the model's raw distribution (before any of the above).
`sample_async` leaves its results on the device (the overlap scheduler feeds the sampled tokens
straight into the next decode step); `PendingSample.start_copy()` queues the device->host copies
right after the step with a CUDA event, so `resolve()` waits only for that step, not for the next
one already queued behind it.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from engine.errors import RequestError
from engine.forward_batch import tensor_to_device

MAX_LOGIT_BIAS = 100.0
PARTIAL_SORT_MAX_K = 1024  # rows with top_k up to this take a partial sort (topk), the rest a full one


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # no EOS / stop token id / stop string before this many output tokens
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: bool = False  # per output token log-prob of the chosen token
    top_logprobs: int = 0  # also the n most likely alternatives at each step
    prompt_logprobs: bool = False
    skip_special_tokens: bool = True

    def validate(self) -> "SamplingParams":
        checks = [
            (self.max_new_tokens >= 0, f"max_new_tokens must be >= 0 (got {self.max_new_tokens})"),
            (self.temperature >= 0 and math.isfinite(self.temperature),
             f"temperature must be a finite number >= 0 (got {self.temperature})"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})"),
            (self.top_k >= -1, f"top_k must be -1 (disabled) or >= 0 (got {self.top_k})"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p})"),
            (0 <= self.top_logprobs <= 20, f"top_logprobs must be in [0, 20] (got {self.top_logprobs})"),
            (0 <= self.min_tokens, f"min_tokens must be >= 0 (got {self.min_tokens})"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2] (got {self.frequency_penalty})"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2] (got {self.presence_penalty})"),
            (0 < self.repetition_penalty <= 2, f"repetition_penalty must be in (0, 2] (got {self.repetition_penalty})"),
        ]
        for ok, msg in checks:
            if not ok:
                raise RequestError(msg)
        for tok, bias in self.logit_bias.items():
            if not (isinstance(tok, int) and tok >= 0):
                raise RequestError(f"logit_bias keys must be token ids >= 0 (got {tok!r})")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias values must be in [-100, 100] (got {bias} for token {tok})")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1)

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's tokens (penalties, min_tokens)."""
        return self.penalized or self.min_tokens > 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything besides temperature and truncation changes the logits."""
        return self.needs_history or bool(self.logit_bias)


@dataclass
class History:
    """Per row of a batch, what penalties and min_tokens read besides the params."""

    token_ids: list[Sequence[int]]  # the prompt, then the output tokens known on the host
    prompt_lens: list[int]
    pending: list[int]  # output tokens sampled but not in token_ids yet (0 or 1)
    in_flight: Optional[torch.Tensor] = None  # [N] int64 on the device: that token, -1 where none
    eos_ids: tuple[int, ...] = ()

    def num_output(self, i: int) -> int:
        return len(self.token_ids[i]) - self.prompt_lens[i] + self.pending[i]


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]  # log-prob of each chosen token under the raw distribution
    top: list[list[tuple[int, float]]]  # per row: top alternatives (empty unless asked)


@dataclass
class PendingSample:
    tokens: torch.Tensor  # [N] int64 on the logits' device (the next step may read them there)
    logprobs: torch.Tensor  # [N] float32
    top: Optional[tuple[torch.Tensor, torch.Tensor]]  # (ids, log-probs) [N, kmax] for the largest top_logprobs
    top_counts: list[int]  # per row: how many alternatives it asked for
    host: Optional[tuple] = None
    ready: Optional[object] = None  # torch.cuda.Event

    def start_copy(self) -> "PendingSample":
        if self.tokens.device.type != "cuda":
            self.host = (self.tokens, self.logprobs, self.top)
            return self
        cpu = lambda t: t.to("cpu", non_blocking=True)  # noqa: E731
        self.host = (cpu(self.tokens), cpu(self.logprobs), None if self.top is None else tuple(map(cpu, self.top)))
        self.ready = torch.cuda.Event()
        self.ready.record()
        return self

    def resolve(self) -> SampleResult:
        if self.host is None:
            self.start_copy()
        if self.ready is not None:
            self.ready.synchronize()
        tokens, logprobs, top = self.host
        ids, lps = (top[0].tolist(), top[1].tolist()) if top is not None else ([], [])
        return SampleResult(tokens=tokens.tolist(), logprobs=logprobs.tolist(),
                            top=[list(zip(ids[i][:k], lps[i][:k])) if k else [] for i, k in enumerate(self.top_counts)])


# ---- truncation ---------------------------------------------------------------------------------------
def truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: Optional[torch.Tensor],
             sort: Optional[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Zero the tokens that top-k (<= 0: off), min-p (None: off for every row) and top-p remove from probs
    [N, V] (float32), per row. (Which steps run is decided from host values: no device sync.)

    `sort` None: no row has top-k or top-p; the result is in token order, with None. Else the result is
    in descending order, returned with the order (result[i, j] is the probability of token order[i, j]):
    sort 0 sorts whole rows; sort k > 0 keeps only each row's k most likely tokens (every row has
    0 < top_k <= k), a partial sort, much cheaper. Ties with the k-th value are kept (with sort k > 0,
    up to k of them); top-p keeps the smallest prefix whose mass reaches top_p (of the untruncated mass)."""
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0)
    if sort is None:
        return probs, None
    sp, order = probs.topk(sort, dim=-1) if sort else probs.sort(dim=-1, descending=True)
    v = sp.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=v), v)
    sp = sp.masked_fill(sp < sp.gather(1, (k - 1)[:, None]), 0)
    keep_p = torch.where(top_p < 1, top_p, math.inf)  # rounding in cumsum must not cut rows without top-p
    cum = sp.cumsum(-1)
    sp = sp.masked_fill((cum - sp) > keep_p[:, None], 0)
    return sp, order


def _truncate(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """`truncate` for one row (probs [V], float32) and its params, in token order (speculative decoding)."""
    dev = probs.device
    col = lambda value, dtype: tensor_to_device(torch.tensor([value], dtype=dtype), dev)  # noqa: E731  (no sync)
    sp, order = truncate(probs[None], col(p.top_k, torch.int64), col(p.top_p, torch.float32),
                         col(p.min_p, torch.float32) if p.min_p > 0 else None,
                         0 if p.top_k > 0 or p.top_p < 1 else None)
    if order is None:
        return sp[0]
    return torch.zeros_like(probs).scatter_(0, order[0], sp[0])


# ---- logit adjustments --------------------------------------------------------------------------------
def _ids(values: Sequence[int]) -> torch.Tensor:
    return torch.frombuffer(array("q", values), dtype=torch.int64) if len(values) else torch.empty(0, dtype=torch.int64)


def _row_values(values: list[float], default: float, device: torch.device) -> torch.Tensor:
    """Per-row values [N + 1] on the device; the extra row (the dummy key's) holds `default`."""
    return tensor_to_device(torch.tensor(values + [default], dtype=torch.float32), device)


def _keys(rows: list[int], ids: list[Sequence[int]], v: int) -> torch.Tensor:
    """Flat keys row * v + id for each row's ids (ids outside [0, v) dropped), on the host."""
    parts = []
    for r, t in zip(rows, ids):
        t = _ids(t)
        parts.append(t[(t >= 0) & (t < v)] + r * v)
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _in_flight_keys(rows: list[int], history: History, n: int, v: int, device: torch.device) -> torch.Tensor:
    """Keys of the rows' tokens still on the device; the dummy key n * v where a row has none."""
    if history.in_flight is None or not rows:
        return torch.empty(0, dtype=torch.int64, device=device)
    r = tensor_to_device(torch.tensor(rows, dtype=torch.int64), device)
    tok = history.in_flight[r]
    return torch.where((tok >= 0) & (tok < v), r * v + tok, n * v)


def _penalize(buf: torch.Tensor, n: int, v: int, params: list[SamplingParams], history: History) -> None:
    """Repetition, presence and frequency penalties on the flat logits buf [n * v + 1] (in place)."""
    dev = buf.device
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if rep:
        keys = torch.cat((tensor_to_device(_keys(rep, [history.token_ids[i] for i in rep], v), dev),
                          _in_flight_keys(rep, history, n, v, dev)))
        rp = _row_values([p.repetition_penalty for p in params], 1.0, dev)[keys // v]
        vals = buf[keys]
        buf[keys] = torch.where(vals > 0, vals / rp, vals * rp)
    out = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if out:
        outputs = [history.token_ids[i][history.prompt_lens[i]:] for i in out]
        keys = torch.cat((tensor_to_device(_keys(out, outputs, v), dev), _in_flight_keys(out, history, n, v, dev)))
        rows = keys // v
        if any(params[i].presence_penalty for i in out):
            buf[keys] = buf[keys] - _row_values([p.presence_penalty for p in params], 0.0, dev)[rows]
        if any(params[i].frequency_penalty for i in out):
            buf.index_add_(0, keys, -_row_values([p.frequency_penalty for p in params], 0.0, dev)[rows])


def _bias(buf: torch.Tensor, v: int, params: list[SamplingParams]) -> None:
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return
    keys, vals = [], []
    for i in rows:
        for tok, b in params[i].logit_bias.items():
            if 0 <= tok < v:
                keys.append(i * v + tok)
                vals.append(b)
    buf.index_add_(0, tensor_to_device(torch.tensor(keys, dtype=torch.int64), buf.device),
                   tensor_to_device(torch.tensor(vals, dtype=torch.float32), buf.device))


def _ban_stops(buf: torch.Tensor, x: torch.Tensor, v: int, params: list[SamplingParams], history: History) -> None:
    """min_tokens: EOS (unless ignore_eos) and stop token ids at -inf for rows short of it, unless that
    leaves a row with nothing to sample (then the row keeps its values)."""
    rows, ids = [], []
    for i, p in enumerate(params):
        if p.min_tokens and history.num_output(i) < p.min_tokens:
            rows.append(i)
            ids.append(list(p.stop_token_ids) + ([] if p.ignore_eos else list(history.eos_ids)))
    keys = _keys(rows, ids, v)
    if not keys.numel():
        return
    keys = tensor_to_device(keys, buf.device)
    vals = buf[keys]
    # a tensor, not the float: `buf[keys] = -inf` on a GPU copies the scalar from pageable host memory (a sync)
    buf[keys] = torch.full_like(vals, -math.inf)
    dead = torch.cat((x.amax(-1) == -math.inf, torch.zeros(1, dtype=torch.bool, device=buf.device)))
    buf[keys] = torch.where(dead[keys // v], vals, -math.inf)


def adjusted_logits(logits: torch.Tensor, params: list[SamplingParams],
                    history: Optional[History] = None) -> torch.Tensor:
    """The logits [N, V] after penalties, logit_bias and min_tokens bans (float32; a new tensor)."""
    n, v = logits.shape
    buf = torch.empty(n * v + 1, dtype=torch.float32, device=logits.device)  # the last entry: the dummy key
    x = buf[:n * v].view(n, v)
    x.copy_(logits)
    if history is not None and any(p.penalized for p in params):
        _penalize(buf, n, v, params, history)
    _bias(buf, v, params)
    if history is not None and any(p.min_tokens for p in params):
        _ban_stops(buf, x, v, params, history)
    return x


# ---- sampling -----------------------------------------------------------------------------------------
def _uniforms(generators: list[Optional[torch.Generator]], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row: from the row's generator where it has one, else the global one."""
    u = torch.rand(len(generators), device=device)
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return u
    host = [(i, float(torch.rand((), generator=g))) for i, g in seeded if g.device.type == "cpu"]
    dev = [(i, torch.rand((), generator=g, device=g.device)) for i, g in seeded if g.device.type != "cpu"]
    if host:
        rows = tensor_to_device(torch.tensor([i for i, _ in host], dtype=torch.int64), device)
        u[rows] = tensor_to_device(torch.tensor([x for _, x in host], dtype=torch.float32), device)
    if dev:
        rows = tensor_to_device(torch.tensor([i for i, _ in dev], dtype=torch.int64), device)
        u[rows] = torch.stack([x.to(device) for _, x in dev])
    return u


def distribution(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What rows of adjusted logits x [M, V] sample from: probabilities after temperature and truncation (not
    renormalised), with the token order as `truncate` returns them."""
    dev = x.device
    col = lambda vals, dtype: tensor_to_device(torch.tensor(vals, dtype=dtype), dev)  # noqa: E731
    probs = torch.softmax(x / col([p.temperature for p in params], torch.float32)[:, None], dim=-1)
    sort = None
    if all(_bounded(p) for p in params):
        sort = max(p.top_k for p in params)
    elif any(p.top_k > 0 or p.top_p < 1 for p in params):
        sort = 0
    min_p = col([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None
    return truncate(probs, col([p.top_k for p in params], torch.int64), col([p.top_p for p in params], torch.float32),
                    min_p, sort)


def _bounded(p: SamplingParams) -> bool:
    """Whether a row's top-k is small enough for a partial sort (`truncate` with sort k)."""
    return 0 < p.top_k <= PARTIAL_SORT_MAX_K


def _draw(x: torch.Tensor, params: list[SamplingParams], generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """One token per row of x [M, V] (rows that sample), by inverse CDF of its `distribution`; rows with a
    small top-k and the others go as two groups (the first needs only a partial sort)."""
    bounded = [i for i, p in enumerate(params) if _bounded(p)]
    if 0 < len(bounded) < len(params):
        tokens = torch.empty(len(params), dtype=torch.int64, device=x.device)
        for rows in (bounded, [i for i, p in enumerate(params) if not _bounded(p)]):
            idx = tensor_to_device(torch.tensor(rows, dtype=torch.int64), x.device)
            tokens[idx] = _draw(x[idx], [params[i] for i in rows], [generators[i] for i in rows])
        return tokens
    probs, order = distribution(x, params)
    cum = probs.cumsum(-1)
    target = _uniforms(generators, x.device) * cum[:, -1]
    pos = torch.searchsorted(cum, target[:, None], right=True).clamp(max=probs.shape[1] - 1)
    # a target rounded up to the total lands past the last token with mass: take the most likely one
    pos = torch.where(probs.gather(1, pos) > 0, pos, probs.argmax(-1, keepdim=True))
    return (pos if order is None else order.gather(1, pos))[:, 0]


def sample_async(logits: torch.Tensor, params: list[SamplingParams], generators: list[Optional[torch.Generator]],
                 history: Optional[History] = None) -> PendingSample:
    """One token per row of logits [N, V]; results stay on the device. `history` is needed for rows with
    penalties or min_tokens (without it those are not applied)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    x = adjusted_logits(logits, params, history) if any(p.adjusts_logits for p in params) else logits
    tokens = x.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(rows) == len(params):
        tokens = _draw(x.float(), params, generators)
    elif rows:
        idx = tensor_to_device(torch.tensor(rows, dtype=torch.int64), logits.device)
        tokens[idx] = _draw(x[idx].float(), [params[i] for i in rows], [generators[i] for i in rows])
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    counts = [p.top_logprobs for p in params]
    top = None
    if any(counts):
        v, ix = logp.topk(max(counts), dim=-1)
        top = (ix, v)
    return PendingSample(tokens=tokens, logprobs=chosen, top=top, top_counts=counts)
