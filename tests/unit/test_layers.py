"""The packages of `asyncrl` import only downwards: every import in the source (module level, inside a function,
under `TYPE_CHECKING`) runs to a package on a lower layer, or stays within its own package.

Layers, bottom to top (packages on one layer do not import each other):

    types, lookup, redaction, remote
    staleness, weights, cluster, algo
    config, models
    envs, buffer, telemetry, testing
    learner, rollout
    weight_sync
    controller
    cli
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "asyncrl"
LAYERS = [
    {"types", "lookup", "redaction", "remote"},
    {"staleness", "weights", "cluster", "algo"},
    {"config", "models"},
    {"envs", "buffer", "telemetry", "testing"},
    {"learner", "rollout"},
    {"weight_sync"},
    {"controller"},
    {"cli"},
]
LAYER_OF = {package: floor for floor, packages in enumerate(LAYERS) for package in packages}


def module_name(path: Path, source: Path) -> str:
    parts = path.relative_to(source.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `tree`, relative ones resolved; for `from X import Y`
    both `X.Y` (Y may be a module) and `X` are candidates, and the caller takes the first inside `asyncrl`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def package_of(module: str) -> str | None:
    """`asyncrl.envs.tools.pool` -> `envs`; None outside asyncrl or for `asyncrl` itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "asyncrl" and len(parts) > 1 else None


def layer_violations(source: Path = SOURCE) -> list[str]:
    """Every import that runs sideways or up, as `file:line: a -> b (layer i -> j)`."""
    problems = []
    for path in sorted(source.rglob("*.py")):
        module = module_name(path, source)
        own = package_of(module)
        if own is None:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, target in imported_modules(tree, module, path.name == "__init__.py"):
            other = package_of(target)
            if other is None or other == own or other.startswith("__"):
                continue
            if other not in LAYER_OF or own not in LAYER_OF:
                unknown = other if other not in LAYER_OF else own
                problems.append(f"{path.relative_to(source.parent)}:{line}: package {unknown!r} has no layer here")
            elif LAYER_OF[other] >= LAYER_OF[own]:
                problems.append(
                    f"{path.relative_to(source.parent)}:{line}: {own} -> {target} "
                    f"(layer {LAYER_OF[own]} -> {LAYER_OF[other]})"
                )
    return problems


def test_every_import_in_asyncrl_runs_to_a_lower_layer_or_stays_in_its_package():
    problems = layer_violations()
    assert not problems, "imports that run sideways or up:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("where", "code", "expected"),
    [
        ("weights/bad.py", "from asyncrl.rollout.pool import RolloutPool\n", "weights -> asyncrl.rollout.pool.Rollout"),
        ("rollout/bad.py", "def f():\n    import asyncrl.weight_sync.base\n", "rollout -> asyncrl.weight_sync.base"),
        (
            "learner/bad.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from asyncrl.rollout import pool\n",
            "learner -> asyncrl.rollout.pool",
        ),
        ("envs/tools/bad.py", "from ...rollout import openai_server\n", "envs -> asyncrl.rollout.openai_server"),
        ("types.py", "from asyncrl import weights\n", "types -> asyncrl.weights"),
        ("surprise/x.py", "from asyncrl.types import Group\n", "package 'surprise' has no layer here"),
    ],
)
def test_an_import_that_runs_up_or_sideways_is_named_with_its_file_and_line(tmp_path, where, code, expected):
    """Function-local, TYPE_CHECKING and relative imports are all seen; a package without a layer is named."""
    source = tmp_path / "asyncrl"
    (source / where).parent.mkdir(parents=True, exist_ok=True)
    (source / where).write_text(code)
    problems = layer_violations(source)
    assert len(problems) == 1 and expected in problems[0], problems
    assert problems[0].startswith(f"asyncrl/{where}:")


def test_imports_that_run_down_or_stay_in_their_package_pass(tmp_path):
    source = tmp_path / "asyncrl" / "rollout"
    source.mkdir(parents=True)
    (source / "ok.py").write_text(
        "from asyncrl.weights.buckets import pack_buckets\nfrom . import engine\nfrom .pool import RolloutPool\n"
        "import numpy\nimport asyncrl\n"
    )
    assert layer_violations(tmp_path / "asyncrl") == []
