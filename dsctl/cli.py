"""The `dsctl` command line: one Typer app, one module per command.

Command modules import only light packages at module level (typer, rich,
engine.args); torch and triton are imported inside the command bodies so that
`dsctl --help` stays fast and works without CUDA.
"""

from __future__ import annotations

import importlib
import sys

import typer

from dsctl.flags import expand_multi_values
from dsctl.help_format import use_help_format
from engine.errors import DsctlError

app = typer.Typer(
    name="dsctl",
    help="Download, tune, benchmark and serve DeepSeek-V2/V3/R1.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


# Each module exposes `register(app)`; add a command by adding its module here.
COMMAND_MODULES = ("cmd_models", "cmd_generate", "cmd_download", "cmd_tune", "cmd_tune_mla", "cmd_bench", "cmd_serve",
                   "cmd_place_experts")


def _register() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"dsctl.{name}").register(app)
    use_help_format(app)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # lazy: only for --version

    try:
        return version("dsctl")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dsctl {_version()}")
        raise typer.Exit()


@app.callback()
def _root(show_version: bool = typer.Option(False, "--version", help="Print dsctl's version and exit.",
                                            callback=_print_version, is_eager=True)) -> None:
    """Download, tune, benchmark and serve DeepSeek-V2/V3/R1."""


_register()


def main() -> None:
    try:
        app(args=expand_multi_values(sys.argv[1:]), prog_name="dsctl")
    except DsctlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
