"""Registry of known models: alias -> hub repo id, with a shipped config.json.

The shipped configs (engine/model_configs/<config>.json) let `--load-format dummy
--model deepseek-v3` build a real-shape model with no download. `tiny`, `tiny-fp8` and
`tiny-fp8-tp` are built-in synthetic checkpoints (engine/checkpoint/tiny.py). `tiny-py` is built in with
trained weights shipped in the package (engine/model_weights/tiny-py/, made by scripts/train_tiny.py;
docs/tiny_model.md): the default model, so a first request returns plausible text.

`chat_format` names a model's conversation format, which its checkpoint's own chat template
(tokenizer_config.json) renders: `deepseek-v3` (V3, V3-0324), `deepseek-r1` (the template opens the
`<think>` section: `--reasoning-parser deepseek-r1`), `deepseek-v3.1` (V3.1, V3.1-Terminus: hybrid
thinking, off unless a chat request passes `chat_template_kwargs: {"thinking": true}`;
`--reasoning-parser deepseek-v3.1`), `deepseek-v2`; None for base models and the built-in ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class ModelEntry:
    alias: str
    repo_id: Optional[str]  # None for built-in synthetic models
    config_name: str  # file stem under engine/model_configs/
    description: str
    weights: Optional[str] = None  # built-in model with trained weights: its folder under engine/model_weights/
    chat_format: Optional[str] = None  # module docstring

    def config_dict(self) -> dict:
        text = resources.files("engine").joinpath("model_configs", f"{self.config_name}.json").read_text()
        return json.loads(text)

    @property
    def builtin(self) -> bool:
        return self.repo_id is None

    def weights_dir(self) -> Optional[Path]:
        """The shipped checkpoint directory of a built-in model with trained weights, else None."""
        if self.weights is None:
            return None
        return Path(str(resources.files("engine").joinpath("model_weights", self.weights)))


MODELS: dict[str, ModelEntry] = {
    e.alias: e
    for e in [
        ModelEntry("deepseek-v3", "deepseek-ai/DeepSeek-V3", "deepseek-v3", "671B MoE, FP8, MTP",
                   chat_format="deepseek-v3"),
        ModelEntry("deepseek-v3-base", "deepseek-ai/DeepSeek-V3-Base", "deepseek-v3", "V3 base model"),
        ModelEntry("deepseek-v3-0324", "deepseek-ai/DeepSeek-V3-0324", "deepseek-v3", "V3 March 2025 update",
                   chat_format="deepseek-v3"),
        ModelEntry("deepseek-v3.1", "deepseek-ai/DeepSeek-V3.1", "deepseek-v3",
                   "V3 August 2025 update: hybrid thinking (chat_template_kwargs thinking), tool calls",
                   chat_format="deepseek-v3.1"),
        ModelEntry("deepseek-v3.1-base", "deepseek-ai/DeepSeek-V3.1-Base", "deepseek-v3", "V3.1 base model"),
        ModelEntry("deepseek-v3.1-terminus", "deepseek-ai/DeepSeek-V3.1-Terminus", "deepseek-v3",
                   "V3.1 September 2025 update (language consistency, agents); V3.1's chat format",
                   chat_format="deepseek-v3.1"),
        ModelEntry("deepseek-r1", "deepseek-ai/DeepSeek-R1", "deepseek-v3", "reasoning model, V3 architecture",
                   chat_format="deepseek-r1"),
        ModelEntry("deepseek-r1-0528", "deepseek-ai/DeepSeek-R1-0528", "deepseek-v3",
                   "R1 May 2025 update: system prompts, tool calls", chat_format="deepseek-r1"),
        ModelEntry("deepseek-v2", "deepseek-ai/DeepSeek-V2", "deepseek-v2", "236B MoE, bf16"),
        ModelEntry("deepseek-v2-chat", "deepseek-ai/DeepSeek-V2-Chat", "deepseek-v2", "V2 chat",
                   chat_format="deepseek-v2"),
        ModelEntry("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", "deepseek-v2-lite", "16B MoE, no q compression"),
        ModelEntry("deepseek-v2-lite-chat", "deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek-v2-lite", "V2-Lite chat",
                   chat_format="deepseek-v2"),
        ModelEntry(
            "deepseek-coder-v2-lite",
            "deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct",
            "deepseek-v2-lite",
            "V2-Lite coder (instruct)",
            chat_format="deepseek-v2",
        ),
        ModelEntry("tiny-py", None, "tiny-py", "built-in V3-architecture model (+ MTP) trained on the Python "
                   "stdlib's sources; the default", weights="tiny-py"),
        ModelEntry("tiny", None, "tiny", "built-in random V3-architecture model for CPU tests and demos"),
        ModelEntry("tiny-fp8", None, "tiny-fp8", "built-in tiny model with 128x128 block-FP8 weights"),
        ModelEntry("tiny-fp8-tp", None, "tiny-fp8-tp",
                   "built-in tiny block-FP8 model whose TP 2 / 4 slices are whole FP8 blocks"),
    ]
}


def lookup(name: str) -> Optional[ModelEntry]:
    """The registry entry for an alias (case-insensitive) or a known repo id, else None."""
    key = name.lower()
    if key in MODELS:
        return MODELS[key]
    for entry in MODELS.values():
        if entry.repo_id and entry.repo_id.lower() == key:
            return entry
    return None
