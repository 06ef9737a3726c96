"""Item 4 of the sampling / agent API work: the V3.1, V3.1-Terminus and R1-0528 registry entries, and the
V3.1 thinking switch reaching the chat template through `chat_template_kwargs` (a template with V3.1's
generation prompt: `<｜Assistant｜><think>` when thinking, `<｜Assistant｜></think>` when not)."""

from __future__ import annotations

import json

import pytest

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.checkpoint.tiny_tokenizer import write_tokenizer
from engine.checkpoint.tokenizer import Tokenizer
from engine.server.errors import APIError
from engine.server.inputs import chat_prompt
from engine.server.schemas import ChatRequest

V31_STYLE = (
    "{% if not thinking is defined %}{% set thinking = false %}{% endif %}{{ bos_token }}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"
)


@pytest.mark.parametrize("name,repo,fmt", [
    ("deepseek-v3.1", "deepseek-ai/DeepSeek-V3.1", "deepseek-v3.1"),
    ("deepseek-v3.1-terminus", "deepseek-ai/DeepSeek-V3.1-Terminus", "deepseek-v3.1"),
    ("deepseek-r1-0528", "deepseek-ai/DeepSeek-R1-0528", "deepseek-r1"),
])
def test_registry_knows_the_2025_models(name, repo, fmt):
    entry = lookup(name)
    assert entry is lookup(repo) and entry.repo_id == repo and entry.chat_format == fmt
    assert entry.config_dict()["architectures"] == ["DeepseekV3ForCausalLM"] and parse_config(entry.config_dict())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("v31-template")
    write_tokenizer(path, parse_config(lookup("tiny").config_dict()))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": V31_STYLE}))
    return Tokenizer(path)


def test_thinking_switch_reaches_the_template(tokenizer):
    def rendered(**body) -> str:
        req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
        return tokenizer.decode(chat_prompt(req, tokenizer), False)

    assert rendered().endswith("<｜User｜>hi<｜Assistant｜></think>")
    assert rendered(chat_template_kwargs={"thinking": False}).endswith("<｜Assistant｜></think>")
    assert rendered(chat_template_kwargs={"thinking": True}).endswith("<｜User｜>hi<｜Assistant｜><think>")
    with pytest.raises(APIError):
        rendered(chat_template_kwargs={"add_generation_prompt": False})
