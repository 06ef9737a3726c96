"""Tools in a chat request: what the chat template sees, which format the model writes calls in, and the
grammar that forces a call (`tool_choice` `required` or a named function).

The template gets the OpenAI messages as they are (assistant `tool_calls` with their argument text, `tool`
messages with their `tool_call_id`) and the `tools` list, which DeepSeek's own templates render; with
`tool_choice` "none" the tools are left out of the prompt and the output is not parsed for calls. The format
(engine/grammar/tool_calls.py) is `--tool-call-parser`, else read from the chat template: the fenced
"```json" arguments are deepseek-v3's, a bare `<｜tool▁sep｜>` deepseek-v3.1's; a template with neither
(the built-in tiny models') gets deepseek-v3.
"""

from __future__ import annotations

from typing import Optional

from engine.grammar import compiler
from engine.grammar.spec import GrammarError, GrammarSpec
from engine.grammar.tool_calls import tool_call_spec
from engine.server.errors import bad_request
from engine.server.schemas import ChatMessage, ChatRequest
from engine.server.tool_parser import SEP


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them (developer turns are system turns)."""
    out = []
    for m in messages:
        d = {"role": "system" if m.role == "developer" else m.role,
             "content": None if m.content is None and m.tool_calls else m.text()}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def uses_tools(req: ChatRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def template_tools(req: ChatRequest) -> dict:
    """The template's `tools` variable ({} when the request has none, or tool_choice is "none")."""
    return {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if uses_tools(req) else {}


def tool_format(tokenizer, configured: Optional[str]) -> str:
    if configured:
        return configured
    template = getattr(tokenizer.hf, "chat_template", None) if tokenizer is not None else None
    text = template if isinstance(template, str) else str(template or "")
    return "deepseek-v3.1" if SEP in text and "```json" not in text else "deepseek-v3"


def tool_grammar(req: ChatRequest, fmt: Optional[str], after_reasoning: bool) -> Optional[GrammarSpec]:
    """The grammar forcing a call for `required` / a named function (checked: a bad one is a 400), else None."""
    choice, tools = req.tool_choice, req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    if choice is None or choice in ("auto", "none"):
        return None
    if not tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    if choice != "required":
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                              f"request's tools ({', '.join(names)})", param="tool_choice")
        choice = choice.model_dump()
    try:
        spec = tool_call_spec(fmt, [t.model_dump(exclude_none=True) for t in tools], choice,
                              req.parallel_tool_calls is not False, after_reasoning)
        compiler.check(spec)
    except GrammarError as exc:
        raise bad_request(str(exc), param="tools") from None
    return spec
