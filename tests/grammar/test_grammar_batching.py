"""Grammar-constrained decoding in the scheduler (tiny model, CPU): a constrained and an unconstrained request
in one continuously batched run (overlap on, radix cache, chunked prefill), and with NextN speculation on,
where a batch holding a grammar request falls back to plain decode steps."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from engine.engine import Engine
from engine.grammar.spec import GrammarError, GrammarSpec
from engine.sampling import SamplingParams
from tests.speculative.helpers import FLAGS, SPEC

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
JSON_SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
PROMPT = [7, 33, 101, 58, 12, 90, 41]
OTHER = [5, 17, 99, 3, 42, 8, 77, 64, 31]


def _params(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


def _run(eng: Engine, jobs) -> list:
    """jobs: (prompt ids, params, grammar spec or None), run in one batch; their GenerateOutputs."""
    reqs = [eng.make_request(ids, p, grammar=g) for ids, p, g in jobs]
    for r in reqs:
        eng.scheduler.add(r)
    return eng.run_until_done(reqs)


@pytest.fixture(scope="module")
def eng():
    return Engine(model="tiny", **FLAGS)


def _check_json(eng: Engine, out) -> None:
    assert out.finish_reason == "stop"
    text = eng.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_constrained_and_unconstrained_in_one_batch(eng):
    alone = _run(eng, [(OTHER, _params(), None)])[0]
    free, constrained = _run(eng, [(OTHER, _params(), None), (PROMPT, _params(64), JSON_SPEC)])
    assert free.token_ids == alone.token_ids  # the mask touches only the constrained row
    _check_json(eng, constrained)
    free_run = _run(eng, [(PROMPT, _params(64), None)])[0]
    assert free_run.token_ids != constrained.token_ids  # the random model left alone writes no JSON


def test_regex_ebnf_and_sampled_rows(eng):
    jobs = [(PROMPT, _params(40, ), GrammarSpec("regex", r"(yes|no)-[0-9]{3}")),
            (OTHER, SamplingParams(max_new_tokens=40, temperature=1.0, seed=5),
             GrammarSpec("ebnf", 'root ::= "a" [b-d]+ "!"')),
            (OTHER, SamplingParams(max_new_tokens=64, temperature=1.0, seed=6), JSON_SPEC)]
    regex, ebnf, sampled = _run(eng, jobs)
    assert re.fullmatch(r"(yes|no)-[0-9]{3}", eng.tokenizer.decode(regex.token_ids)) and regex.finish_reason == "stop"
    assert re.fullmatch(r"a[b-d]+!", eng.tokenizer.decode(ebnf.token_ids)) and ebnf.finish_reason == "stop"
    _check_json(eng, sampled)


def test_grammar_starts_after_the_reasoning_block(eng):
    end = eng.tokenizer.encode("</think>", add_special_tokens=False)
    spec = GrammarSpec("regex", "[0-9]{4}", after_reasoning=True)
    out = _run(eng, [(PROMPT, _params(30), spec)])[0]
    free = _run(eng, [(PROMPT, _params(30), None)])[0]
    if end[0] in free.token_ids:  # the random model closes the block itself: the grammar runs from there
        cut = free.token_ids.index(end[0]) + 1
        assert out.token_ids[:cut] == free.token_ids[:cut]
        assert re.fullmatch("[0-9]{4}", eng.tokenizer.decode(out.token_ids[cut:]))
    else:  # never closed: nothing is constrained
        assert out.token_ids == free.token_ids
    closed = _run(eng, [(PROMPT + end, _params(30), spec)])[0]  # the prompt closes it (thinking off)
    assert re.fullmatch("[0-9]{4}", eng.tokenizer.decode(closed.token_ids)) and closed.finish_reason == "stop"


def test_json_object_compiles_and_a_bad_grammar_is_a_request_error(eng):
    obj = eng.make_request(PROMPT, _params(), grammar=GrammarSpec("json_object")).grammar
    obj.start()  # (compiled on the engine's background thread)
    assert obj.matcher.accept_string('{"a": [1, {"b": null}]}') and not obj.matcher.accept_string("]")
    with pytest.raises(GrammarError, match="cannot be compiled"):
        eng.make_request(PROMPT, _params(), grammar=GrammarSpec("ebnf", "root ::= undefined_rule"))
    with pytest.raises(GrammarError, match="JSON schema cannot be compiled"):
        eng.make_request(PROMPT, _params(), grammar=GrammarSpec("json_schema", '{"type": "nonsense"}'))


def test_speculative_decoding_falls_back_to_plain_steps_for_grammar_batches():
    spec_eng = Engine(model="tiny", **FLAGS, **SPEC)
    free_alone = _run(spec_eng, [(OTHER, _params(), None)])[0]
    plain_before = spec_eng.scheduler.stats()["spec_plain_steps"]
    free, constrained = _run(spec_eng, [(OTHER, _params(), None), (PROMPT, _params(64), JSON_SPEC)])
    assert free.token_ids == free_alone.token_ids  # greedy: speculation or not, the same tokens
    _check_json(spec_eng, constrained)
    assert spec_eng.scheduler.stats()["spec_plain_steps"] > plain_before


def test_grammars_compile_off_the_step_loop_and_a_failed_compile_fails_only_its_request(eng, monkeypatch):
    eng.make_request(PROMPT, _params(), grammar=JSON_SPEC)  # the engine's compiler exists
    gate, real = threading.Event(), eng.grammars.compile

    def slow_compile(spec):  # the background thread: held until the test lets it go; one spec fails
        assert threading.current_thread() is not threading.main_thread()
        gate.wait(10)
        if spec.source == "root ::= \"z\"":
            raise GrammarError("the EBNF grammar cannot be compiled: boom")
        return real(spec)

    monkeypatch.setattr(eng.grammars, "compile", slow_compile)
    jobs = [(OTHER, _params(), None), (PROMPT, _params(64), JSON_SPEC),
            (PROMPT[:5], _params(8), GrammarSpec("ebnf", 'root ::= "z"'))]
    reqs = [eng.make_request(ids, p, grammar=g) for ids, p, g in jobs]
    for r in reqs:
        eng.scheduler.add(r)
    for _ in range(6):  # the free request runs while the grammars compile; theirs wait outside the queue
        eng.scheduler.step()
    assert len(eng.scheduler.compiling) == 2 and len(reqs[1].token_ids) == len(PROMPT) \
        and len(reqs[0].token_ids) > len(OTHER)
    gate.set()
    free, constrained, failed = eng.run_until_done(reqs)
    _check_json(eng, constrained)
    assert free.finish_reason == "length"
    assert failed.finish_reason == "error" and "boom" in failed.error
