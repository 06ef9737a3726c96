"""Grammar specs -> xgrammar: `check` a spec without a tokenizer (the server's 400s, off its event loop),
`GrammarCompiler` for one model's vocabulary (the engine; compiled grammars are cached by xgrammar; `submit`
compiles on a background thread, xgrammar releasing the GIL meanwhile, so the engine's step loop never waits).

Every grammar is rewritten to admit Unicode scalar values only (utf8.py: xgrammar's character classes would
let byte tokens spell surrogates, which no UTF-8 decoder reads).

JSON is compact: no whitespace beyond the separators `", "` and `": "` (a model that pretty-prints is
steered to one line; every JSON parser reads it alike).
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from engine.grammar.spec import GrammarError, GrammarSpec
from engine.grammar.utf8 import scalar_only
from engine.grammar.vocab import tokenizer_info

REASONING_END = "</think>"
ANY_OBJECT = '{"type": "object"}'
_WHAT = {"json_object": "JSON object grammar", "json_schema": "JSON schema", "regex": "regular expression",
         "ebnf": "EBNF grammar", "structural_tag": "tool-call grammar"}


def _xgrammar_of(spec: GrammarSpec) -> xgr.Grammar:
    if spec.kind in ("json_object", "json_schema"):
        source = ANY_OBJECT if spec.kind == "json_object" else spec.source
        strict = spec.strict and spec.kind == "json_schema"
        return xgr.Grammar.from_json_schema(source, any_whitespace=False, strict_mode=strict)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.source)
    if spec.kind == "ebnf":
        return xgr.Grammar.from_ebnf(spec.source)
    return xgr.Grammar.from_structural_tag(spec.source)


def grammar_of(spec: GrammarSpec) -> xgr.Grammar:
    """The xgrammar grammar of a spec, Unicode scalar values only (no tokenizer needed); raises what xgrammar
    raises."""
    return xgr.Grammar.from_ebnf(scalar_only(str(_xgrammar_of(spec))))


def _error(spec: GrammarSpec, exc: Exception) -> GrammarError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return GrammarError(f"the {_WHAT[spec.kind]} cannot be compiled: {reason}")


@functools.lru_cache(maxsize=512)
def check(spec: GrammarSpec) -> None:
    """Raise GrammarError when the spec cannot be compiled (successes are cached)."""
    try:
        grammar_of(spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, its own errors
        raise _error(spec, exc) from None


class GrammarCompiler:
    """Specs compiled for one vocabulary: `vocab_size` is the model's (the logits' width), `tokenizer` the
    engine's (engine/checkpoint/tokenizer.py), `stop_ids` the tokens that end a grammar's output (EOS)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int], threads: int = 8):
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer.hf, vocab_size, stop_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        self.reasoning_end = tuple(tokenizer.encode(REASONING_END, add_special_tokens=False))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """spec compiled (a GrammarError when it cannot be)."""
        try:
            return self.compiler.compile_grammar(grammar_of(spec))
        except Exception as exc:  # noqa: BLE001 - see check()
            raise _error(spec, exc) from None

    def submit(self, spec: GrammarSpec) -> Future:
        """`compile(spec)` on the background thread: a future of the compiled grammar (or its GrammarError)."""
        return self.pool.submit(self.compile, spec)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
