"""What must never be written into a run's files (config.yaml, events.jsonl, logs) or sent to a tracker: values
of config keys named like secrets (`api_key`, `dashboard_token`, `wandb.password`, ...) and of environment
variables named so (`WANDB_API_KEY`, `HF_TOKEN`, ...). By name, so a key added later is covered without a list
to keep in step.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "is_secret_name", "redact", "scrub"]

REDACTED = "<redacted>"
SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"})
"""A name is a secret's when one of its words (split at `_`, `-`, `.` and case changes) is one of these:
`openai_api_key`, `dashboard_token`, `WANDB_API_KEY`; not `max_tokens` or `tokenizer`."""
MIN_SCRUBBED = 8
"""Values shorter than this are not searched for in free text (they would match ordinary words)."""


def is_secret_name(name: str) -> bool:
    words = re.split(r"[_\-.\s]+|(?<=[a-z])(?=[A-Z])", name)
    return any(w.lower() in SECRET_WORDS for w in words)


def redact(value: Any) -> Any:
    """`value` (nested dicts and lists) with the string value of every secret-named key replaced by `REDACTED`
    (an empty or unset one stays as it is, so the record still says it is unset)."""
    if isinstance(value, Mapping):
        return {
            k: REDACTED if is_secret_name(str(k)) and isinstance(v, str) and v else redact(v) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    return value


def scrub(text: str, extra: Mapping[str, Any] | None = None) -> str:
    """`text` with every secret value of the environment (and of `extra`'s secret-named keys) replaced."""
    for secret in _secret_values(extra or {}):
        text = text.replace(secret, REDACTED)
    return text


def _secret_values(extra: Mapping[str, Any]) -> list[str]:
    found = [v for k, v in os.environ.items() if is_secret_name(k)]
    found += [v for k, v in _flat(extra) if is_secret_name(k) and isinstance(v, str)]
    return sorted({v for v in found if len(v) >= MIN_SCRUBBED}, key=len, reverse=True)


def _flat(value: Any, key: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):
        return [pair for k, v in value.items() for pair in _flat(v, str(k))]
    if isinstance(value, (list, tuple)):
        return [pair for v in value for pair in _flat(v, key)]
    return [(key, value)]
