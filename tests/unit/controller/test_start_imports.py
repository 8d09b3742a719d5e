"""`run._importing`: the modules `Controller.start` needs are imported in a thread while `ray.init` runs; one that
fails there is left to fail again, with its own error, where it is imported."""

from __future__ import annotations

import importlib
import inspect
import re
import sys

import pytest

from asyncrl.controller.fleet import Fleet
from asyncrl.controller.loop import Controller
from asyncrl.controller.run import _importing


def test_modules_load_beside_the_body_and_a_failing_one_fails_again_where_it_is_used(tmp_path, monkeypatch):
    (tmp_path / "ar_probe_ok.py").write_text("import threading\nTHREAD = threading.current_thread().name\n")
    (tmp_path / "ar_probe_bad.py").write_text("raise ImportError('ar_probe_bad needs a package that is missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("ar_probe_ok", "ar_probe_bad"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    ran = []
    with _importing((("ar_probe_bad", "THREAD"), ("ar_probe_ok", "THREAD"))):
        ran.append(True)
    assert ran == [True]
    assert sys.modules["ar_probe_ok"].THREAD == "asyncrl-imports"  # not the caller's thread
    assert "ar_probe_bad" not in sys.modules
    with pytest.raises(ImportError, match="needs a package that is missing"):
        importlib.import_module("ar_probe_bad")


def test_the_list_is_what_start_imports():
    imported = re.findall(r"^\s+from (\S+) import (\w+)", inspect.getsource(Controller.start) + inspect.getsource(Fleet.start), re.MULTILINE)
    assert sorted(imported) == sorted(Controller.START_IMPORTS)
