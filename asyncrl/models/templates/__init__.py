"""Chat templates shipped with asyncrl, by name; `load_chat_template` also reads a user's `.jinja` file.

`default` is the char tokenizer's own template (`asyncrl.models.tokenizer.CHAT_TEMPLATE`): message contents
concatenated. `chatml` (Qwen), `llama3` (Llama 3's headers) and `gemma` (Gemma's turns) are the chat formats of
`asyncrl.models.bpe`, each with function calling as <tool_call> JSON blocks. `qwen2_tools` is another name for
`chatml`.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.models.tokenizer import CHAT_TEMPLATE

_HERE = Path(__file__).resolve().parent
_ALIASES = {"qwen2_tools": "chatml"}
SHIPPED = ("default", "chatml", "llama3", "gemma", "qwen2_tools")


def load_chat_template(name_or_path: str) -> str:
    """The template text of a shipped name, or of a `.jinja` file path."""
    if name_or_path == "default":
        return CHAT_TEMPLATE
    if name_or_path in SHIPPED:
        return (_HERE / f"{_ALIASES.get(name_or_path, name_or_path)}.jinja").read_text()
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"chat template {name_or_path!r} is neither a shipped name ({', '.join(SHIPPED)}) nor a file"
        )
    return path.read_text()


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether a model folder's tokenizer has a chat template: a `chat_template.jinja` beside it, or a non-empty
    `chat_template` in its `tokenizer_config.json`."""
    path = Path(model_dir)
    if (path / "chat_template.jinja").is_file():
        return True
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(tokenizer_config, dict) and bool(tokenizer_config.get("chat_template"))
