"""Loading a config: YAML and `section.key=value` overrides, with errors that name the key, the file and the
closest valid name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.config.base import ConfigError
from asyncrl.config.run import Config
from asyncrl.lookup import did_you_mean

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
"""The shipped recipes, package data of the wheel (`configs/` in the repository links here)."""
DEFAULT_CONFIG = RECIPES / "default.yaml"


def _check_keys(data: Any, model: type[BaseModel], prefix: str, source: str) -> None:
    """Reject unknown keys before pydantic does, so the message names the closest valid key."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key '{dotted}'{did_you_mean(key, fields, cutoff=0.5)}; "
                f"valid keys here: {', '.join(fields)}"
            )
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _check_keys(value, annotation, f"{dotted}.", source)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else None
    return key.strip().split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML recipe and apply `section.key=value` overrides. `path` is a file, or the name of a shipped
    recipe (`scalerl`, `sao.yaml`); None is the embedded default (`default`)."""
    path = resolve_recipe_path(path)
    source = str(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {source}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    _check_keys(data, Config, "", source)
    for text in overrides:
        keys, value = parse_override(text)
        _check_keys(_nest(keys, value), Config, "", f"override {text!r}")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: '{key}' is not a section")
        node[keys[-1]] = value
    return validate_config(data, f"{source} with overrides {' '.join(overrides)}" if overrides else source)


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def resolve_recipe_path(path: str | Path | None) -> Path:
    """A file that exists wins; otherwise a bare name (no directory part) names a shipped recipe."""
    if path is None:
        return DEFAULT_CONFIG
    path = Path(path)
    if path.exists() or len(path.parts) > 1:
        return path
    shipped = RECIPES / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    if shipped.exists():
        return shipped
    raise ConfigError(
        f"config file not found: {path} (not a file, nor a shipped recipe: {', '.join(shipped_recipes())})"
    )


def _nest(keys: list[str], value: Any) -> dict[str, Any]:
    for key in reversed(keys):
        value = {key: value}
    return value


def validate_config(data: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        raise ConfigError(f"{source}: invalid config\n" + "\n".join(lines)) from None
