"""Turn `--model` into a checkpoint directory and a ModelConfig.

MODEL may be a registry alias (`deepseek-v3`, `tiny`, ...), a local checkpoint
directory, or a hub repo id already in the local Hugging Face cache. With
`--load-format dummy` a known alias needs no files at all.

The tokenizer comes from the checkpoint when it has tokenizer files; a dummy
model without them (and the built-in models) gets the byte-level tokenizer dsctl
generates at the model's vocab size (engine/checkpoint/dummy_tokenizer.py), so text prompts
and chat work on every registry alias. `tokenizer_source` says which one it is.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from engine.args import ModelArgs
from engine.checkpoint.check import require_complete_checkpoint
from engine.checkpoint.config import ModelConfig, load_config, parse_config
from engine.checkpoint.dummy_tokenizer import generated_tokenizer_dir
from engine.checkpoint.registry import ModelEntry, lookup
from engine.errors import CheckpointError, UsageError

log = logging.getLogger("dsctl.resolve")
TokenizerSource = Literal["checkpoint", "generated"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class ResolvedModel:
    name: str
    path: Optional[Path]  # None: dummy weights and no local files
    config: ModelConfig
    dummy: bool
    tokenizer_path: Optional[Path] = None  # directory with tokenizer.json; None: no tokenizer (token ids only)
    tokenizer_source: Optional[TokenizerSource] = None  # "checkpoint" (real) or "generated" (byte-level stand-in)


def has_tokenizer(path: Optional[Path]) -> bool:
    return path is not None and any((path / name).is_file() for name in TOKENIZER_FILES)


def _tokenizer(entry: Optional[ModelEntry], path: Optional[Path], cfg: ModelConfig,
               dummy: bool) -> tuple[Optional[Path], Optional[TokenizerSource]]:
    if entry is not None and entry.builtin:
        return path, "generated"  # the built-in checkpoints carry the generated tokenizer
    if has_tokenizer(path):
        return path, "checkpoint"
    if dummy:
        try:
            return generated_tokenizer_dir(cfg), "generated"
        except ValueError as exc:  # a config no byte-level tokenizer fits (vocab too small, BOS == EOS)
            log.warning("no tokenizer for this dummy model (%s): only token-id prompts will work", exc)
    return None, None


def tokenizer_source(entry: ModelEntry, revision: Optional[str] = None) -> TokenizerSource:
    """Which tokenizer `--model <alias> --load-format dummy` gets on this machine: "checkpoint" when the
    hub repo's tokenizer files are in the local Hugging Face cache, else "generated" (a real load
    needs the download, which brings them). Looks at local files only; builds nothing."""
    if entry.builtin:
        return "generated"
    return "checkpoint" if has_tokenizer(_cached_snapshot(entry.repo_id, revision)) else "generated"


def registry_tokenizer(name: str, revision: Optional[str] = None) -> Optional[tuple[Path, TokenizerSource]]:
    """(tokenizer directory, source) for a registry alias or its repo id, as a dummy run of it would
    use; None when name is not in the registry. Generates the stand-in tokenizer if needed."""
    entry = lookup(name)
    if entry is None:
        return None
    if entry.builtin:
        return builtin_path(entry), "generated"
    path = _cached_snapshot(entry.repo_id, revision)
    if has_tokenizer(path):
        return path, "checkpoint"
    return generated_tokenizer_dir(parse_config(entry.config_dict())), "generated"


def builtin_path(entry: ModelEntry) -> Path:
    """The checkpoint directory of a built-in model: its shipped trained weights (`tiny-py`), or the
    synthetic checkpoint, generated on first use (`tiny`, `tiny-fp8`, ...)."""
    shipped = entry.weights_dir()
    if shipped is not None:
        if not (shipped / "config.json").is_file():
            raise CheckpointError(f"the shipped weights of {entry.alias} are missing from this installation "
                                  f"({shipped}); reinstall dsctl or train them with scripts/train_tiny.py")
        return shipped
    from engine.checkpoint.tiny import materialize  # lazy: torch loads only to generate a built-in checkpoint

    return materialize(entry.alias, entry.config_dict())


def _cached_snapshot(repo_id: str, revision: Optional[str]) -> Optional[Path]:
    # lazy: huggingface_hub's HTTP stack (~0.15 s) loads only to look up a hub id
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError  # lazy: as above

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):  # ValueError: a malformed id
        return None


# A hub repo id: "org/name", each part letters, digits, '-', '_', '.', not starting or ending with '-' or '.'.
_REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")
_PATH_PREFIXES = ("/", "./", "../", "~", ".\\")


def _check_model_form(model: str, local: Path) -> None:
    """A one-line UsageError for a --model that is neither an existing directory nor a well-formed repo id."""
    if not model.strip():
        raise UsageError("--model must not be empty")
    if local.exists() and not local.is_dir():
        raise UsageError(f"--model {model}: is a file; give the checkpoint directory that holds config.json")
    if model.startswith(_PATH_PREFIXES) or model.count("/") > 1:
        raise UsageError(f"--model {model}: no such directory ({local.absolute()})")
    if "/" in model and not _REPO_ID.fullmatch(model):
        raise UsageError(f"--model {model}: not a hub repo id (org/name: letters, digits, '-', '_', '.') "
                         "and not an existing directory")


def resolve_model(args: ModelArgs) -> ResolvedModel:
    dummy = args.load_format == "dummy"
    entry = lookup(args.model)
    local = Path(args.model).expanduser()
    if entry is None and not (args.model.strip() and local.is_dir()):
        _check_model_form(args.model, local)
    if entry is not None and entry.builtin:
        path = builtin_path(entry)
        cfg = load_config(path)
    elif local.is_dir():
        path, cfg = local, load_config(local)
    elif entry is not None or "/" in args.model:
        repo_id = entry.repo_id if entry else args.model
        path = _cached_snapshot(repo_id, args.revision)
        if path is not None and (path / "config.json").is_file():
            cfg = load_config(path)
        elif dummy and entry is not None:
            cfg = parse_config(entry.config_dict())
        elif dummy:
            raise UsageError(f"{repo_id} is not in the local cache and has no shipped config: "
                             f"run `dsctl download {repo_id} --include config.json` first")
        else:
            raise CheckpointError(
                f"{repo_id} is not downloaded: run `dsctl download {args.model}` "
                "(or use --load-format dummy for random weights of the real shapes)"
            )
    else:
        raise UsageError(
            f"unknown model {args.model!r}: not a registry alias (see `dsctl models`), "
            "not a local directory, and not an org/name hub id"
        )
    if args.num_layers is not None:
        if args.num_layers > cfg.num_hidden_layers:
            raise UsageError(f"--num-layers {args.num_layers} exceeds the model's {cfg.num_hidden_layers} layers")
    if not dummy and path is not None:
        require_complete_checkpoint(path)
    tokenizer_path, source = _tokenizer(entry, path, cfg, dummy)
    return ResolvedModel(name=args.model, path=path, config=cfg, dummy=dummy,
                         tokenizer_path=tokenizer_path, tokenizer_source=source)
