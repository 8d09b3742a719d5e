"""Looking names up for the user: the closest valid name in an error message, and the plug-in points that take
a built-in name or an import path `package.module:attr` (rewards, environments, agent harnesses).

Imports only the standard library, so that the config can use it and stay cheap to import.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["check_name", "did_you_mean", "load_plugin"]


def did_you_mean(word: object, options: Iterable[object], cutoff: float = 0.6) -> str:
    """The hint ` (did you mean 'x'?)` naming the option closest to `word`, or an empty string when none is
    close enough (`difflib.get_close_matches` similarity >= `cutoff`)."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_name(kind: str, value: str, valid: Iterable[str]) -> None:
    """Raise ValueError "unknown <kind> 'value' (did you mean ...?); valid: ..." unless `value` is in `valid`."""
    valid = tuple(valid)
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}{did_you_mean(value, valid)}; valid: {', '.join(valid)}")


def load_plugin(name: str, what: str, builtins: Mapping[str, Any] | None = None, form: str = "module:function") -> Any:
    """The object `name` stands for: a built-in (`builtins[name]`: the object itself, or an import path to it) or
    an import path `package.module:attr`. Raises ValueError naming `what` it was looking for and `name`: unknown
    (neither a built-in nor of the form `form`) or not importable. The caller checks what the object must be."""
    builtins = builtins or {}
    target = builtins.get(name, name)
    if not isinstance(target, str):
        return target
    module, colon, attr = target.partition(":")
    if not (colon and module and attr):
        if builtins:
            raise ValueError(f"unknown {what} {name!r}: use one of {', '.join(builtins)} or '{form}'")
        raise ValueError(f"{what} {name!r} must be an import path '{form}'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {what} {name!r}: {e}") from None
