"""Generated tokenizers: every registry alias speaks text with --load-format dummy.

The stand-in tokenizer is built by the same code as the built-in tiny models'
tokenizer, at the model's vocabulary size with its config's BOS/EOS ids, and is
loaded through transformers exactly like a real checkpoint's.
"""

from __future__ import annotations

import random

import pytest

from engine.args import ModelArgs
from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import MODELS, lookup
from engine.checkpoint.resolve import resolve_model, tokenizer_source
from engine.checkpoint.tiny_tokenizer import ASSISTANT, BOS, EOS, USER, build_tokenizer
from engine.checkpoint.tokenizer import load_tokenizer

ALIASES = [e.alias for e in MODELS.values() if not e.builtin]


def _random_text(rng: random.Random, n: int) -> str:
    pools = ["abcdefghijklmnopqrstuvwxyz", "ABCXYZ0123456789", " \t\n.,;:!?'\"()[]{}<>/\\|", "éüßñçøå",
             "日本語の文章中文字符", "🙂🚀👍🏽", "\x00\x01\x7f", "ـعربي", "Ωπ∑∞≠"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(n))


@pytest.fixture(scope="module")
def tokenizers():
    """alias -> (resolved model, loaded tokenizer) for every hub alias, dummy weights, nothing downloaded."""
    out = {}
    for alias in ALIASES:
        resolved = resolve_model(ModelArgs(model=alias, load_format="dummy"))
        out[alias] = resolved, load_tokenizer(resolved.tokenizer_path)
    return out


def test_every_dummy_alias_gets_a_generated_tokenizer_of_its_vocab_size(tokenizers):
    assert {r.config.vocab_size for r, _ in tokenizers.values()} == {129280, 102400}  # V3 and V2 shapes
    for alias, (resolved, tok) in tokenizers.items():
        cfg = resolved.config
        assert resolved.tokenizer_source == "generated", alias
        assert tok is not None and len(tok.hf) == cfg.vocab_size, alias
        assert tok.hf.bos_token_id == cfg.bos_token_id and tok.eos_ids() == {cfg.eos_token_id}, alias
        assert tok.hf.model_max_length == cfg.max_position_embeddings


def test_round_trip_of_random_text_with_ids_inside_the_vocabulary(tokenizers):
    rng = random.Random(15)
    for alias, (resolved, tok) in tokenizers.items():
        for _ in range(30):
            text = _random_text(rng, rng.randint(1, 80))
            ids = tok.encode(text)
            assert ids[0] == resolved.config.bos_token_id
            assert all(0 <= i < resolved.config.vocab_size for i in ids)
            assert tok.decode(ids) == text, (alias, text)
            assert len(ids) == 1 + len(text.encode("utf-8"))  # BOS, then one token per byte


def test_every_id_decodes_to_text_and_the_chat_template_works(tokenizers):
    rng = random.Random(3)
    for alias, (resolved, tok) in tokenizers.items():
        cfg = resolved.config
        sample = rng.sample(range(cfg.vocab_size), 2000)
        special = {cfg.bos_token_id, cfg.eos_token_id, tok.hf.convert_tokens_to_ids(USER),
                   tok.hf.convert_tokens_to_ids(ASSISTANT)}
        assert all(tok.decode([i]) != "" for i in sample if i not in special), alias  # random output shows as text
        ids = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "hi"}])
        assert tok.decode(ids, skip_special_tokens=False) == f"{BOS}be brief{USER}hi{ASSISTANT}"
        assert ids[0] == cfg.bos_token_id and all(i < cfg.vocab_size for i in ids)
        text = tok.decode(tok.encode("x") + [cfg.eos_token_id], skip_special_tokens=False)
        assert text.endswith(EOS)


def test_generation_is_deterministic_and_cached(tmp_path, monkeypatch):
    from engine.checkpoint.dummy_tokenizer import generated_tokenizer_dir

    cfg = parse_config(lookup("deepseek-v2-lite").config_dict())
    files = []
    for sub in ("a", "b"):
        monkeypatch.setenv("DSCTL_CACHE_DIR", str(tmp_path / sub))
        first = generated_tokenizer_dir(cfg)
        stamp = (first / "tokenizer.json").stat().st_mtime_ns
        assert generated_tokenizer_dir(cfg) == first and (first / "tokenizer.json").stat().st_mtime_ns == stamp
        assert first.is_relative_to(tmp_path / sub)
        files.append({p.name: p.read_bytes() for p in first.iterdir()})
    assert files[0] == files[1] and {"tokenizer.json", "tokenizer_config.json"} <= set(files[0])


def test_the_builtin_tiny_layout_is_unchanged_by_padding_support():
    tiny = parse_config(lookup("tiny").config_dict())
    tok = build_tokenizer(tiny.bos_token_id, tiny.eos_token_id)  # what the tiny checkpoint writes
    assert tok.get_vocab_size() == 262
    assert [tok.token_to_id(t) for t in (BOS, EOS, USER, ASSISTANT, "<think>", "</think>")] == list(range(256, 262))
    assert tok.encode("A", add_special_tokens=False).ids == [ord("A")]
    padded = build_tokenizer(tiny.bos_token_id, tiny.eos_token_id, tiny.vocab_size)
    assert padded.get_vocab_size() == tiny.vocab_size
    assert padded.encode("hé <think>").ids == tok.encode("hé <think>").ids


def test_bad_ids_are_rejected():
    with pytest.raises(ValueError, match="share"):
        build_tokenizer(5, 5, 1000)
    with pytest.raises(ValueError, match="cannot hold"):
        build_tokenizer(0, 1, 200)
    with pytest.raises(ValueError, match="cannot hold"):
        build_tokenizer(0, 5000, 1000)


def test_tokenizer_source_says_checkpoint_or_generated(tmp_path):
    import shutil

    tiny = resolve_model(ModelArgs(model="tiny"))
    assert tiny.tokenizer_source == "generated" and tiny.tokenizer_path == tiny.path
    assert tokenizer_source(lookup("tiny")) == "generated"
    assert tokenizer_source(lookup("deepseek-v3")) == "generated"  # not in the (offline, empty) HF cache
    # a local checkpoint directory with tokenizer files: its own tokenizer
    local = resolve_model(ModelArgs(model=str(tiny.path), load_format="dummy"))
    assert (local.tokenizer_source, local.tokenizer_path) == ("checkpoint", tiny.path)
    # a local directory with only config.json and dummy weights: a generated one at its vocab size
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny.path / "config.json", bare / "config.json")
    r = resolve_model(ModelArgs(model=str(bare), load_format="dummy"))
    assert r.tokenizer_source == "generated" and r.tokenizer_path != bare
    assert len(load_tokenizer(r.tokenizer_path).hf) == r.config.vocab_size


def test_a_dummy_alias_engine_accepts_text_and_chat():
    """The smallest registry alias (V2-Lite, one layer, random weights) generates from a text prompt."""
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    eng = Engine(model="deepseek-v2-lite", load_format="dummy", num_layers=1, max_model_len=128,
                 max_total_tokens=512, max_running_requests=2)
    assert eng.runner.resolved.tokenizer_source == "generated"
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    out = eng.generate(["Hello, dummy model"], params)[0]
    assert out.prompt_token_ids == eng.tokenizer.encode("Hello, dummy model")
    assert len(out.token_ids) == 3 and all(0 <= i < eng.config.vocab_size for i in out.token_ids)
    assert out.text == eng.tokenizer.decode(out.token_ids) and out.text
    chat = eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert len(eng.generate(input_ids=[chat], sampling_params=params)[0].token_ids) == 3
