"""Tokenizer.decode's direct call into the Rust tokenizer gives exactly what transformers' decode gives
(random ids, special tokens included or skipped), for the built-in tiny tokenizer and a generated dummy one."""

from __future__ import annotations

import pytest
import torch

from engine.args import ModelArgs
from engine.checkpoint.resolve import resolve_model
from engine.checkpoint.tokenizer import load_tokenizer


@pytest.mark.parametrize("model", ["tiny", "deepseek-v2-lite"])
def test_fast_decode_equals_transformers_decode(model):
    tok = load_tokenizer(resolve_model(ModelArgs(model=model, load_format="dummy")).tokenizer_path)
    assert tok._fast is not None  # the direct path is the one under test
    vocab = len(tok.hf)
    g = torch.Generator().manual_seed(0)
    for i in range(400):
        n = int(torch.randint(1, 16, (1,), generator=g))
        ids = torch.randint(0, vocab if i % 2 else min(vocab, 300), (n,), generator=g).tolist()
        for skip in (True, False):
            want = tok.hf.decode(ids, skip_special_tokens=skip)
            assert tok.decode(ids, skip) == want
            assert tok.decode_fn(skip)(ids) == want
    special = sorted(tok.eos_ids())
    assert tok.decode(special + [5], True) != tok.decode(special + [5], False)  # specials really are skipped
