"""`--help` pages that read well at any width, with help text printed as written.

Typer's rich help puts options in a six-column table that, at 80 columns, cuts
option names ("--max-concurren…") and reads help text as rich markup, so a
"[a, b]" in a help string disappears. `HelpCommand` / `HelpGroup` render the
same content (usage, description, arguments, option panels by `rich_help_panel`,
sub-commands) from click's public help records: two columns when the names
leave room for the help text, otherwise each name on its own line with its help
indented below. Help text is plain `rich.text.Text`, never markup.

`DefaultCommandGroup` also runs a default sub-command when the first argument is
not one (`dsctl bench --batch-size 1` = `dsctl bench one-batch --batch-size 1`).
`use_help_format(app)` gives every command and group of a Typer app these classes.
"""

from __future__ import annotations

import inspect

from rich.console import Console
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

_MIN_HELP_WIDTH = 36  # below this, names go on their own line
_DEFAULT_PANEL = "Options"
_ARGUMENTS_PANEL = "Arguments"


def _paragraphs(text: str) -> list[str]:
    text = inspect.cleandoc(text or "").partition("\f")[0]
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def _help_text(text: str):
    out = Text(text, overflow="fold")  # a word longer than the column wraps; never cut with "…"
    out.highlight_regex(r"\[(default|required|env var)[^\]]*\]", "dim")
    return out


def _param_panels(command, ctx) -> dict[str, list[tuple[str, str]]]:
    panels: dict[str, list[tuple[str, str]]] = {_ARGUMENTS_PANEL: [], _DEFAULT_PANEL: []}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        default = _ARGUMENTS_PANEL if param.param_type_name == "argument" else _DEFAULT_PANEL
        panels.setdefault(getattr(param, "rich_help_panel", None) or default, []).append(record)
    return {name: rows for name, rows in panels.items() if rows}


def _command_rows(group, ctx) -> list[tuple[str, str]]:
    rows = []
    for name in group.list_commands(ctx):
        sub = group.get_command(ctx, name)
        if sub is None or sub.hidden:
            continue
        first = _paragraphs(sub.short_help or sub.help or "")
        rows.append((name, first[0] if first else ""))
    return rows


def _panel(title: str, rows: list[tuple[str, str]], width: int):
    inner = width - 4  # borders and the panel's own padding
    name_width = max(len(name) for name, _ in rows)
    grid = Table.grid(padding=(0, 2), expand=True)
    if name_width + 2 + _MIN_HELP_WIDTH <= inner:
        grid.add_column(no_wrap=True)
        grid.add_column(ratio=1)
        for name, text in rows:
            grid.add_row(Text(name, style="bold cyan"), _help_text(text))
    else:
        grid.add_column(ratio=1)
        for name, text in rows:
            grid.add_row(Text(name, style="bold cyan", overflow="fold"))
            if text:
                grid.add_row(Padding(_help_text(text), (0, 0, 0, 4)))
    return Panel(grid, title=title, title_align="left", border_style="dim")


def render_help(command, ctx) -> None:
    """Print `command`'s help page to stdout, fitted to the terminal width (COLUMNS)."""
    console = Console(highlight=False)
    usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
    console.print(Text.assemble(("Usage: ", "yellow"), (usage, "bold")))
    for i, para in enumerate(_paragraphs(command.help or "")):
        console.print()
        console.print(Text(para, style="" if i == 0 else "dim"))
    console.print()
    for title, rows in _param_panels(command, ctx).items():
        console.print(_panel(title, rows, console.width))
    if isinstance(command, TyperGroup):
        rows = _command_rows(command, ctx)
        if rows:
            console.print(_panel("Commands", rows, console.width))
    for para in _paragraphs(command.epilog or ""):
        console.print(Text(para, style="dim"))


class HelpCommand(TyperCommand):
    def format_help(self, ctx, formatter) -> None:
        render_help(self, ctx)


class HelpGroup(TyperGroup):
    def format_help(self, ctx, formatter) -> None:
        render_help(self, ctx)


class DefaultCommandGroup(HelpGroup):
    """A group that hands its arguments to `default_command` unless they start with a sub-command
    name or a help option (so `--help` still shows the group's page)."""

    default_command = ""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        first = args[0] if args else None
        if self.default_command and first not in self.commands and first not in ctx.help_option_names:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


def _unset(cls, default: type) -> bool:
    """True when Typer would use its own class (None, Typer's default placeholder, or the default itself)."""
    return cls is None or cls is default or not isinstance(cls, type)


def use_help_format(app) -> None:
    """Give every command and group of `app` (recursively) that chose no class of its own these classes."""
    if _unset(app.info.cls, TyperGroup):
        app.info.cls = HelpGroup
    for info in app.registered_commands:
        if _unset(info.cls, TyperCommand):
            info.cls = HelpCommand
    for group in app.registered_groups:
        use_help_format(group.typer_instance)
