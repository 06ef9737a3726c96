"""The grammar's view of the vocabulary agrees with the detokenizer (CPU, no model): dsctl's byte-level
tokenizer at a padded vocabulary, as a dummy model gets it. Each token's bytes in xgrammar's TokenizerInfo
are what the tokenizer decodes it to (special tokens: none, as skip_special_tokens shows them); a json_schema
matcher driven by seeded random logits (greedy, biased to the non-ASCII byte tokens) yields strict UTF-8 that
parses; a surrogate's bytes (ED A0 80, which xgrammar's character classes admitted) are refused."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.checkpoint.tiny_tokenizer import byte_alphabet, write_tokenizer
from engine.checkpoint.tokenizer import Tokenizer
from engine.grammar.compiler import GrammarCompiler
from engine.grammar.spec import GrammarSpec
from engine.grammar.utf8 import scalar_only

VOCAB = 1024
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                    "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    cfg = parse_config({**lookup("tiny").config_dict(), "vocab_size": VOCAB})
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, cfg, pad=True)
    return Tokenizer(path)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, tok.eos_ids(), threads=1)


def _byte_ids(tok) -> list[int]:
    vocab = tok.hf.get_vocab()
    return [vocab[c] for c in byte_alphabet()]


def test_token_bytes_match_the_detokenizer(tok, compiler):
    decoded = compiler.info.decoded_vocab
    special = set(tok.hf.all_special_ids)
    byte_ids = _byte_ids(tok)
    for b, i in enumerate(byte_ids):  # one byte each (a lone byte >= 0x80 decodes to U+FFFD alone)
        assert decoded[i] == bytes([b])
        assert tok.decode([byte_ids[0x41], i, byte_ids[0x41]]).encode("utf-8", "replace") == \
            b"A" + bytes([b]).decode("utf-8", "replace").encode() + b"A"
    others = [i for i in torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)).tolist()
              if i not in byte_ids][:200] + sorted(special)
    for i in others:
        assert decoded[i] == tok.decode([i]).encode(), i
    assert special and all(decoded[i] == b"" for i in special)
    assert set(compiler.info.special_token_ids) >= special - set(compiler.info.stop_token_ids)


def test_surrogates_are_refused_inside_strings(tok, compiler):
    b = _byte_ids(tok)
    m = xgr.GrammarMatcher(compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))))
    assert m.accept_string('{"name": "')
    assert m.accept_token(b[0xE6]) and m.accept_token(b[0xA3]) and m.accept_token(b[0x92])  # 棒
    assert m.accept_token(b[0xED]) and not m.accept_token(b[0xA0])  # U+D800 (U+D000..U+D7FF stay)
    assert m.accept_token(b[0x9F]) and m.accept_token(b[0xBF])


def test_scalar_only_splits_positive_classes():
    g = xgr.Grammar.from_ebnf(scalar_only(str(xgr.Grammar.from_regex(".[\u4e00-\U0001f600]"))))
    assert str(g).strip() == r"root ::= (([\0-\ud7ff\ue000-\U0010ffff] [\u4e00-\ud7ff\ue000-\U0001f600]))"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_greedy_json_is_strict_utf8(tok, compiler, seed):
    compiled = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    matcher, gen = xgr.GrammarMatcher(compiled), torch.Generator().manual_seed(seed)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    bias = torch.zeros(VOCAB)
    bias[_byte_ids(tok)[0x80:]] = 3.0  # multi-byte characters spelled byte by byte, as a random model does
    out = []
    for _ in range(400):
        if matcher.is_terminated():
            break
        logits = torch.randn(1, VOCAB, generator=gen) + bias
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        out.append(token)
    assert matcher.is_terminated()
    raw = b"".join(compiler.info.decoded_vocab[t] for t in out)
    text = raw.decode("utf-8")  # strict: no surrogate, no stray byte
    assert tok.decode(out) == text
    doc = json.loads(text, strict=False)
    assert set(doc) == {"name", "tags"} and len(doc["name"]) <= 12
    assert any(ord(c) > 0x7F for c in text)  # the bias reached non-ASCII characters
