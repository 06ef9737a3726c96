"""Tool-call grammars: the DeepSeek tool-call block as an xgrammar structural tag, so that with `tool_choice`
`required` or a named function the output is a well-formed call block whose arguments are JSON valid for the
called function's parameter schema.

Formats (the DeepSeek chat templates' own; engine/server/tool_parser.py reads them back):

- `deepseek-v3` (V3, V3-0324, R1, R1-0528): `<｜tool▁calls▁begin｜>` then, per call,
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + "\\n```json\\n" + ARGS + "\\n```" + `<｜tool▁call▁end｜>`
  (calls separated by a newline), then `<｜tool▁calls▁end｜>`.
- `deepseek-v3.1` (V3.1, V3.1-Terminus): the same markers, each call
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`.

xgrammar ships both layouts (its `deepseek_r1` and `deepseek_v3_1` model tags); the reasoning block is left
out of the tag here: the request's matcher starts after it instead (matcher.py). Whitespace runs in the
arguments are bounded (MAX_WHITESPACE), so no model can stall a call on endless blanks.
"""

from __future__ import annotations

from typing import Union

import xgrammar as xgr

from engine.grammar.spec import GrammarError, GrammarSpec

FORMATS = {"deepseek-v3": "deepseek_r1", "deepseek-v3.1": "deepseek_v3_1"}  # ours -> xgrammar's model tag
MAX_WHITESPACE = 8  # the longest run of whitespace between JSON tokens in the arguments


def tool_call_spec(fmt: str, tools: list[dict], choice: Union[str, dict], parallel: bool,
                   after_reasoning: bool = False) -> GrammarSpec:
    """The grammar of a tool-call block: `choice` is "required" (one or more calls of any of `tools`; just one
    unless `parallel`) or {"type": "function", "function": {"name": ...}} (one call of that function).
    `tools` are OpenAI function tools."""
    if fmt not in FORMATS:
        raise GrammarError(f"unknown tool-call format {fmt!r} (one of {', '.join(FORMATS)})")
    try:
        tag = xgr.get_model_structural_tag(FORMATS[fmt], tools=tools, tool_choice=choice, reasoning="disabled",
                                           parallel_tool_calls=parallel, max_whitespace_cnt=MAX_WHITESPACE)
    except Exception as exc:  # noqa: BLE001 - ValueError or a pydantic ValidationError from xgrammar
        raise GrammarError(f"the tools cannot be turned into a grammar: {str(exc).strip().splitlines()[0]}") from None
    return GrammarSpec("structural_tag", tag.model_dump_json(), after_reasoning=after_reasoning)
