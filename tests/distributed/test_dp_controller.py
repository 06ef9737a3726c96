"""The DP-attention controller (engine/runtime/dp_controller.py): which DP group gets each request, and the
job-wide stats it merges from every group's. Pure Python, no processes: the multi-process checks are in
test_engine_tp.py (`test_dp_attention_uneven_load_and_kv_capacity`) and test_serve_tp.py."""

import random
from collections import deque
from types import SimpleNamespace

import pytest

from engine.args import EngineArgs
from engine.errors import UsageError
from engine.runtime.dp_controller import DPController, request_tokens, waiting_tokens
from engine.runtime.protocol import AbortRequest, AddRequest, EngineStats, Shutdown
from engine.sampling import SamplingParams
from engine.scheduler.admission import CLIP_NEW_TOKENS
from engine.scheduler.request import Request
from engine.server.metrics import ServerMetrics


def _add(i: int, dp_rank=None, prompt_len: int = 3, max_new: int = 128) -> AddRequest:
    return AddRequest(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new),
                      dp_rank=dp_rank)


def test_round_robin_and_broadcast_messages():
    c = DPController(3, "round_robin")
    assert [c.route(_add(i)) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert c.route(AbortRequest("r1")) is None and c.route(Shutdown()) is None  # every group
    assert c.route(_add(9, dp_rank=2)) == 2  # a named group wins
    assert c.dispatched == [3, 2, 3]
    with pytest.raises(ValueError):
        c.route(_add(10, dp_rank=3))


def test_shortest_queue_follows_reported_load():
    c = DPController(2, "shortest_queue")
    c.merge_stats([EngineStats(running=5, waiting=2), EngineStats(running=1)])
    assert [c.route(_add(i)) for i in range(7)] == [1] * 6 + [0]  # group 1 fills up to group 0's 7, then ties
    merged = c.merge_stats([EngineStats(running=3, kv_total_tokens=10, kv_free_tokens=4, prefix_cache_hit_rate=0.5),
                            EngineStats(waiting=2, kv_total_tokens=10, kv_free_tokens=6)])
    assert (merged.running, merged.waiting, merged.kv_total_tokens, merged.kv_free_tokens) == (3, 2, 20, 10)
    assert merged.prefix_cache_hit_rate == 0.25 and merged.dp_requests == (1, 6) and merged.dp_running == (3, 2)
    assert c.route(_add(8)) == 1


def test_total_tokens_is_the_default_and_weighs_kv_not_requests():
    """Group 0 runs 1 long request, group 1 runs 6 short ones: shortest_queue would load group 0; total_tokens
    sends work to group 1 until its projected KV passes group 0's, counting prompt + max_new_tokens of what it
    sent; ties go to the fewer requests, then the lower group."""
    c = DPController(2)
    assert c.policy == "total_tokens"
    merged = c.merge_stats([EngineStats(running=1, kv_total_tokens=1000, kv_free_tokens=100),  # 900 in use
                            EngineStats(running=6, kv_total_tokens=1000, kv_free_tokens=500)])  # 500 in use
    assert merged.dp_kv_used_tokens == (900, 500) and merged.dp_kv_load_tokens == (900, 500)
    assert c.route(_add(0, prompt_len=150, max_new=50)) == 1  # 500 -> 700
    assert c.route(_add(1, prompt_len=150, max_new=50)) == 1  # 700 -> 900: a tie with group 0 ...
    assert c.route(_add(2, prompt_len=10, max_new=10)) == 0  # ... that group 0's 1 request wins over 8
    assert c.tokens == [920, 900] and c.load == [2, 8]
    assert c.route(_add(3, dp_rank=0, prompt_len=5, max_new=0)) == 0  # a named group is counted too
    assert c.tokens == [925, 900]
    c.merge_stats([EngineStats(waiting=1, kv_total_tokens=50, kv_free_tokens=50),
                   EngineStats(waiting=1, kv_total_tokens=50, kv_free_tokens=50)])
    assert c.route(_add(4)) == 0  # equal tokens and requests: the lower group


def test_total_tokens_counts_the_queue_and_not_the_evictable_cache():
    """A group whose pool is full of cached prefixes nobody holds is idle; one whose queue waits is not."""
    c = DPController(3, "total_tokens")
    merged = c.merge_stats([
        EngineStats(kv_total_tokens=1000, kv_free_tokens=0, kv_evictable_tokens=1000, prefix_cache_tokens=1000),
        EngineStats(running=2, waiting=3, kv_total_tokens=1000, kv_free_tokens=700, waiting_tokens=600),
        EngineStats(running=9, kv_total_tokens=1000, kv_free_tokens=200, kv_evictable_tokens=100)])
    assert merged.dp_kv_used_tokens == (1000, 300, 800) and merged.dp_kv_load_tokens == (0, 900, 700)
    assert (merged.kv_evictable_tokens, merged.waiting_tokens) == (1100, 600)
    assert [c.route(_add(i, prompt_len=100, max_new=100)) for i in range(5)] == [0, 0, 0, 0, 2]


def test_request_tokens_clip_max_new_tokens_and_count_what_was_generated():
    assert request_tokens(100, 50) == 150 and request_tokens(100, 0) == 100 and request_tokens(7, -3) == 7
    assert request_tokens(10, 10 ** 6) == 10 + CLIP_NEW_TOKENS  # no max_tokens: the whole context as its limit
    rng = random.Random(3)
    reqs = [Request.new(f"w{i}", [rng.randint(1, 99) for _ in range(rng.randint(1, 40))],
                        SamplingParams(max_new_tokens=rng.choice([0, 5, 300, 10 ** 5]))) for i in range(20)]
    for r in reqs[::3]:  # retracted ones: part of their output is generated already
        r.token_ids.extend(rng.randint(1, 99) for _ in range(min(3, r.params.max_new_tokens)))
    want = sum(len(r.token_ids) + min(r.params.max_new_tokens - r.num_output, CLIP_NEW_TOKENS) for r in reqs)
    assert waiting_tokens(reqs) == want and waiting_tokens([]) == 0


def test_per_group_kv_reaches_metrics_text():
    rng = random.Random(7)
    groups = [EngineStats(running=rng.randint(0, 9), waiting=rng.randint(0, 9), kv_total_tokens=5000,
                          kv_free_tokens=rng.randint(0, 2000), kv_evictable_tokens=rng.randint(0, 500),
                          waiting_tokens=rng.randint(0, 3000)) for _ in range(3)]
    merged = DPController(3).merge_stats(groups)
    text = ServerMetrics(SimpleNamespace(stats=merged, healthy=True, pending={}, expert_load=None)).render().decode()
    for g, s in enumerate(groups):
        used = s.kv_total_tokens - s.kv_free_tokens
        assert f'dsctl_dp_kv_cache_used_tokens{{dp_rank="{g}"}} {float(used)}' in text
        assert f'dsctl_dp_kv_load_tokens{{dp_rank="{g}"}} {float(used - s.kv_evictable_tokens + s.waiting_tokens)}' in text
        assert f'dsctl_dp_num_requests{{dp_rank="{g}"}} {float(s.running + s.waiting)}' in text


def test_merged_stats_add_up_every_groups_speculative_acceptance():
    """Each DP group runs its own spec steps: the job's histogram of accepted tokens is the groups' sum."""
    c = DPController(2, "round_robin")
    merged = c.merge_stats([EngineStats(spec_accept_hist=(5, 1, 0), spec_plain_steps=2),
                            EngineStats(spec_accept_hist=(1, 2, 3), spec_plain_steps=1)])
    assert merged.spec_accept_hist == (6, 3, 3) and merged.spec_plain_steps == 3
    assert c.merge_stats([EngineStats(), EngineStats()]).spec_accept_hist == ()


def test_unknown_policy_and_the_flag_without_dp_attention():
    with pytest.raises(ValueError):
        DPController(2, "random")
    for method in ("total_tokens", "round_robin"):
        with pytest.raises(UsageError, match="--enable-dp-attention"):
            EngineArgs.of(load_balance_method=method).validate()
    EngineArgs.of(load_balance_method="shortest_queue", enable_dp_attention=True, tp_size=2).validate()


# ---- a simulation of DP groups under each policy ------------------------------------------------------
class SimGroup:
    """One DP group as a toy scheduler: a pool of `capacity` KV slots; FIFO admission while the request's
    tokens plus one slot per running request fit; each step every running request gains one token (the
    newest are retracted, slots freed and requeued first, while the step does not fit); a request finishes
    at its drawn output length. All groups step together, as DP attention does."""

    def __init__(self, capacity: int, max_running: int = 32):
        self.capacity, self.max_running = capacity, max_running
        self.waiting: deque = deque()
        self.running: list = []
        self.used = 0

    def step(self, lengths: dict) -> int:
        while self.waiting and len(self.running) < self.max_running:
            need = len(self.waiting[0].token_ids)
            if self.used + need + len(self.running) + 1 > self.capacity:
                break
            self.running.append(self.waiting.popleft())
            self.used += need
        while self.used + len(self.running) > self.capacity:
            r = self.running.pop()
            self.used -= len(r.token_ids)
            self.waiting.appendleft(r)
        for r in self.running:
            r.token_ids.append(1)
        self.used += len(self.running)
        done = [r for r in self.running if r.num_output >= lengths[r.rid]]
        self.used -= sum(len(r.token_ids) for r in done)
        self.running = [r for r in self.running if r.num_output < lengths[r.rid]]
        return len(done)

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.running), waiting=len(self.waiting), kv_total_tokens=self.capacity,
                           kv_free_tokens=self.capacity - self.used, waiting_tokens=waiting_tokens(self.waiting))


