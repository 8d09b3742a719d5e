"""A plain (non-editable) install works without the source tree: recipes are package data found by name, and
every subpackage imports from site-packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

PROBE = """
import importlib, pkgutil, sys, asyncrl
from asyncrl.config import RECIPES, shipped_recipes
assert asyncrl.__file__.startswith(sys.argv[1]), asyncrl.__file__
assert str(RECIPES).startswith(sys.argv[1]), RECIPES
for info in pkgutil.walk_packages(asyncrl.__path__, "asyncrl."):
    importlib.import_module(info.name)
print(" ".join(shipped_recipes()))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources it builds.
    source = tmp_path_factory.mktemp("src") / "asyncrl"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__"))
    target = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(source)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return target


def _run(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site))  # ahead of the editable install of the development venv
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_every_subpackage_imports_and_the_recipes_ship_in_the_wheel(installed, tmp_path):
    done = _run(["-c", PROBE, str(installed)], installed, tmp_path)
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) >= {"default", "sync", "sao", "scalerl", "grpo", "dapo"}


@pytest.mark.parametrize("name", ["default", "scalerl", "sao.yaml"])
def test_check_finds_a_shipped_recipe_by_name_outside_the_source_tree(installed, tmp_path, name):
    done = _run(["-m", "asyncrl.cli", "check", name], installed, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "# planned placement" in done.stdout


def test_an_unknown_recipe_name_lists_the_shipped_ones(installed, tmp_path):
    done = _run(["-m", "asyncrl.cli", "check", "scalerll"], installed, tmp_path)
    assert done.returncode == 2
    assert "scalerll" in done.stderr and "scalerl" in done.stderr.split("shipped recipe:")[1]


def test_the_dashboard_page_and_its_charting_library_ship_in_the_wheel(installed):
    static = installed / "asyncrl" / "telemetry" / "static"
    assert {"index.html", "dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"} <= {p.name for p in static.iterdir()}
