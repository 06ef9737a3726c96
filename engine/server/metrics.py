"""Prometheus metrics of the server (text format on GET /metrics), via prometheus_client.

Counters and latency histograms are updated in the serving process as outputs arrive (the per-token ones in plain
numbers, exposed at scrape time); the engine's load and memory gauges (running / waiting requests, KV pool usage and
free tokens, prefix-cache holdings and hit rate) and its retraction counter are read from the latest EngineStats at
scrape time, and so is speculative decoding's accepted length (histogram dsctl_spec_accepted_tokens, gauge
dsctl_spec_accept_length) and the scheduler's step times by kind (histogram dsctl_step_seconds). With DP attention
the engine also reports, per DP group (label dp_rank), the requests dispatched to it (counter), its running +
waiting requests, its KV slots in use and its KV load as --load-balance-method total_tokens weighs it (gauges). With
--record-expert-load, the tokens routed to each EP rank's experts (counter dsctl_expert_load_tokens, label ep_rank)
and their imbalance (gauge).
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from engine.scheduler.step_times import BUCKETS
from engine.speculative.stats import mean_accepted

disable_created_metrics()  # no *_created series: they double the output and nobody here reads them

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class _EngineCollector:
    """Gauges read from the EngineClient at scrape time."""

    def __init__(self, client):
        self.client = client

    def collect(self):
        c, s = self.client, self.client.stats
        gauges = [
            ("dsctl_engine_healthy", "1 when the engine process is up and serving.", 1 if c.healthy else 0),
            ("dsctl_num_requests_running", "Sequences in the running batch.", s.running),
            ("dsctl_num_requests_waiting", "Sequences waiting in the scheduler.", s.waiting),
            ("dsctl_num_requests_queued", "Sequences sent to the engine that have no output yet "
             "(bounded by --max-queued-requests).", len(c.pending)),
            ("dsctl_kv_cache_total_tokens", "Size of the KV pool in tokens.", s.kv_total_tokens),
            ("dsctl_kv_cache_free_tokens", "Free token slots in the KV pool.", s.kv_free_tokens),
            ("dsctl_kv_cache_usage_ratio", "Used fraction of the KV pool (0..1).",
             1 - s.kv_free_tokens / s.kv_total_tokens if s.kv_total_tokens else 0.0),
            ("dsctl_prefix_cache_tokens", "KV tokens held by the prefix cache (evictable).", s.prefix_cache_tokens),
            ("dsctl_prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.",
             s.prefix_cache_hit_rate),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        yield CounterMetricFamily("dsctl_retracted_requests", "Requests preempted because decode ran out of KV "
                                  "(requeued and resumed by recompute).", value=float(s.retracted_requests))
        yield CounterMetricFamily("dsctl_two_batch_forwards", "Forwards run as two overlapped micro-batches "
                                  "(--enable-two-batch-overlap; DP attention: summed over the groups).",
                                  value=float(s.two_batch_forwards))
        paths = CounterMetricFamily("dsctl_forwards", "The model's forwards (not the MTP draft's) by how they ran: "
                                    "cuda_graph (a decode graph), piecewise (piecewise graphs around attention) or "
                                    "eager (DP attention: summed over the groups, each group's own forwards).",
                                    labels=["path"])
        for path, n in sorted(s.forward_paths.items()):
            paths.add_metric([path], float(n))
        yield paths
        yield from _dp_metrics(s)
        yield from _expert_metrics(c.expert_load)
        yield from _spec_metrics(s)
        yield from _step_metrics(s)


def _dp_metrics(s):
    """Per-DP-group series (DP attention only)."""
    if not s.dp_requests:
        return
    sent = CounterMetricFamily("dsctl_dp_requests", "Requests dispatched to each DP attention group.",
                               labels=["dp_rank"])
    load = GaugeMetricFamily("dsctl_dp_num_requests", "Running + waiting requests of each DP attention group.",
                             labels=["dp_rank"])
    used = GaugeMetricFamily("dsctl_dp_kv_cache_used_tokens", "KV slots in use in each DP attention group "
                             "(its prefix cache included).", labels=["dp_rank"])
    tokens = GaugeMetricFamily("dsctl_dp_kv_load_tokens", "KV load of each DP attention group as "
                               "--load-balance-method total_tokens weighs it: slots held by requests + what its "
                               "waiting requests will take.", labels=["dp_rank"])
    none = (0,) * len(s.dp_requests)
    for rank, (n, busy, held, weighed) in enumerate(zip(s.dp_requests, s.dp_running or none,
                                                        s.dp_kv_used_tokens or none, s.dp_kv_load_tokens or none)):
        sent.add_metric([str(rank)], float(n))
        load.add_metric([str(rank)], float(busy))
        used.add_metric([str(rank)], float(held))
        tokens.add_metric([str(rank)], float(weighed))
    yield from (sent, load, used, tokens)


def _expert_metrics(update):
    """--record-expert-load: tokens routed to each EP rank's experts and how uneven that is (the counts of the
    engine's latest report, engine/model/expert_load.py)."""
    if update is None or update.report is None:
        return
    report = update.report
    load = CounterMetricFamily("dsctl_expert_load_tokens", "Token-expert assignments routed to each expert-parallel "
                               "rank's experts, over every MoE layer (one rank without EP).", labels=["ep_rank"])
    for rank, n in enumerate(report.rank_totals()):
        load.add_metric([str(rank)], float(n))
    yield load
    ratio = GaugeMetricFamily("dsctl_expert_load_imbalance", "Busiest EP rank's routed tokens over the mean rank's, "
                              "averaged over the MoE layers (1.0: balanced; dsctl place-experts plans better).")
    ratio.add_metric([], report.imbalance())
    yield ratio


