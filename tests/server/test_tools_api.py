"""Tool calls and structured outputs through `dsctl serve` (tiny random model, CPU) with the official client.

The model is random, so everything it writes here under `tool_choice` required / a named function, or a
`json_schema` / regex response format, is the grammar's doing: the arguments and responses must parse and
satisfy their schemas, streamed and not. Bad schemas, grammars and tool names are 400s naming the reason,
and a request with a grammar does not change the output of another request batched with it.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"q": {"type": "string", "enum": ["dsctl", "mla"]}}, "required": ["q"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGS = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=400, temperature=0)


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=600)


async def _streamed_calls(stream) -> tuple[dict, str]:
    """Tool calls put back together from their deltas (first: index, id, name; then argument fragments)."""
    calls, finish = {}, None
    async for chunk in stream:
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        for d in c.delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                calls[d.index]["arguments"] += d.function.arguments
    return calls, finish


@pytest.fixture(scope="module")
def batch(server):
    """One batch of requests sent together (the engine runs them side by side): a named tool choice whole and
    streamed, `required` with one call, a json_schema and a regex response, a plain request (also sent alone
    first) and a request with a bad grammar."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    plain = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me more."}], max_tokens=24,
                 temperature=0, logprobs=True)

    async def run():
        async with server.async_client(timeout=600) as c:
            alone = await c.chat.completions.create(**plain)
            jobs = {
                "named": c.chat.completions.create(**ARGS, tools=TOOLS, tool_choice=NAMED),
                "named_stream": _streamed_calls(await c.chat.completions.create(**ARGS, tools=TOOLS,
                                                                                tool_choice=NAMED, stream=True)),
                "required": c.chat.completions.create(**{**ARGS, "temperature": 1.0}, tools=TOOLS, seed=11,
                                                      tool_choice="required", parallel_tool_calls=False),
                "json": c.chat.completions.create(**ARGS, response_format=fmt),
                "regex": c.chat.completions.create(**ARGS, extra_body={"regex": r"(yes|no), [0-9]{2}"}),
                "plain": c.chat.completions.create(**plain),
                "refused": c.chat.completions.create(**ARGS, extra_body={"regex": "("}),
            }
            done = await asyncio.gather(*jobs.values(), return_exceptions=True)
            return {"alone": alone, **dict(zip(jobs, done))}

    return asyncio.run(run())


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_tool_choice(batch):
    choice = batch["named"].choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    _check_call(call.function.name, call.function.arguments)


def test_named_tool_choice_streamed(batch):
    calls, finish = batch["named_stream"]
    assert finish == "tool_calls" and [c["name"] for c in calls.values()] == ["get_weather"]
    _check_call(calls[0]["name"], calls[0]["arguments"])


def test_required_makes_one_call_with_valid_arguments(batch):
    [call] = batch["required"].choices[0].message.tool_calls
    _check_call(call.function.name, call.function.arguments)


def test_json_schema_response(batch):
    choice = batch["json"].choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_regex_through_extra_body(batch):
    assert re.fullmatch(r"(yes|no), [0-9]{2}", batch["regex"].choices[0].message.content)


def test_grammar_requests_leave_their_batch_alone(batch):
    assert isinstance(batch["refused"], openai.BadRequestError)
    tokens = lambda r: [t.token for t in r.choices[0].logprobs.content]  # noqa: E731
    assert tokens(batch["plain"]) == tokens(batch["alone"])


def test_tool_history_renders(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "JSON schema cannot be compiled"),
    ({"regex": "(unclosed"}, "regex", "regular expression cannot be compiled"),
    ({"ebnf": "root ::= missing_rule"}, "ebnf", "EBNF grammar cannot be compiled"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "only one of"),
])
def test_bad_grammars_and_tool_names_are_400(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**ARGS, "max_tokens": 4}, extra_body=extra)
    assert err.value.body["param"] == param and words in err.value.body["message"]
