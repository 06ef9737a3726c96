"""The OpenAI-compatible routes of a live `dsctl serve` (tiny model, CPU), driven with the official client.

The offline `Engine` (same model, same float32 dtype the server uses on CPU; run
in a subprocess by offline_ref.py) is the reference for greedy outputs and
prompt log-probs.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, kv_settled, wait_for

GREEDY = {"temperature": 0}


ECHO_PROMPT = "The quick brown fox jumps over the lazy dog"
ID_PROMPTS = [[5, 17, 99, 3, 42], [7] * 9]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def _prompts(k: int) -> list[str]:
    return [f"request {i}: " + "lorem ipsum dolor " * (1 + i % 4) for i in range(k)]


@pytest.fixture(scope="module")
def ref():
    """The offline Engine's greedy outputs for every reference the tests use, computed in one go."""
    from tests.server.offline_ref import reference

    names_jobs = {
        "three": {"prompts": _prompts(3), "max_tokens": 12},
        "ids": {"input_ids": ID_PROMPTS, "max_tokens": 6},
        "two": {"prompts": _prompts(2), "max_tokens": 6},
        "echo": {"prompts": [ECHO_PROMPT], "max_tokens": 1, "prompt_logprobs": True},
        "chat": {"messages": MESSAGES, "max_tokens": 10},
        "thirty_two": {"prompts": _prompts(32), "max_tokens": 8},
    }
    return dict(zip(names_jobs, reference(list(names_jobs.values()))))


@pytest.fixture(scope="module")
def client(server):
    return server.client()


# ---- discovery and auth ---------------------------------------------------------------------
def test_profiling_routes_say_which_flag_turns_them_on(server):
    headers = {"Authorization": f"Bearer {server.api_key}"}
    for path in ("/start_profile", "/stop_profile"):
        r = httpx.post(server.url + path, headers=headers, timeout=10)
        assert r.status_code == 404 and "--profile-dir" in r.json()["error"]["message"], r.text


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == 4096


def test_api_key_is_required_everywhere_but_health(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    for path, method in (("/v1/models", "GET"), ("/metrics", "GET"), ("/v1/completions", "POST"),
                         ("/v1/chat/completions", "POST"), ("/start_profile", "POST"), ("/stop_profile", "POST")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic test-key"}):
            r = httpx.request(method, server.url + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


# ---- completions ----------------------------------------------------------------------------
def test_completion_greedy_matches_offline_engine(client, ref):
    for prompt, want in zip(_prompts(3), ref["three"]):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, **GREEDY)
        choice = r.choices[0]
        assert choice.text == want["text"]
        assert choice.finish_reason == want["finish_reason"]
        assert r.usage.prompt_tokens == len(want["prompt_token_ids"])
        assert r.usage.completion_tokens == len(want["token_ids"])
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_token_id_prompts_and_prompt_lists(client, ref):
    r = client.completions.create(model=MODEL_NAME, prompt=ID_PROMPTS, max_tokens=6, **GREEDY)
    assert [c.text for c in r.choices] == [o["text"] for o in ref["ids"]]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == 5 + 9
    assert r.usage.completion_tokens == sum(len(o["token_ids"]) for o in ref["ids"])
    r = client.completions.create(model=MODEL_NAME, prompt=_prompts(2), max_tokens=6, **GREEDY)
    assert [c.text for c in r.choices] == [o["text"] for o in ref["two"]]


def _counts(usage) -> tuple:
    """Usage without cached_tokens (a repeated prompt finds more of itself in the prefix cache)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_completion_stream_equals_whole_response(client):
    prompt = _prompts(1)[0]
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, **GREEDY)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(whole.usage)
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL_NAME, prompt="the same prompt", max_tokens=10, n=3, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # the n choices are different samples
    assert a.usage.completion_tokens == 3 * 10
    other = client.completions.create(**{**kw, "seed": 4321})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_n_choices_stream_per_index_equals_whole_response(client):
    kw = dict(model=MODEL_NAME, prompt=["first", "second"], max_tokens=8, n=2, temperature=1.0, seed=99,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    texts = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]


def test_sampling_knobs_are_accepted(client):
    r = client.completions.create(model=MODEL_NAME, prompt="knobs", max_tokens=5, temperature=0.7, top_p=0.9,
                                  seed=3, extra_body={"top_k": 20, "min_p": 0.05, "ignore_eos": True})
    assert r.usage.completion_tokens == 5


def _stop_char(text: str) -> tuple[str, int]:
    """A character of text (not at the start, not a replacement char) that does not occur before it."""
    for i in range(1, len(text)):
        c = text[i]
        if c != "\ufffd" and c.strip() and c not in text[:i]:
            return c, i
    pytest.skip(f"greedy output {text!r} has no usable stop character")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_output(client, stream):
    prompt = "stop strings"
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, **GREEDY,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop, at = _stop_char(full)
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=20, stop=[stop, "never-produced"], **GREEDY,
              extra_body={"ignore_eos": True})
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(**kw).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert text == full[:at]
    assert finish == "stop"


def test_echo_logprobs_scores_the_prompt_like_lm_eval(client, ref):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens 0 returns the prompt's log-probs."""
    r = client.completions.create(model=MODEL_NAME, prompt=ECHO_PROMPT, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    choice = r.choices[0]
    want = ref["echo"][0]
    n = len(want["prompt_token_ids"])
    assert choice.text == ECHO_PROMPT
    lp = choice.logprobs
    assert len(lp.tokens) == n and "".join(lp.tokens) == want["prompt_text"]
    assert lp.token_logprobs[0] is None and want["prompt_logprobs"][0] is None
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp.token_logprobs[1:], want["prompt_logprobs"][1:]))
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == value and max(top.values()) <= 0  # the chosen token is listed with its log-prob
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 0


def test_logprobs_of_generated_tokens(client):
    r = client.completions.create(model=MODEL_NAME, prompt="log probs", max_tokens=6, logprobs=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # tokens that share a text (bytes shown as U+FFFD) share one key, so there may be fewer than 3 + 1
        assert value <= 0 and 1 <= len(top) <= 4 and top[token] == value
        assert math.isclose(max(top.values()), value, abs_tol=1e-5)  # greedy picks the most likely token


# ---- chat -------------------------------------------------------------------------------------
def test_chat_greedy_matches_offline_engine_and_stream(client, ref):
    want = ref["chat"][0]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, **GREEDY)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content == want["text"]
    assert whole.usage.prompt_tokens == len(want["prompt_token_ids"])
    assert whole.usage.completion_tokens == len(want["token_ids"])
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert _counts(chunks[-1].usage) == _counts(whole.usage)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]


