"""The in-sandbox runner is a plain module started as a file: it must not need asyncrl, and every sandboxed uid
must be able to read the copy the sandbox starts."""

from __future__ import annotations

import ast
import os
import stat
import sys
from pathlib import Path

from asyncrl.envs.tools import runner
from asyncrl.envs.tools.isolation import staged_runner


def test_the_runner_imports_only_the_standard_library():
    tree = ast.parse(Path(runner.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    tops = {name.split(".")[0] for name in names}
    assert tops <= set(sys.stdlib_module_names) | {"__future__"}, tops - set(sys.stdlib_module_names)


def test_the_staged_runner_is_the_modules_source_readable_by_everyone():
    path = Path(staged_runner())
    assert path.read_bytes() == Path(runner.__file__).read_bytes()
    assert path.stat().st_mode & 0o444 == 0o444 and not path.stat().st_mode & 0o022
    folder = path.parent.stat()
    assert stat.S_ISDIR(folder.st_mode) and folder.st_uid == os.geteuid() and folder.st_mode & 0o005 == 0o005
    assert staged_runner() == str(path)  # written once: the next call finds it
