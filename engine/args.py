"""Every engine flag, defined once.

`EngineArgs` is the single source of truth for the engine's options: their
defaults, help text, the CLI group they belong to and their allowed values.
`dsctl` builds its command-line options from these fields (see
`dsctl/flags.py`); nothing else parses flags. `validate()` rejects bad values and
bad combinations with a message that says why and what to use instead.

This module must stay importable without torch so that `dsctl --help` is fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.errors import UsageError

# Flag groups: each CLI command picks the groups it needs.
MODEL = "model"
SERVER = "server"


def flag(default: Any, help: str, group: str = MODEL, choices: tuple | None = None, **extra) -> Any:
    """A dataclass field carrying its CLI metadata."""
    meta = {"help": help, "group": group, "choices": choices, **extra}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    # ---- model and weights -------------------------------------------------
    model: str = flag(
        "tiny",
        "Model: a registry alias (see `dsctl models`), a local checkpoint directory, "
        "or a hub repo id already in the local cache.",
    )
    revision: Optional[str] = flag(None, "Hub revision (branch, tag or commit) when MODEL is a repo id.")
    load_format: str = flag(
        "auto",
        "How to get weights: 'safetensors' from the checkpoint, 'dummy' for random weights "
        "of the real shapes (no download), 'auto' = safetensors.",
        choices=("auto", "safetensors", "dummy"),
    )
    num_layers: Optional[int] = flag(
        None,
        "Override num_hidden_layers (keeps the first N layers), e.g. 5 to fit a truncated "
        "DeepSeek-V3 on one GPU with --load-format dummy.",
    )
    dtype: str = flag(
        "auto",
        "Activation/weight dtype: 'auto' = bfloat16 on CUDA, float32 on CPU.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = flag("auto", "Device: 'auto' = cuda when available, else cpu.", choices=("auto", "cpu", "cuda"))
    quantization: Optional[str] = flag(
        None,
        "Weight quantisation. Default: whatever the checkpoint ships (FP8 block for V3/R1). "
        "'none' dequantises an FP8 checkpoint to --dtype.",
        choices=("none", "fp8"),
    )
    seed: int = flag(0, "Seed for dummy weights and for sampling when a request gives none.")
    max_model_len: Optional[int] = flag(
        None, "Context length limit (prompt + output). Default: the model's max_position_embeddings."
    )
    max_total_tokens: Optional[int] = flag(
        None, "Size of the KV cache pool in tokens. Default: 32768 on CPU; half the free GPU memory on CUDA."
    )
    max_running_requests: int = flag(256, "Most requests in the running batch at once.")

    # ------------------------------------------------------------------------
    def validate(self) -> "EngineArgs":
        """Check values and combinations; raise UsageError with a fix-it message."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise UsageError(
                    f"--{cli_name(f.name)} must be one of {', '.join(choices)} (got {value!r})"
                )
        if self.num_layers is not None and self.num_layers < 1:
            raise UsageError(f"--num-layers must be >= 1 (got {self.num_layers})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UsageError(f"--max-model-len must be >= 2 (got {self.max_model_len})")
        if self.max_running_requests < 1:
            raise UsageError(f"--max-running-requests must be >= 1 (got {self.max_running_requests})")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise UsageError(f"--max-total-tokens must be >= 1 (got {self.max_total_tokens})")
        if self.device == "cpu" and self.dtype == "float16":
            raise UsageError("--dtype float16 is not supported on CPU; use float32 or bfloat16")
        return self

    def replace(self, **changes) -> "EngineArgs":
        return dataclasses.replace(self, **changes)


def cli_name(field_name: str) -> str:
    return field_name.replace("_", "-")


def fields_in_groups(groups: tuple[str, ...]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineArgs) if f.metadata.get("group") in groups]
