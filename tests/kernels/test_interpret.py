"""kernels.interpret.interpreting: the one TRITON_INTERPRET test, agreeing with Triton's own reading."""

import pytest

from kernels.interpret import interpreting


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), ("", False), ("true", True)])
def test_follows_the_variable_as_triton_reads_it(monkeypatch, value, expected):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is expected
    knobs = pytest.importorskip("triton.knobs")
    assert knobs.runtime.interpret is expected


def test_unset_means_compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert interpreting() is False
