"""Speculative-decoding flags: defaults, inconsistent values, and start-up errors for a checkpoint that
cannot draft (no MTP layer, a draft with another vocabulary)."""

import pytest

from engine.args import EngineArgs
from engine.errors import UsageError
from engine.runtime.launch_checks import check_launch


def _args(**kw):
    return EngineArgs.of(device="cpu", **kw)


def test_defaults_and_alias():
    spec = _args(speculative_algorithm="nextn").validate().speculative
    assert spec.enabled and spec.speculative_algorithm == "NEXTN"
    assert (spec.speculative_num_steps, spec.speculative_eagle_topk, spec.speculative_num_draft_tokens) == (3, 4, 8)
    assert not EngineArgs().speculative.enabled


def test_cli_alias_parses():
    from typer.testing import CliRunner

    from dsctl.cli import app

    res = CliRunner().invoke(app, ["generate", "--help"])
    assert "--speculative-algo" in res.output and "--speculative-num-draft-tokens" in res.output


@pytest.mark.parametrize("kw, words", [
    (dict(speculative_num_draft_tokens=14), "at most 1 + --speculative-num-steps"),
    (dict(speculative_num_draft_tokens=1), ">= 2"),
    (dict(speculative_num_steps=0), ">= 1"),
    (dict(speculative_eagle_topk=0), ">= 1"),
    (dict(speculative_algorithm="MEDUSA"), "must be one of"),
])
def test_inconsistent_values(kw, words):
    with pytest.raises(UsageError, match=words.replace("+", r"\+")):
        _args(**{"speculative_algorithm": "NEXTN", **kw}).validate()


def test_draft_without_algorithm():
    with pytest.raises(UsageError, match="needs --speculative-algorithm"):
        _args(speculative_draft="tiny").validate()


def test_checkpoint_without_mtp_layer_fails_at_start_up():
    args = _args(model="deepseek-v2-lite", load_format="dummy", speculative_algorithm="NEXTN")
    with pytest.raises(UsageError, match="no MTP/NextN layer; give a draft with --speculative-draft") as e:
        check_launch(args)
    assert "\n" not in str(e.value)


def test_draft_with_another_vocabulary():
    args = _args(model="tiny", load_format="dummy", speculative_algorithm="NEXTN", speculative_draft="deepseek-v3")
    with pytest.raises(UsageError, match="vocabulary has 129280 tokens, the target's 320"):
        check_launch(args)


def test_draft_checkpoint_loads_its_mtp_layer():
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    eng = Engine(model="tiny", device="cpu", dtype="float32", speculative_algorithm="NEXTN",
                 speculative_draft="tiny-fp8", max_total_tokens=512)
    assert eng.runner.mtp.layer.self_attn.layer_id == eng.runner.num_layers
    out = eng.generate(input_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(max_new_tokens=4))
    assert out[0].token_ids


