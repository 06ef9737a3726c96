"""At 80 columns (COLUMNS=80): `dsctl models`, `dsctl bench --batch-size 1` and the `--help` of every command
read in full: no line wider than the terminal, nothing cut with "…", no empty table column, and every help
text printed as written (no "[a, b]" eaten as rich markup). Wider terminals get the wider layouts."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from dsctl.cli import app
from tests.cli.screen import assert_fits, assert_no_empty_column, run_dsctl

_BOX = re.compile(r"[\s│╭╮╰╯─]")


def _squash(text: str) -> str:
    """Text with whitespace and panel borders removed (help wraps and folds, but keeps every character)."""
    return _BOX.sub("", text)


def _is_group(command) -> bool:
    return hasattr(command, "list_commands")  # typer vendors its own click: no isinstance on click.Group


def _context(command, name: str):
    return command.context_class(command, info_name=name)


def _commands(group, path: tuple[str, ...] = ()):
    yield path, group
    ctx = _context(group, "dsctl")
    for name in group.list_commands(ctx):
        sub = group.get_command(ctx, name)
        if _is_group(sub):
            yield from _commands(sub, path + (name,))
        else:
            yield path + (name,), sub


ROOT = typer.main.get_command(app)
ALL = list(_commands(ROOT))


def test_every_command_is_checked():
    names = {" ".join(p) for p, _ in ALL}
    assert {"models", "download", "tune-moe", "tune-fp8", "serve", "bench", "bench one-batch", "bench ablation",
            "bench serving"} <= names


@pytest.mark.parametrize("path,command", ALL, ids=[" ".join(p) or "dsctl" for p, _ in ALL])
def test_help_at_80_columns_is_whole(path, command):
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    out = res.output
    assert_fits(out)
    squashed = _squash(out)
    ctx = _context(command, path[-1] if path else "dsctl")
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        names, help_text = record
        assert _squash(names) in squashed, f"{names!r} missing or cut in:\n{out}"
        assert _squash(help_text) in squashed, f"help of {names} lost characters:\n{help_text!r}\n{out}"
    first = (command.help or "").partition("\f")[0]
    assert _squash(first) in squashed, out
    if _is_group(command):
        for name in command.list_commands(ctx):
            assert f"│ {name} " in out, out


def test_markup_like_help_text_is_printed_as_written():
    res = CliRunner().invoke(app, ["bench", "serving", "--help"], env={"COLUMNS": "80"})
    assert "[len*ratio, len]" in _squash(res.output).replace("[len*ratio,len]", "[len*ratio, len]")
    assert "Lengths uniform in ;" not in res.output


def test_models_at_80_columns():
    res = run_dsctl("models")
    assert res.returncode == 0, res.stderr
    assert_fits(res.stdout)
    table, = assert_no_empty_column(res.stdout)
    text = " ".join(" ".join(c) for c in table["columns"])
    for needle in ("deepseek-v3", "deepseek-ai/DeepSeek-V3", "61 layers", "hidden 7168", "256 experts", "tiny"):
        assert needle in text, res.stdout


def test_models_uses_the_width_when_there_is_more():
    res = run_dsctl("models", columns=200)
    assert res.returncode == 0, res.stderr
    assert_fits(res.stdout, 200)
    table, = assert_no_empty_column(res.stdout)
    assert len(table["columns"]) >= 6  # one column per field, not the 80-column two-column layout
    assert {"alias", "hub repo id", "layers", "experts"} <= set(table["headers"])


def test_bench_batch_size_1_at_80_columns():
    """As typed by a new user (plain `bench` = one-batch), on the default tiny model."""
    res = run_dsctl("bench", "--batch-size", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert_fits(res.stdout)
    table, = assert_no_empty_column(res.stdout)
    headers = table["headers"]
    assert headers[0] == "batch" and table["columns"][0] == ["1", ""]  # one shape; spread on its second line
    assert {"prefill ms (min-max)", "decode ms (p10-p90)", "decode tok/s"} <= set(headers), headers
    words = " ".join(res.stdout.split())
    assert "input 256, output 32" in words and "median of 3 runs after a warm-up" in words
