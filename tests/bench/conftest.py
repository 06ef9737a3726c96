"""Fixtures for `dsctl bench serving` tests: the fake OpenAI server and an in-process CLI runner."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from engine.errors import DsctlError
from tests.bench.fake_openai import Behaviour, FakeOpenAI


@pytest.fixture
def make_server():
    servers = []

    def make(**behaviour) -> FakeOpenAI:
        server = FakeOpenAI(Behaviour(**behaviour)).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


class Result:
    def __init__(self, exit_code: int, output: str, exception=None):
        self.exit_code, self.output, self.exception = exit_code, output, exception


def run_bench(*args: str) -> Result:
    """`dsctl bench ...` in-process; DsctlError becomes its exit code as in dsctl.cli.main."""
    from dsctl import cmd_bench

    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        pass

    cmd_bench.register(app)
    result = CliRunner().invoke(app, ["bench", *args])
    if isinstance(result.exception, DsctlError):
        return Result(result.exception.exit_code, result.output + f"\nerror: {result.exception}", result.exception)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Result(result.exit_code, result.output)
