"""Turn `--model` into a checkpoint directory and a ModelConfig.

MODEL may be a registry alias (`deepseek-v3`, `tiny`, ...), a local checkpoint
directory, or a hub repo id already in the local Hugging Face cache. With
`--load-format dummy` a known alias needs no files at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from engine.args import EngineArgs
from engine.config import ModelConfig, load_config, parse_config
from engine.errors import CheckpointError, UsageError
from engine.models import lookup


@dataclass
class ResolvedModel:
    name: str
    path: Optional[Path]  # None: dummy weights and no local files (no tokenizer)
    config: ModelConfig
    dummy: bool


def _cached_snapshot(repo_id: str, revision: Optional[str]) -> Optional[Path]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None


def resolve_model(args: EngineArgs) -> ResolvedModel:
    dummy = args.load_format == "dummy"
    entry = lookup(args.model)
    local = Path(args.model).expanduser()
    if entry is not None and entry.builtin:
        from engine.weights.tiny import materialize

        path = materialize(entry.alias, entry.config_dict())
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
        from engine.weights.check import require_complete_checkpoint

        require_complete_checkpoint(path)
    return ResolvedModel(name=args.model, path=path, config=cfg, dummy=dummy)
