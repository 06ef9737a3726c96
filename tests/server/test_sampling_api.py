"""The sampling set through the official `openai` client against the shared `dsctl serve` (tiny model, CPU):
logit_bias, penalties, min_tokens, seeds in a batch, n with best_of, cached_tokens; and the V3.1 thinking switch
of the reasoning parser. The definitions themselves are tested on logits in tests/test_sampling_batched.py."""

from __future__ import annotations

import asyncio

import pytest

from engine.server.reasoning import ReasoningParser
from tests.server.conftest import MODEL_NAME

EOS = 257  # tiny's eos_token_id
FREE = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _text_of(client, token_id: int) -> str:
    """The text of one token, as the server decodes it (an echoed token-id prompt)."""
    return client.completions.create(model=MODEL_NAME, prompt=[token_id], max_tokens=0, echo=True).choices[0].text


def test_logit_bias_of_100_makes_every_token_that_token(client):
    token_id = 120
    bias = {str(token_id): 100}
    r = client.completions.create(model=MODEL_NAME, prompt="bias me", max_tokens=8, temperature=1.0, logprobs=1,
                                  logit_bias=bias, extra_body=FREE)
    want = _text_of(client, token_id)
    assert r.choices[0].logprobs.tokens == [want] * 8
    assert r.choices[0].text == want * 8
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=1.3, top_p=0.9, logit_bias=bias,
                                          logprobs=True, top_logprobs=2, extra_body=FREE)
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == [want] * 6 and all(len(t.top_logprobs) == 2 for t in content)


def test_penalties_reduce_repeats(client):
    """A +3 bias on one token makes greedy output repeat it; frequency and presence penalties of 2 repeat it less,
    repetition_penalty (which also counts the prompt) changes the output (the definitions on logits:
    tests/test_sampling_batched.py)."""
    kw = dict(model=MODEL_NAME, prompt="again and again and again", max_tokens=12, temperature=0, logprobs=0,
              logit_bias={"66": 3.0}, extra_body=FREE)
    text = _text_of(client, 66)

    def tokens(**extra) -> list[str]:
        return client.completions.create(**{**kw, **extra}).choices[0].logprobs.tokens

    plain = tokens()
    assert plain.count(text) >= 3
    assert tokens(frequency_penalty=2.0).count(text) < plain.count(text)
    assert tokens(presence_penalty=2.0).count(text) < plain.count(text)
    assert tokens(extra_body={**FREE, "repetition_penalty": 2.0}) != plain


def test_min_tokens_holds_back_eos(client):
    bias = {str(EOS): 100}  # EOS as soon as it may come
    early = client.completions.create(model=MODEL_NAME, prompt="stop now", max_tokens=20, logit_bias=bias)
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1
    r = client.completions.create(model=MODEL_NAME, prompt="stop now", max_tokens=20, logit_bias=bias,
                                  extra_body={"min_tokens": 5})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 6  # 5, then EOS


def test_a_seeded_request_gives_the_same_output_alone_and_in_a_batch(server):
    mine = dict(model=MODEL_NAME, prompt="seeded", max_tokens=8, temperature=1.0, top_p=0.9, seed=77,
                frequency_penalty=0.5, extra_body={**FREE, "min_p": 0.02, "repetition_penalty": 1.2})

    async def run(others: int) -> str:
        client = server.async_client()
        noise = [client.completions.create(model=MODEL_NAME, prompt=f"other {i}", max_tokens=8, temperature=1.0,
                                           presence_penalty=0.3 * i, extra_body=FREE) for i in range(others)]
        got = await asyncio.gather(client.completions.create(**mine), *noise)
        return got[0].choices[0].text

    assert asyncio.run(run(4)) == asyncio.run(run(0))


def test_best_of_returns_the_n_most_likely_of_the_candidates(client):
    kw = dict(model=MODEL_NAME, prompt=["best of", "two prompts"], max_tokens=4, temperature=1.5, seed=5,
              logprobs=0, extra_body=FREE)
    every = client.completions.create(n=3, **kw)
    best = client.completions.create(n=2, best_of=3, **kw)
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    assert best.usage.completion_tokens == every.usage.completion_tokens == 2 * 3 * 4
    for p in range(2):
        candidates = sorted(every.choices[p * 3:p * 3 + 3], key=lambda c: -sum(c.logprobs.token_logprobs))
        assert [c.text for c in best.choices[p * 2:p * 2 + 2]] == [c.text for c in candidates[:2]]
    no_lp = client.completions.create(n=1, best_of=2, **{**kw, "logprobs": None, "max_tokens": 2})
    assert len(no_lp.choices) == 2 and no_lp.choices[0].logprobs is None


def test_usage_reports_prompt_tokens_from_the_prefix_cache(client):
    prompt = "a prompt long enough to fill several pages of the prefix cache " * 6
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def test_chat_template_kwargs_are_accepted(client):
    """(tiny's template has no variables of its own: the thinking switch itself is the parser test below)"""
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
              extra_body=FREE)
    plain = client.chat.completions.create(**kw)
    r = client.chat.completions.create(**{**kw, "extra_body": {**FREE, "chat_template_kwargs": {"thinking": True}}})
    assert r.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("thinking", [False, True])
def test_v31_reasoning_parser_follows_the_thinking_switch(thinking):
    text = "plan it</think>the answer"
    parser = ReasoningParser("deepseek-v3.1", thinking)
    streamed = [parser.feed(text[i:i + 3], final=i + 3 >= len(text)) for i in range(0, len(text), 3)]
    joined = ("".join(r for r, _ in streamed), "".join(c for _, c in streamed))
    assert joined == (("plan it", "the answer") if thinking else ("", text))
    assert ReasoningParser("deepseek-r1").parse(text) == ("plan it", "the answer")
