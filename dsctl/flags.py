"""Build Typer options from `engine.args.EngineArgs`.

Flags are defined once, as dataclass fields with metadata. `engine_command`
wraps a command function so that the fields of the requested groups become
`--kebab-case` options, and the function receives one validated `EngineArgs`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, Optional

import typer

from engine.args import EngineArgs, cli_name, fields_in_groups

_PANEL = {"model": "Model options", "server": "Server options", "gpu": "Kernel and GPU options"}


def _option_type(f: dataclasses.Field) -> Any:
    hints = typing.get_type_hints(EngineArgs)
    return hints[f.name]


def _option_for(f: dataclasses.Field) -> inspect.Parameter:
    meta = f.metadata
    typ = _option_type(f)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    help_text = meta["help"]
    if meta.get("choices"):
        help_text += f" [{'|'.join(meta['choices'])}]"
    names = [f"--{cli_name(f.name)}", *meta.get("aliases", ())]
    if typ is bool:
        option = typer.Option(default, *names, help=help_text, rich_help_panel=_PANEL.get(meta["group"]))
        if not default:
            option = typer.Option(default, *names, help=help_text, is_flag=True,
                                  rich_help_panel=_PANEL.get(meta["group"]))
    else:
        option = typer.Option(default, *names, help=help_text, rich_help_panel=_PANEL.get(meta["group"]),
                              show_default=default is not None)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=typ)


def engine_command(*groups: str) -> Callable[[Callable], Callable]:
    """Decorate `fn(args: EngineArgs, **own_options)`; adds the groups' flags to its CLI."""

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
        own = [p.replace(annotation=hints.get(name, p.annotation))
               for name, p in sig.parameters.items() if name != "args"]
        engine_fields = fields_in_groups(groups)
        engine_names = {f.name for f in engine_fields}

        @functools.wraps(fn)
        def command(**kwargs):
            engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in engine_names}
            args = EngineArgs(**engine_kwargs)
            return fn(args, **kwargs)

        params = own + [_option_for(f) for f in engine_fields]
        command.__signature__ = sig.replace(parameters=params, return_annotation=None)
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__
        return command

    return wrap


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
