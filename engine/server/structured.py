"""Structured outputs: `response_format` (`json_object`, `json_schema`) and the `regex` / `ebnf` extra fields
as a grammar spec for the engine, checked here (a schema or grammar that cannot be compiled is a 400 naming
the field; the check runs in the worker thread that plans the request, and its successes are cached)."""

from __future__ import annotations

import json
from typing import Optional

from engine.grammar import compiler
from engine.grammar.spec import GrammarError, GrammarSpec
from engine.server.errors import bad_request
from engine.server.schemas import ChatRequest


def _specs(req: ChatRequest, after_reasoning: bool) -> list[tuple[str, GrammarSpec]]:
    out = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        out.append(("response_format", GrammarSpec("json_object", after_reasoning=after_reasoning)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema", param="response_format")
        out.append(("response_format", GrammarSpec("json_schema", json.dumps(fmt.json_schema.schema_),
                                                   strict=bool(fmt.json_schema.strict),
                                                   after_reasoning=after_reasoning)))
    if req.regex is not None:
        out.append(("regex", GrammarSpec("regex", req.regex, after_reasoning=after_reasoning)))
    if req.ebnf is not None:
        out.append(("ebnf", GrammarSpec("ebnf", req.ebnf, after_reasoning=after_reasoning)))
    return out


def response_grammar(req: ChatRequest, after_reasoning: bool) -> Optional[GrammarSpec]:
    """The request's output grammar (None: free text); at most one of the fields may ask for one."""
    specs = _specs(req, after_reasoning)
    if not specs:
        return None
    if len(specs) > 1:
        raise bad_request(f"only one of {', '.join(f for f, _ in specs)} may constrain the output",
                          param=specs[1][0])
    field, spec = specs[0]
    try:
        compiler.check(spec)
    except GrammarError as exc:
        raise bad_request(str(exc), param=field) from None
    return spec
