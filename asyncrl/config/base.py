"""The base of every config section, and the error a config that cannot be used raises."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Mode = Literal["sync", "streaming", "sao"]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the file."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
