"""What the chat template gets for tools (tool_calls.py), the tool-call format read from a template, and the
forcing grammar's checks (no model, no server)."""

from __future__ import annotations

from types import SimpleNamespace

import jinja2
import pytest

from engine.server.errors import APIError
from engine.server.schemas import ChatRequest
from engine.server.tool_calls import template_messages, template_tools, tool_format, tool_grammar

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
# A template in the DeepSeek-V3 layout (written for this test): tools listed, calls and tool outputs rendered.
V3_LIKE = (
    "{% for t in tools or [] %}[tool {{ t['function']['name'] }}]{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<U>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<A>{% for c in m['tool_calls'] %}<｜tool▁call▁begin｜>"
    "{{ c['type'] }}<｜tool▁sep｜>{{ c['function']['name'] }}\n```json\n{{ c['function']['arguments'] }}"
    "\n```<｜tool▁call▁end｜>{% endfor %}"
    "{% elif m['role'] == 'tool' %}<T>{{ m['content'] }}{% endif %}{% endfor %}")


def _request(**kw) -> ChatRequest:
    history = [{"role": "user", "content": "Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    return ChatRequest.model_validate({"messages": history, **kw})


def test_history_and_tools_reach_the_template():
    req = _request(tools=[TOOL])
    messages = template_messages(req.messages)
    assert messages[1]["content"] is None and messages[2]["tool_call_id"] == "call_1"
    text = jinja2.Template(V3_LIKE).render(messages=messages, **template_tools(req))
    assert text == ("[tool get_weather]<U>Paris?<A><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><T>sunny')
    assert template_tools(_request(tools=[TOOL], tool_choice="none")) == {}


def test_format_from_the_template():
    tok = lambda t: SimpleNamespace(hf=SimpleNamespace(chat_template=t))  # noqa: E731
    assert tool_format(tok(V3_LIKE), None) == "deepseek-v3"
    assert tool_format(tok("{{ name + '<｜tool▁sep｜>' + args }}"), None) == "deepseek-v3.1"
    assert tool_format(tok("plain"), None) == "deepseek-v3"
    assert tool_format(tok(V3_LIKE), "deepseek-v3.1") == "deepseek-v3.1"


def test_forcing_grammar_and_its_errors():
    assert tool_grammar(_request(tools=[TOOL]), "deepseek-v3", False) is None  # auto: nothing forced
    named = {"type": "function", "function": {"name": "get_weather"}}
    spec = tool_grammar(_request(tools=[TOOL], tool_choice=named), "deepseek-v3.1", True)
    assert spec.kind == "structural_tag" and spec.after_reasoning and "get_weather<｜tool▁sep｜>" in spec.source
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    for kw, param in (({"tools": [TOOL, TOOL], "tool_choice": "auto"}, "tools"),
                      ({"tools": [bad_schema], "tool_choice": "required"}, "tools"),
                      ({"tool_choice": named}, "tool_choice")):
        with pytest.raises(APIError) as err:
            tool_grammar(_request(**kw), "deepseek-v3", False)
        assert err.value.param == param
