"""Configuration reference generated from `asyncrl.config.Config`.

One markdown table per section (key, type, default, constraints, description). Every field of the
config tree carries a docstring (`use_attribute_docstrings=True`), so the reference cannot drift
from the code. Run `python -m asyncrl.telemetry.config_reference > docs/config.md` to print it.

Imports only pydantic (through `asyncrl.config`): no torch, Ray or vLLM.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Any, TypeGuard

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen, MultipleOf
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from asyncrl.config import Config


def _is_section(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _optional_section(annotation: Any) -> type[BaseModel] | None:
    """The section of a `Section | None` field (a section that is off unless set, e.g. `learner.lora`), else None."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 and _is_section(args[0]) else None


def type_name(annotation: Any) -> str:
    """A short, readable name for a field annotation: `int`, `str | None`, `"sync" | "sao"`, `tuple[float, float]`."""
    if annotation is None or annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        base = getattr(origin, "__name__", str(origin))
        return f"{base}[{', '.join(type_name(a) for a in args)}]" if args else base
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def default_text(field: FieldInfo) -> str:
    """The default as it would be written in YAML (`null`, `true`, `1.0`, `[0.9, 0.99]`, `{}`)."""
    if field.default_factory is not None:
        value = field.get_default(call_default_factory=True, validated_data={})
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def constraints_text(field: FieldInfo) -> str:
    """Bounds from the field metadata (`Field(ge=..., gt=..., le=..., lt=...)`), e.g. `> 0, <= 1`."""
    parts = []
    for item in field.metadata:
        if isinstance(item, Ge):
            parts.append(f">= {item.ge}")
        elif isinstance(item, Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, Le):
            parts.append(f"<= {item.le}")
        elif isinstance(item, Lt):
            parts.append(f"< {item.lt}")
        elif isinstance(item, MultipleOf):
            parts.append(f"multiple of {item.multiple_of}")
        elif isinstance(item, MinLen):
            parts.append(f"len >= {item.min_length}")
        elif isinstance(item, MaxLen):
            parts.append(f"len <= {item.max_length}")
    return ", ".join(parts)


def rows(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, list[dict[str, str]]]:
    """Leaf fields grouped by section: {section: [{key, type, default, constraints, description}]}.

    The top-level leaves are in section `""`; nested sections recurse (`a.b.key`); an optional section (`Section |
    None`) is a row of its own (off by default) and a section of its keys."""
    out: dict[str, list[dict[str, str]]] = {prefix.rstrip("."): []}
    optional: dict[str, list[dict[str, str]]] = {}
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            out.update(rows(field.annotation, f"{prefix}{name}."))
            continue
        if (section := _optional_section(field.annotation)) is not None:
            optional.update(rows(section, f"{prefix}{name}."))
        out[prefix.rstrip(".")].append(
            {
                "key": f"{prefix}{name}",
                "type": type_name(field.annotation),
                "default": default_text(field),
                "constraints": constraints_text(field),
                "description": " ".join((field.description or "").split()),
            }
        )
    return {k: v for k, v in {**out, **optional}.items() if v}


def _cell(text: str, code: bool = False) -> str:
    text = text.replace("|", "\\|")
    if code and text:
        return f"`{text}`"
    return text


def _section_doc(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split()) if doc else ""


def _section_models(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, type[BaseModel]]:
    out = {prefix.rstrip("."): model}
    for name, field in model.model_fields.items():
        section = field.annotation if _is_section(field.annotation) else _optional_section(field.annotation)
        if section is not None:
            out.update(_section_models(section, f"{prefix}{name}."))
    return out


def markdown() -> str:
    """The configuration reference: one table per section of `asyncrl.config.Config`."""
    lines = [
        "# asyncrl configuration reference",
        "",
        "Generated from `asyncrl.config.Config` by `python -m asyncrl.telemetry.config_reference`; "
        "do not edit by hand.",
        "Set any key in a YAML recipe (`configs/*.yaml`) or on the command line as `section.key=value`,",
        "e.g. `asyncrl run configs/scalerl.yaml rollout.num_workers=8 learner.num_ranks=8`. Unknown keys are rejected.",
        "",
    ]
    models = _section_models()
    for section, items in rows().items():
        lines.append(f"## `{section}`" if section else "## Top level")
        lines.append("")
        doc = _section_doc(models[section]) if section else ""
        if doc:
            lines.extend([doc, ""])
        lines.append("| key | type | default | constraints | description |")
        lines.append("|---|---|---|---|---|")
        for r in items:
            lines.append(
                "| "
                + " | ".join(
                    [
                        _cell(r["key"], code=True),
                        _cell(r["type"], code=True),
                        _cell(r["default"], code=True),
                        _cell(r["constraints"]),
                        _cell(r["description"]),
                    ]
                )
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
