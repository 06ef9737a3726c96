"""Benchmark datasets: random lengths, ShareGPT and JSONL parsing."""

from __future__ import annotations

import json

import pytest

from dsctl.bench_serving.datasets import jsonl_requests, random_requests, sharegpt_requests
from engine.errors import UsageError


def test_random_fixed_and_ranged_lengths():
    fixed = random_requests(20, 30, 7, 1.0, seed=0, tok=None)
    assert all(r.prompt_len == 30 and len(r.prompt.split()) == 30 and r.output_len == 7 for r in fixed)
    ranged = random_requests(200, 40, 10, 0.5, seed=0, tok=None)
    assert {r.prompt_len for r in ranged} <= set(range(20, 41)) and len({r.prompt_len for r in ranged}) > 10
    assert {r.output_len for r in ranged} <= set(range(5, 11))
    assert random_requests(5, 40, 10, 0.5, seed=4, tok=None) == random_requests(5, 40, 10, 0.5, seed=4, tok=None)
    assert random_requests(5, 40, 10, 0.5, seed=4, tok=None) != random_requests(5, 40, 10, 0.5, seed=5, tok=None)
    with pytest.raises(UsageError):
        random_requests(1, 4, 4, 1.5, seed=0, tok=None)


def test_sharegpt_uses_first_turns_and_skips_short_ones(tmp_path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "tell me a long story about cats please"},
                                      {"from": "gpt", "value": "once upon a time there was a cat named tom"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "only one turn here in this one"}]},
        "not a dict",
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(path, 3, seed=0, tok=None)
    assert len(reqs) == 3 and {r.prompt for r in reqs} == {"tell me a long story about cats please"}
    assert reqs[0].output_len == round(10 * 1.3)  # estimate from the reply's 10 words
    assert sharegpt_requests(path, 1, seed=0, tok=None, output_len=33)[0].output_len == 33
    path.write_text("[]")
    with pytest.raises(UsageError, match="no usable entry"):
        sharegpt_requests(path, 1, seed=0, tok=None)


def test_jsonl_requests_and_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a b c", "output_len": 5}\n\n{"prompt": "d e", "output_len": 9}\n')
    reqs = jsonl_requests(path, 4, seed=0, tok=None)
    assert sorted((r.prompt, r.output_len) for r in reqs) == [("a b c", 5), ("a b c", 5), ("d e", 9), ("d e", 9)]
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(UsageError, match="d.jsonl:1"):
        jsonl_requests(path, 1, seed=0, tok=None)
