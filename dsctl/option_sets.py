"""Option sets: several CLI options defined once and shared by commands.

An option set is a dataclass whose fields are declared with `option(...)`; the
decorator `with_options(Cls)` turns `fn(opts: Cls, **own_options)` into a Typer
command that has its own options plus every field of `Cls` as `--kebab-case`,
and calls `fn` with one `Cls` built from them. `merge_options` is the general
form; `dsctl.flags.engine_command` uses it for `EngineArgs`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, Optional

import typer


def option(default: Any, help: str, *, panel: Optional[str] = None, **typer_kwargs) -> Any:
    """A dataclass field that is also a CLI option `--field-name` (typer_kwargs go to typer.Option)."""
    return dataclasses.field(default=default, metadata={"help": help, "panel": panel, "typer": typer_kwargs})


def cli_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def params_of(cls: type) -> list[inspect.Parameter]:
    """One keyword-only Typer parameter per field of the option-set dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    params = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        opt = typer.Option(f.default, cli_name(f.name), help=meta["help"], rich_help_panel=meta["panel"],
                           **meta["typer"])
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=hints[f.name]))
    return params


def merge_options(fn: Callable, params: list[inspect.Parameter], build: Callable[[dict], Any],
                  arg_name: str = "args", own_first: bool = True) -> Callable:
    """A command with fn's own options and `params` (after them, or before when not own_first);
    fn gets build({param: value}) as `arg_name`."""
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    own = [p.replace(annotation=hints.get(name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
           for name, p in sig.parameters.items() if name != arg_name]
    names = {p.name for p in params}

    @functools.wraps(fn)
    def command(**kwargs):
        shared = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        return fn(**{arg_name: build(shared)}, **kwargs)

    all_params = own + params if own_first else params + own
    command.__signature__ = sig.replace(parameters=all_params, return_annotation=None)
    command.__annotations__ = {p.name: p.annotation for p in all_params}
    del command.__wrapped__
    return command


def with_options(cls: type, arg_name: str = "opts", own_first: bool = False) -> Callable[[Callable], Callable]:
    """Decorate `fn(opts: cls, **own)`: adds cls's fields to its CLI, before fn's own options unless own_first."""
    return lambda fn: merge_options(fn, params_of(cls), lambda values: cls(**values), arg_name, own_first)
