"""The generated configuration reference covers every leaf field of `asyncrl.config.Config`."""

import json
import subprocess
import sys

from pydantic import BaseModel

from asyncrl.config import Config
from asyncrl.telemetry import config_reference


def _optional(annotation):
    """The section of a `Section | None` field (off unless set: `learner.lora`, `telemetry.wandb`), else None."""
    args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
    return args[0] if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel) else None


def _leaves(model=Config, prefix=""):
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _leaves(field.annotation, f"{prefix}{name}.")
            continue
        yield f"{prefix}{name}", field  # an optional section is a row of its own, and a table of its keys
        if (section := _optional(field.annotation)) is not None:
            yield from _leaves(section, f"{prefix}{name}.")


def _split_row(line: str) -> list[str]:
    """Cells of a markdown table row, honouring escaped pipes (`\\|`)."""
    cells, cell, i = [], "", 0
    body = line.strip()[1:-1]
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body) and body[i + 1] == "|":
            cell += "|"
            i += 2
            continue
        if body[i] == "|":
            cells.append(cell.strip())
            cell = ""
        else:
            cell += body[i]
        i += 1
    cells.append(cell.strip())
    return cells


def _table(md: str) -> dict[str, dict[str, str]]:
    table = {}
    for line in md.splitlines():
        if not line.startswith("| `"):
            continue
        key, typ, default, constraints, description = _split_row(line)
        table[key.strip("`")] = {"type": typ.strip("`"), "default": default.strip("`"), "constraints": constraints, "description": description}
    return table


def _expected_default(field):
    if field.is_required():
        return "(required)"
    value = field.default_factory() if field.default_factory is not None else field.default
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def test_every_leaf_field_appears_with_its_default_and_description():
    table = _table(config_reference.markdown())
    leaves = dict(_leaves())
    assert len(leaves) > 50
    assert set(table) == set(leaves), set(table) ^ set(leaves)
    for key, field in leaves.items():
        row = table[key]
        assert field.description, f"{key} has no docstring"
        assert row["description"] == " ".join(field.description.split()), key
        assert row["default"] == _expected_default(field), key


def _sections(model: type[BaseModel], prefix: str = ""):
    """Dotted names of the section fields of `model`, nested ones (`rollout.autoscale`) included."""
    for name, field in model.model_fields.items():
        section = field.annotation if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) else _optional(field.annotation)
        if section is not None:
            yield prefix + name
            yield from _sections(section, f"{prefix}{name}.")


def test_one_table_per_section():
    md = config_reference.markdown()
    sections = list(_sections(Config))
    assert {"rollout", "rollout.autoscale", "faults.chaos", "learner.lora"} <= set(sections)
    for name in sections:
        assert f"## `{name}`" in md
    assert md.count("| key | type | default | constraints | description |") == 1 + len(sections)


def test_constraints_come_from_field_metadata():
    table = _table(config_reference.markdown())
    assert table["rollout.temperature"]["constraints"] == "> 0"
    assert table["rollout.top_p"]["constraints"] == "> 0, <= 1"
    assert table["buffer.max_staleness"]["constraints"] == ">= 0, <= 1024"
    assert table["mode"]["constraints"] == ""
    assert table["mode"]["type"] == '"sync" | "streaming" | "sao"'
    assert table["model.path"]["type"] == "str | None"
    assert table["model.path"]["default"] == "null"


def test_runs_as_a_module():
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.telemetry.config_reference"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.startswith("# asyncrl configuration reference")
    assert "| `rollout.temperature` |" in out


def test_committed_reference_is_current():
    from pathlib import Path

    committed = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert committed.read_text().rstrip("\n") == config_reference.markdown().rstrip("\n"), "regenerate: python -m asyncrl.telemetry.config_reference > docs/configuration.md"
