"""Checks on terminal output as a user sees it: line widths in cells, nothing cut, no empty table column.

Rich tables are read back from the text: a table starts at a top border (┏...┓ with a header,
┌...┐ without), its column boundaries are where that border has ┳/┓ (or ┬/┐), header lines
end at ┡, and the body ends at └. Wide characters (✅ takes two cells) are expanded to their
cell width so that the boundaries line up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.cells import cell_len

REPO = Path(__file__).resolve().parents[2]
TOP_CORNERS = {"┏": "┳┓", "┌": "┬┐"}


def run_dsctl(*args, columns: int = 80, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m dsctl ARGS` in a fresh process, with COLUMNS set as a terminal of that width would."""
    full_env = dict(os.environ, COLUMNS=str(columns), PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-m", "dsctl", *map(str, args)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def cells(line: str) -> list[str]:
    """One entry per terminal cell: a wide character, then "" for the cell it also covers."""
    out: list[str] = []
    for ch in line:
        out.append(ch)
        out.extend([""] * (cell_len(ch) - 1))
    return out


def assert_fits(text: str, width: int = 80) -> None:
    """No line wider than the terminal and no text cut short with an ellipsis."""
    for line in text.splitlines():
        assert cell_len(line) <= width, f"{cell_len(line)} cells > {width}: {line!r}"
    assert "…" not in text, text


def tables(text: str) -> list[dict]:
    """Every rich table in `text`: {"headers": [...], "columns": [[cell text per line]...]} per table."""
    lines = text.splitlines()
    found = []
    i = 0
    while i < len(lines):
        row = cells(lines[i])
        start = next((k for k, c in enumerate(row) if c in TOP_CORNERS), None)
        if start is None:
            i += 1
            continue
        joints = TOP_CORNERS[row[start]]
        bounds = [start] + [k for k, c in enumerate(row) if c in joints]
        has_header = row[start] == "┏"
        headers = [""] * (len(bounds) - 1)
        columns: list[list[str]] = [[] for _ in headers]
        in_header = has_header
        i += 1
        while i < len(lines) and not lines[i].lstrip().startswith(("└", "┗")):
            row = cells(lines[i])
            i += 1
            if row[bounds[0]:bounds[0] + 1] in (["┡"], ["├"], ["┣"]):
                in_header = False
                continue
            parts = ["".join(row[a + 1:b]).strip() for a, b in zip(bounds, bounds[1:])]
            for k, part in enumerate(parts):
                if in_header:
                    headers[k] = f"{headers[k]} {part}".strip()
                else:
                    columns[k].append(part)
        found.append({"headers": headers if has_header else None, "columns": columns})
        i += 1
    return found


def assert_no_empty_column(text: str) -> list[dict]:
    """Every column of every table has a header (when the table has headers) and some text in its body."""
    found = tables(text)
    assert found, f"no table in:\n{text}"
    for table in found:
        for k, column in enumerate(table["columns"]):
            if table["headers"] is not None:
                assert table["headers"][k], f"column {k} has no header:\n{text}"
            assert any(column), f"column {k} ({table['headers'] and table['headers'][k]}) is empty:\n{text}"
    return found