def simulate(policy: str, chat: bool, seed: int, n: int = 300, concurrency: int = 48, groups: int = 4,
             capacity: int = 4000) -> tuple[float, int]:
    """A closed loop of `concurrency` clients; 15% long prompts (600-1200 tokens), the rest 20-60; outputs of
    20-80 tokens, max_new_tokens the same (a benchmark with ignore_eos) or far above (`chat`). Returns the
    median over the steps of max / min KV in use across the groups while requests arrive, and the steps the
    whole load took."""
    rng = random.Random(seed)
    c, sims = DPController(groups, policy), [SimGroup(capacity) for _ in range(groups)]
    lengths, spread, sent, finished, steps = {}, [], 0, 0, 0
    while finished < n:
        while sent < n and sent - finished < concurrency:
            prompt = rng.randint(600, 1200) if rng.random() < 0.15 else rng.randint(20, 60)
            lengths[f"r{sent}"] = rng.randint(20, 80)
            msg = AddRequest(f"r{sent}", [1] * prompt,
                             SamplingParams(max_new_tokens=rng.choice([256, 4096]) if chat else lengths[f"r{sent}"]))
            sims[c.route(msg)].waiting.append(Request.new(msg.rid, msg.prompt_ids, msg.params))
            sent += 1
        finished += sum(g.step(lengths) for g in sims)
        used = c.merge_stats([g.stats() for g in sims]).dp_kv_used_tokens
        if sent < n:
            spread.append(max(used) / max(min(used), 1))
        steps += 1
    return sorted(spread)[len(spread) // 2], steps


@pytest.mark.parametrize("chat", [False, True], ids=["max_new=output", "max_new>>output"])
def test_total_tokens_balances_kv_of_mixed_prompts_better(chat):
    """With long and short prompts mixed, round_robin and shortest_queue leave one group with 2-3x another's
    KV; total_tokens keeps them within ~1.5x and finishes the load in fewer steps (what made it the default)."""
    got = {p: [simulate(p, chat, seed) for seed in (0, 1)] for p in ("round_robin", "shortest_queue", "total_tokens")}
    spread = {p: sum(s for s, _ in runs) / len(runs) for p, runs in got.items()}
    steps = {p: sum(n for _, n in runs) for p, runs in got.items()}
    assert spread["total_tokens"] < 0.7 * min(spread["round_robin"], spread["shortest_queue"]), spread
    assert steps["total_tokens"] < min(steps["round_robin"], steps["shortest_queue"]), steps
