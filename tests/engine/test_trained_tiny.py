"""The trained `tiny-py` model (engine/model_weights/tiny-py, made by scripts/train_tiny.py) and its pipeline.

- The shipped model, run by the engine on held-out stdlib files, predicts far better than chance,
  and so does its MTP layer (thresholds: docs/tiny_model.md's measurements with a wide margin;
  random weights give a loss near or above log(264) = 5.58 and an MTP top-1 accuracy near 1/264).
- It is the default model.
- The training model exports to a checkpoint that the engine loads and runs to the same logits
  (main model and MTP layer), so what is trained is what is served.
- The corpus split is by file and deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.checkpoint.registry import lookup
from scripts import tiny_corpus

WEIGHTS = lookup("tiny-py").weights_dir()
needs_weights = pytest.mark.skipif(
    not (WEIGHTS / "model.safetensors.index.json").is_file(),
    reason="the trained tiny-py weights are not in engine/model_weights/tiny-py: "
           "train them with scripts/train_tiny.py (docs/tiny_model.md)")

# Measured on this sample (8 held-out windows of 128 bytes, Python 3.11's stdlib): main loss 1.15, MTP loss 1.15,
# MTP top-1 0.70, top-4 0.86, MTP top-1 = main greedy 0.81 (64 windows of 256: 0.995 / 0.93 / 0.745 / 0.89 /
# 0.83). The same architecture with random weights (--load-format dummy): 5.59 / 5.58 / 0.0 / 0.008 / 0.006.
# The thresholds leave room for other Python versions' stdlib files.
MAX_MAIN_LOSS = 1.6  # nats per byte; uniform over the vocabulary: 5.58
MAX_MTP_LOSS = 1.6
MIN_MTP_TOP1 = 0.55  # chance: 1 / 264
MIN_MTP_TOP4 = 0.75
MIN_MTP_AGREE = 0.65  # MTP's top-1 = the main model's greedy next token: a one-token draft's acceptance


@pytest.fixture(scope="module")
def trained():
    from engine.engine import Engine

    return Engine(model="tiny-py", device="cpu", dtype="float32")


@needs_weights
def test_held_out_loss_and_mtp_accuracy(trained):
    from scripts.eval_tiny import engine_metrics

    m = engine_metrics(trained, tiny_corpus.held_out_windows(130, 8))
    uniform = math.log(trained.runner.config.vocab_size)
    assert m["main_loss"] < MAX_MAIN_LOSS < uniform / 3, m
    assert m["mtp_loss"] < MAX_MTP_LOSS, m
    assert m["mtp_top1"] > MIN_MTP_TOP1 and m["mtp_top4"] > MIN_MTP_TOP4, m
    assert m["mtp_agree_main"] > MIN_MTP_AGREE, m


@needs_weights
def test_greedy_text_is_python_like(trained):
    from engine.sampling import SamplingParams

    out = trained.generate(["import os\nimport "], SamplingParams(temperature=0, max_new_tokens=24))[0]
    assert all(c.isprintable() or c in "\n\t" for c in out.text), out.text
    assert any(word in out.text for word in ("sys", "re", "os", "import", "_")), out.text


@needs_weights
def test_tiny_py_is_the_default_model():
    from engine.args import EngineArgs
    from engine.checkpoint.resolve import resolve_model

    args = EngineArgs()
    assert args.model.model == "tiny-py"
    r = resolve_model(args.model)
    assert r.path == WEIGHTS and r.config.num_nextn_predict_layers == 1 and r.tokenizer_path == WEIGHTS


def test_corpus_split_is_by_file_and_deterministic():
    train, held = tiny_corpus.split_files()
    assert train and held and not set(train) & set(held)
    assert train == sorted(train) and tiny_corpus.split_files() == (train, held)
    assert all(tiny_corpus.is_held_out(f) for f in held) and not any(tiny_corpus.is_held_out(f) for f in train)
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.12
    assert not any(part in ("test", "tests", "site-packages") for f in train for part in f.split("/")[:-1])


def test_training_model_exports_what_the_engine_runs(tmp_path):
    """A randomly initialised training model, exported like scripts/train_tiny.py does, gives the engine's
    logits (main model, then the MTP layer fed the main model's hidden states)."""
    from safetensors.torch import load_file

    from engine.checkpoint.config import parse_config
    from engine.engine import Engine
    from engine.forward_batch import ForwardMode
    from scripts.eval_tiny import _forward
    from scripts.tiny_train_model import TinyDeepseek, load_hf_state_dict
    from scripts.train_tiny import config_dict, export

    config = config_dict()
    torch.manual_seed(0)
    model = TinyDeepseek(parse_config(config), 64)
    with torch.no_grad():  # routers far from ties, so both sides pick the same experts
        for m in model.moe_layers():
            m.gate.normal_(0, 1.0)
            m.e_score_correction_bias.normal_(0, 0.1)
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(5.0)  # non-trivial activations
    export(model, tmp_path, config)
    sd = {}
    for f in tmp_path.glob("*.safetensors"):
        sd.update(load_file(str(f)))
    load_hf_state_dict(model, sd)  # the bf16-rounded weights the engine reads
    model.eval()
    ids = list(b"def f(x):\n    return x * 2  # twice\n")
    tok = torch.tensor([ids])
    with torch.no_grad():
        h = model.hidden(tok[:, :-1])
        main, mtp = model.main_logits(h)[0], model.mtp_logits(model.mtp_hidden(tok[:, 1:], h))[0]
    eng = Engine(model=str(tmp_path), device="cpu", dtype="float32")
    out = _forward(eng.runner, ForwardMode.EXTEND, ids[:-1])
    torch.testing.assert_close(out.logits, main, atol=2e-4, rtol=1e-4)
    draft = _forward(eng.runner, ForwardMode.DRAFT_EXTEND, ids[1:], out.hidden, mtp=True)
    torch.testing.assert_close(draft.logits, mtp, atol=2e-4, rtol=1e-4)
    assert main.std() > 0.1 and mtp.std() > 0.1  # logits that would show a wrongly mapped tensor