def _step_metrics(s):
    """The scheduler's step times per kind (engine/scheduler/step_times.py)."""
    if not s.step_seconds:
        return
    hist = HistogramMetricFamily("dsctl_step_seconds", "Time of one scheduler step, by kind (decode, extend, "
                                 "mixed, spec), from its launch or the previous step's end to its results.",
                                 labels=["kind"])
    edges = [*map(str, BUCKETS), "+Inf"]
    for kind, (counts, total) in sorted(s.step_seconds.items()):
        hist.add_metric([kind], _cumulative(edges, counts), sum_value=total)
    yield hist


def _cumulative(edges: list[str], counts) -> list[tuple[str, float]]:
    """(le edge, observations up to it) from per-bucket counts: the form HistogramMetricFamily takes."""
    return list(zip(edges, map(float, accumulate(counts))))


def _spec_metrics(s):
    """Speculative decoding: tokens each request gained per step (accepted drafts + the bonus token)."""
    if not s.spec_accept_hist:
        return
    hist = HistogramMetricFamily("dsctl_spec_accepted_tokens", "Tokens a request gained per speculative step "
                                 "(accepted draft tokens + 1); its mean is the accepted length.")
    cum, buckets = 0, []
    for n, count in enumerate(s.spec_accept_hist, start=1):
        cum += count
        buckets.append((str(n), float(cum)))
    buckets.append(("+Inf", float(cum)))
    hist.add_metric([], buckets, sum_value=float(sum(n * c for n, c in enumerate(s.spec_accept_hist, start=1))))
    yield hist
    mean = GaugeMetricFamily("dsctl_spec_accept_length", "Mean tokens per request per speculative step.")
    mean.add_metric([], mean_accepted((), s.spec_accept_hist) or 0.0)
    yield mean
    plain = CounterMetricFamily("dsctl_spec_plain_steps", "Decode steps run without speculation "
                                "(--speculative-disable-by-batch-size).")
    plain.add_metric([], float(s.spec_plain_steps))
    yield plain


class _TokenCounts:
    """The per-token series (generated tokens, inter-token latency), counted in plain numbers by the event loop
    that streams them (the only writer) and exposed at scrape time: a prometheus_client Counter / Histogram
    takes a lock and walks its buckets in Python on every update, a cost paid per streamed token."""

    def __init__(self):
        self.generated = 0
        self.itl_counts = [0] * (len(_ITL_BUCKETS) + 1)  # per bucket (the last: +Inf), not cumulative
        self.itl_sum = 0.0

    def observe_gap(self, gap: float, n: int) -> None:
        """n tokens that each followed the one before after `gap` seconds."""
        self.itl_counts[bisect_left(_ITL_BUCKETS, gap)] += n
        self.itl_sum += gap * n

    def collect(self):
        yield CounterMetricFamily("dsctl_generation_tokens", "Generated tokens.", value=float(self.generated))
        hist = HistogramMetricFamily("dsctl_inter_token_latency_seconds", "Time between successive tokens.")
        edges = [*map(floatToGoString, _ITL_BUCKETS), "+Inf"]
        hist.add_metric([], _cumulative(edges, self.itl_counts), sum_value=self.itl_sum)
        yield hist


class ServerMetrics:
    def __init__(self, client):
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("dsctl_prompt_tokens", "Prompt tokens of finished sequences.", registry=r)
        self.tokens = _TokenCounts()
        r.register(self.tokens)
        self.requests = Counter("dsctl_request_finished", "Finished sequences by finish reason.",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("dsctl_time_to_first_token_seconds", "Submission to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dsctl_e2e_request_latency_seconds", "Submission to finish.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(client))

    def observe(self, seq, new_tokens: int, now: float) -> None:
        if not new_tokens:
            return
        self.tokens.generated += new_tokens
        if seq.t_first is None:
            seq.t_first = now
            self.ttft.observe(now - seq.t_submit)
        elif seq.t_last is not None:
            self.tokens.observe_gap((now - seq.t_last) / new_tokens, new_tokens)
        seq.t_last = now

    def finished(self, seq, now: float) -> None:
        self.prompt_tokens.inc(len(seq.prompt_ids))
        self.requests.labels(seq.finish_reason or "abort").inc()
        self.e2e.observe(now - seq.t_submit)

    def render(self) -> bytes:
        return generate_latest(self.registry)