def test_chat_n_choices_and_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=5, n=2,
                                       seed=7, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert r.usage.completion_tokens == 10


# ---- engine invariants through the server ----------------------------------------------------
def test_32_concurrent_requests_equal_batch_of_one(server, client, ref):
    prompts = _prompts(32)
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]  # one at a time: a running batch of 1

    async def run():
        async with server.async_client() as aclient:
            rs = await asyncio.gather(*(aclient.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8,
                                                                   temperature=0) for p in prompts))
        return [r.choices[0].text for r in rs]

    assert asyncio.run(run()) == alone
    assert [o["text"] for o in ref["thirty_two"]] == alone


def test_48_concurrent_streams_finish_and_free_the_kv_pool(server):
    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"stream {i} " * (1 + i % 7)}], max_tokens=12,
            stream=True, stream_options={"include_usage": True}, temperature=0.8, seed=i,
            extra_body={"ignore_eos": True})
        finish, usage, pieces = None, None, 0
        async for chunk in stream:
            if chunk.choices:
                pieces += 1
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return finish, usage

    async def run():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(48)))

    results = asyncio.run(run())
    assert all(finish == "length" and usage.completion_tokens == 12 for finish, usage in results)
    assert wait_for(lambda: kv_settled(server), timeout=20), server.metrics()


# ---- metrics -------------------------------------------------------------------------------
def test_metrics_count_tokens_and_latencies(server, client):
    before = server.metrics()
    r = client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3, 4, 5, 6, 7], max_tokens=4, n=2,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8
    after = server.metrics()
    assert after["dsctl_prompt_tokens_total"] - before["dsctl_prompt_tokens_total"] == 2 * 7  # per sequence
    assert after["dsctl_generation_tokens_total"] - before["dsctl_generation_tokens_total"] == 8
    for hist in ("dsctl_time_to_first_token_seconds", "dsctl_e2e_request_latency_seconds"):
        assert after[hist + "_count"] - before.get(hist + "_count", 0) == 2
    itl = "dsctl_inter_token_latency_seconds_count"
    assert after[itl] - before.get(itl, 0) == 2 * 3
    for gauge in ("dsctl_num_requests_running", "dsctl_num_requests_waiting", "dsctl_kv_cache_usage_ratio",
                  "dsctl_kv_cache_free_tokens", "dsctl_kv_cache_total_tokens", "dsctl_engine_healthy"):
        assert gauge in after
    assert after["dsctl_engine_healthy"] == 1
    assert after['dsctl_request_finished_total{finish_reason="length"}'] >= 2


def test_shared_prefix_workload_hits_the_prefix_cache(server, client):
    """Needs the radix cache: the engine must report prefix-cache statistics and count hits."""
    prefix = [(i * 7) % 250 + 1 for i in range(300)]
    for k in range(4):
        client.completions.create(model=MODEL_NAME, prompt=prefix + [k + 1, k + 2], max_tokens=2, temperature=0)
    m = server.metrics()
    assert "dsctl_prefix_cache_hit_rate" in m, "the engine reports no prefix-cache statistics"
    assert m["dsctl_prefix_cache_hit_rate"] > 0
    assert m["dsctl_prefix_cache_tokens"] >= len(prefix)
