"""`GrammarSpec`: what one request's output must match, as plain data (it crosses the process pipe)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import RequestError

# json_object: any JSON object; json_schema: JSON valid for the schema in `source` (JSON text);
# regex / ebnf: the regular expression / EBNF grammar (xgrammar's dialect, root rule `root`) in `source`;
# structural_tag: an xgrammar structural tag (JSON text), used for tool calls.
KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")


class GrammarError(RequestError):
    """A schema or grammar that cannot be compiled (a 400 at the server)."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    source: str = ""
    strict: bool = True  # json_schema: no properties or items beyond those the schema names
    after_reasoning: bool = False  # constrain only what follows the reasoning block (`</think>`)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})")
