"""`bench serving --dataset random` sends exactly the lengths asked, and reports what the server counted.

Against a live `dsctl serve` (tiny model, CPU) the server's own usage field is
the judge: token-id prompts of 37 tokens must come back as prompt_tokens 37.
The fake server covers a server that refuses token ids (text of verified length
is sent instead) and one that counts differently (the report warns).
"""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from dsctl.bench_serving import main as bench_main
from dsctl.bench_serving.main import ServingOptions, run_serving
from dsctl.bench_serving.tokens import load_tokenizer
from tests.bench.conftest import run_bench


@pytest.fixture(scope="module")
def live():
    from tests.server.conftest import launch

    srv = launch("--served-model-name", "tiny-served")  # bench finds the tokenizer through the card's root
    yield srv
    srv.stop()


@pytest.fixture
def results(monkeypatch):
    """The per-request results of the benchmark runs made in a test (the last run's)."""
    captured = {}
    real = bench_main.run_load

    def spy(*args, **kwargs):
        captured["results"], duration = real(*args, **kwargs)
        return captured["results"], duration

    monkeypatch.setattr(bench_main, "run_load", spy)
    return captured


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=1000), out


def test_random_prompts_reach_the_server_with_exactly_the_asked_lengths(live, results, tmp_path):
    out = tmp_path / "r.jsonl"
    r = run_bench("serving", "--base-url", live.url, "--num-prompts", "6", "--max-concurrency", "3",
                  "--random-input-len", "37", "--random-output-len", "5", "--result-file", str(out))
    assert r.exit_code == 0, r.output
    assert "prompts: token ids (exact lengths)" in r.output and "warning" not in r.output
    got = results["results"]
    assert all(x.ok and x.counted_by == "usage" for x in got)
    assert [(x.prompt_len, x.output_len) for x in got] == [(37, 5)] * 6  # the server's usage counts
    row = json.loads(out.read_text())
    assert (row["input_tokens"], row["output_tokens"]) == (6 * 37, 6 * 5)
    assert (row["asked_input_tokens"], row["prompt_len_mismatch"], row["output_len_mismatch"]) == (6 * 37, 0, 0)
    assert row["prompt_form"] == "ids"


def test_ranged_lengths_stay_inside_their_bounds(live, results):
    console, _ = _console()
    s = run_serving(ServingOptions(base_url=live.url, num_prompts=8, max_concurrency=8, random_input_len=40,
                                   random_output_len=6, random_range_ratio=0.5, seed=5), console)
    got = results["results"]
    assert s.completed == 8 and s.prompt_len_mismatch == 0 and s.output_len_mismatch == 0
    assert all(20 <= x.prompt_len <= 40 and 3 <= x.output_len <= 6 for x in got)
    assert all((x.prompt_len, x.output_len) == (x.asked_prompt_len, x.asked_output_len) for x in got)
    assert len({x.prompt_len for x in got}) > 3


def test_chat_messages_have_the_asked_tokens_plus_the_template(live, results):
    from engine.checkpoint.resolve import registry_tokenizer
    from engine.checkpoint.tokenizer import Tokenizer

    console, out = _console()
    s = run_serving(ServingOptions(base_url=live.url, endpoint="chat", num_prompts=4, random_input_len=37,
                                   random_output_len=5), console)
    assert s.completed == 4 and "chat messages (content lengths verified" in out.getvalue()
    path, _ = registry_tokenizer("tiny")
    template = len(Tokenizer(path).apply_chat_template([{"role": "user", "content": ""}]))
    assert template > 0
    assert [x.prompt_len for x in results["results"]] == [37 + template] * 4
    assert s.prompt_len_mismatch == 4 and "chat template adds its own tokens" in out.getvalue()


def test_a_server_refusing_token_ids_gets_text_of_verified_length(make_server):
    server = make_server(ttft=0.01, itl=0.005, accept_token_ids=False)
    console, out = _console()
    s = run_serving(ServingOptions(base_url=server.url, num_prompts=5, random_input_len=37, random_output_len=5,
                                   tokenizer="deepseek-v3"), console)
    assert s.completed == 5 and "refused a token-id prompt" in out.getvalue()
    tok = load_tokenizer("deepseek-v3", required=True)
    sent = [b["prompt"] for b in server.bodies if b.get("stream")]
    assert len(sent) == 5 and all(isinstance(p, str) for p in sent)
    assert all(tok.count(p, add_special_tokens=True) == 37 for p in sent)  # BOS the server adds + 36


def test_a_server_counting_differently_is_reported(make_server):
    server = make_server(ttft=0.01, itl=0.005, extra_prompt_tokens=2)
    console, out = _console()
    s = run_serving(ServingOptions(base_url=server.url, num_prompts=3, random_input_len=10, random_output_len=4,
                                   tokenizer="deepseek-v3"), console)
    assert (s.input_tokens, s.asked_input_tokens, s.prompt_len_mismatch) == (36, 30, 3)
    text = out.getvalue()
    assert "warning:" in text and "3 of 3 prompts differ in length" in text and "the server counted 36" in text
