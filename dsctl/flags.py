"""Build Typer options from `engine.args.EngineArgs`, and turn EngineArgs back into flags.

Flags are defined once, as dataclass fields with metadata. `engine_command`
wraps a command function so that the fields of the requested groups become
`--kebab-case` options (in one `--help` panel per group), and the function receives
one `EngineArgs`.
`to_argv` is the inverse: the flags that reproduce an EngineArgs (for commands
that start `dsctl` sub-processes, e.g. `bench ablation`).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Callable, Iterable

import typer

from dsctl.option_sets import merge_options
from engine.args import GROUPS, EngineArgs, cli_name, fields_in_groups

SERVER = "server"


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _option_for(group: str, f: dataclasses.Field) -> inspect.Parameter:
    meta = f.metadata
    typ = typing.get_type_hints(GROUPS[group][0])[f.name]
    default = _default(f)
    help_text = meta["help"]
    if meta.get("choices"):
        help_text += f" [{'|'.join(meta['choices'])}]"
    names = [f"--{cli_name(f.name)}", *meta.get("aliases", ())]
    panel = GROUPS[group][1]
    if typ is bool and not default:  # a plain switch: --flag
        option = typer.Option(default, *names, help=help_text, rich_help_panel=panel, show_default=False)
    elif typ is bool:  # on by default: --flag/--no-flag
        names[0] = f"{names[0]}/--no-{cli_name(f.name)}"
        option = typer.Option(default, *names, help=help_text, rich_help_panel=panel)
    else:
        option = typer.Option(default, *names, help=help_text, rich_help_panel=panel, show_default=default is not None)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=typ)


def engine_command(*groups: str) -> Callable[[Callable], Callable]:
    """Decorate `fn(args: EngineArgs, **own_options)`; adds the groups' flags to its CLI."""
    params = [_option_for(g, f) for g, f in fields_in_groups(groups)]
    return lambda fn: merge_options(fn, params, lambda values: EngineArgs.of(**values), "args")


def engine_groups(exclude: Iterable[str] = ()) -> tuple[str, ...]:
    """Every flag group of EngineArgs (in CLI order), less `exclude`: new groups are picked up as they land."""
    return tuple(g for g in GROUPS if g not in set(exclude))


def non_server_groups() -> tuple[str, ...]:
    """The groups an offline command (no HTTP server) takes."""
    return engine_groups(exclude=(SERVER,))


def to_argv(args: EngineArgs, groups: Iterable[str]) -> list[str]:
    """Flags that make `engine_command(*groups)` rebuild `args` (fields left at their default are omitted)."""
    out: list[str] = []
    for g, f in fields_in_groups(tuple(groups)):
        value = getattr(getattr(args, g), f.name)
        if value == _default(f):
            continue
        flag = f"--{cli_name(f.name)}"
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{cli_name(f.name)}")
        elif isinstance(value, (list, tuple)):
            for item in value:
                out += [flag, str(item)]
        elif value is not None:
            out += [flag, str(value)]
    return out


# Options that take several values the way SGLang's scripts write them (`--batch-size 1 8 32`).
MULTI_VALUE_OPTIONS = frozenset({"--batch-size", "--input-len", "--output-len"})


def expand_multi_values(argv: list[str]) -> list[str]:
    """Rewrite `--opt a b c` as `--opt a --opt b --opt c` for MULTI_VALUE_OPTIONS (Typer repeats options)."""
    out: list[str] = []
    current = None
    for tok in argv:
        if tok.startswith("-"):
            current = tok if tok in MULTI_VALUE_OPTIONS else None
            out.append(tok)
        elif current is not None and out[-1] != current:
            out += [current, tok]
        else:
            out.append(tok)
    return out
