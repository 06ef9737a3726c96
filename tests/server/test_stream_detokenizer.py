"""The streamed-text detokenizer on the tokenizer's incremental decoder (`text_stream`) against a whole decode.

Whatever the pushes, the pieces joined with the flush equal decoding every id at once, no piece shows half a
character, and when the decoder refuses a text the Python window carries on with the same result. Checked on the
built-in byte-level tokenizer and on a SentencePiece-style one (Metaspace + byte fallback: where a word's leading
space depends on what came before)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine.checkpoint.registry import MODELS
from engine.checkpoint.tokenizer import load_tokenizer
from engine.scheduler.detokenizer import IncrementalDetokenizer, StreamDetokenizer, text_stream

TEXTS = ["plain ascii words here", "héllo wörld, naïve café", "数学 🙂 mixed ✓ end", "🙂🙂 a 🙂", "x\ny\n\n z"]


def _spm_tokenizer(tmp_path):
    """A Llama-style tokenizer: '▁' word starts, byte-fallback tokens for what the vocabulary lacks."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁plain", "▁ascii", "▁words",
              "▁here", "▁h", "llo", "▁w", "rld", ",", "▁na", "ve", "▁caf", "▁a", "x", "y", "▁z", "▁end", "▁mixed"]
    tok = RustTokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "clean_up_tokenization_spaces": False}))
    return load_tokenizer(tmp_path)


@pytest.fixture(params=["bytelevel", "sentencepiece"])
def tokenizer(request, tmp_path):
    if request.param == "bytelevel":
        tok = load_tokenizer(MODELS["tiny-py"].weights_dir())
        return tok, range(tok.hf.vocab_size)
    # random runs of byte-fallback tokens decode differently as a whole (a run with a broken character shows
    # every byte of it as U+FFFD): draw the random ids from the other pieces
    tok = _spm_tokenizer(tmp_path)
    return tok, [0, 1, 2, *range(259, tok.hf.vocab_size)]


def _id_sequences(tok, random_ids, rng):
    """Encoded texts (some cut mid-character), the same with special tokens inside, and random ids."""
    specials = [tok.hf.bos_token_id, tok.hf.eos_token_id]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        yield ids
        yield ids[:-1]
        yield [*ids[:3], rng.choice(specials), *ids[3:]]
    for _ in range(20):
        yield [rng.choice(random_ids) for _ in range(rng.randint(1, 40))]


def _pieces(detok, ids, rng) -> list[str]:
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        pieces.append(detok.push(ids[i:i + n]))
        i += n
    return pieces + [detok.flush()]


@pytest.mark.parametrize("skip_special", [True, False])
def test_streamed_text_equals_the_whole_decode(tokenizer, skip_special):
    tokenizer, random_ids = tokenizer
    rng = random.Random(7)
    for ids in _id_sequences(tokenizer, random_ids, rng):
        detok = text_stream(tokenizer, skip_special)
        assert isinstance(detok, StreamDetokenizer)
        pieces = _pieces(detok, ids, rng)
        whole = tokenizer.decode(ids, skip_special)
        assert "".join(pieces) == whole, ids
        assert not any("\ufffd" in p for p in pieces[:-1]) or "\ufffd" in whole, (ids, pieces)
        python = IncrementalDetokenizer(tokenizer, skip_special)
        assert "".join(_pieces(python, ids, random.Random(1))) == whole


def test_a_refused_text_goes_on_in_python(tokenizer):
    """The decoder raises part-way (as tokenizers' DecodeStream does on a text that does not extend its prefix):
    the rest is decoded by the Python window, and the whole is still the whole decode."""
    tokenizer, random_ids = tokenizer
    rng = random.Random(3)
    for ids in _id_sequences(tokenizer, random_ids, rng):
        for fail_at in (0, len(ids) // 2, len(ids) - 1):
            step, calls = tokenizer.stream_step(True), [0]

            def flaky(token_id, step=step, calls=calls, fail_at=fail_at):
                calls[0] += 1
                if calls[0] > fail_at:
                    raise RuntimeError("invalid prefix")
                return step(token_id)

            detok = StreamDetokenizer(tokenizer, True, flaky)
            assert "".join(_pieces(detok, ids, rng)) == tokenizer.decode(ids, True), (ids, fail_at)


def test_a_tokenizer_without_a_rust_decoder_gets_the_python_window():
    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    detok = text_stream(Bytes())
    assert isinstance(detok, IncrementalDetokenizer)
    assert "".join(detok.push([b]) for b in "é🙂".encode()) + detok.flush() == "é🙂"
