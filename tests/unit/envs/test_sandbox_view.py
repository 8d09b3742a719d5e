"""What a sandboxed run sees of the host's files (docs/tools.md, "What a sandboxed run sees"): a model's program
sees the system's programs, the interpreter and its own /tmp, nothing of a run folder, a dataset, a checkout or
/home; a user reward also sees the code it imports, and `tools.reward_mounts`, read-only.

Real sandboxes (bwrap where installed). Where this machine cannot hide the host's files, the tests assert that
the capability record says so instead of passing silently.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from pathlib import Path

import pytest

import asyncrl
from asyncrl.config import ToolsConfig
from asyncrl.envs.tools.isolation import UIDS_PER_SANDBOX, detect_capabilities
from asyncrl.envs.tools import mounts
from asyncrl.envs.tools.mounts import reward_code
from asyncrl.envs.tools.processes import RewardItem
from asyncrl.envs.tools.python import run_python
from asyncrl.envs.tools.sandbox import Sandbox, SandboxLimits

LIMITS = SandboxLimits(wall_s=10.0, cpu_s=5, memory_bytes=512 << 20, processes=16, file_bytes=1 << 20, output_bytes=2000)
CAPS = detect_capabilities()
CHECKOUT = Path(asyncrl.__file__).resolve().parents[1]
PROBE = """
import json, os
seen = {}
for path in %r:
    try:
        seen[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path, 'rb').read(16).decode(errors='replace')
    except OSError as e:
        seen[path] = type(e).__name__
print(json.dumps(seen))
"""


def _uid(k: int) -> int:
    return 205_000 + UIDS_PER_SANDBOX * k


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    """A run folder and a training Parquet both under /tmp (as pytest's) and outside it (beside the checkout)."""
    outside = CHECKOUT / f".sandbox-view-{os.getpid()}"
    places = [tmp_path_factory.mktemp("run"), outside]
    paths = []
    for place in places:
        (place / "data").mkdir(parents=True)
        for name in ("trajectories.parquet", "data/train.parquet"):
            (place / name).write_bytes(b"PAR1 secret answers")
            paths.append(str(place / name))
    yield paths
    for path in paths:
        os.remove(path)
    for place in places:
        os.rmdir(place / "data")
    os.rmdir(outside)


def _program(paths: list[str]) -> dict:
    async def run():
        sandbox = Sandbox(LIMITS, _uid(0))
        try:
            return await run_python(sandbox, PROBE % (paths,), LIMITS.wall_s)
        finally:
            await sandbox.close()

    import json

    result = asyncio.run(run())
    assert result.ok, result.output
    return json.loads(result.output)


def test_a_program_sees_no_run_folder_dataset_checkout_or_home(secrets):
    home = [str(p) for p in Path("/home").iterdir()] if Path("/home").is_dir() else []
    targets = [*secrets, str(CHECKOUT / "pyproject.toml"), str(CHECKOUT), "/home", *home, "/root", "/etc/passwd"]
    seen = _program(targets)
    if not CAPS.host_hidden:
        assert seen[secrets[-1]] == "PAR1 secret answe"[:16]  # no filesystem isolation here, and the record says so
        return
    assert {p: seen[p] for p in secrets} == dict.fromkeys(secrets, "FileNotFoundError")
    assert seen[str(CHECKOUT / "pyproject.toml")] == "FileNotFoundError"
    hidden = [str(CHECKOUT), "/home", *home, "/root", "/etc/passwd"]
    assert {p: seen[p] for p in hidden} == {p: _shown(p) for p in hidden}


def _shown(path: str):
    """What a sandbox shows of a host path that holds nothing it mounts: the way down to the interpreter's
    installation, if it lies below (a pyenv one under /root), else nothing."""
    prefix = os.path.realpath(sys.base_prefix)
    if prefix.startswith(path + os.sep):
        return [prefix[len(path) + 1 :].split(os.sep)[0]]
    return "FileNotFoundError"


def test_a_program_still_has_the_interpreter_and_its_standard_library():
    program = "import json, sqlite3, ssl, decimal, subprocess\nprint(subprocess.run(['ls', '/'], capture_output=True, text=True).stdout.split())"

    async def run():
        sandbox = Sandbox(LIMITS, _uid(1))
        try:
            return await run_python(sandbox, program, LIMITS.wall_s)
        finally:
            await sandbox.close()

    result = asyncio.run(run())
    assert result.ok, result.output
    if CAPS.host_hidden:  # the root holds the system's folders, the sandbox's own, and nothing of the host's
        system = {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin", "tmp", "usr", "etc"}
        assert set(eval(result.output)) <= system | {os.path.realpath(sys.base_prefix).split(os.sep)[1]}


def _reward_reads(paths: list[str], uid: int, reward_mounts: tuple[str, ...] = ()) -> float:
    sandbox = Sandbox(LIMITS, uid, reward_mounts=reward_mounts)

    async def run():
        try:
            return await sandbox.run_rewards("sandbox_rewards:readable", [RewardItem("", "", "stop", {"paths": paths}, 5.0)])
        finally:
            await sandbox.close()

    (outcome,) = asyncio.run(run())
    assert outcome.reason is None, outcome
    return outcome.value


def test_a_reward_sees_its_own_code_but_not_the_run_folder_or_datasets(secrets):
    own = str(Path(__file__).with_name("sandbox_rewards.py"))
    assert _reward_reads([own, str(Path(asyncrl.__file__))], _uid(2)) == 2.0  # its module, asyncrl
    if CAPS.host_hidden:
        assert _reward_reads([*secrets, str(CHECKOUT / "pyproject.toml"), "/home/.", str(Path(__file__))], _uid(3)) == 0.0


def test_reward_mounts_show_a_reward_what_they_name_read_only(secrets):
    folder = str(Path(secrets[-1]).parent)  # the outside data folder
    assert _reward_reads([secrets[-1]], _uid(4), reward_mounts=(folder,)) == 1.0
    if CAPS.host_hidden:
        assert _reward_reads([secrets[-2]], _uid(4), reward_mounts=(folder,)) == 0.0  # only what is named


def test_a_reward_module_under_tmp_is_imported_from_there(tmp_path, monkeypatch):
    """As in CI, where the checkout (and its virtual environment) sit under /tmp: the sandbox's own /tmp must
    not hide them."""
    package = tmp_path / "tmp_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "score.py").write_text(textwrap.dedent("""
        from tmp_rewards_pkg import helper

        def one(response, ground_truth, *, finish_reason, extra_info):
            return helper.VALUE
    """))
    (package / "helper.py").write_text("VALUE = 3.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = reward_code("tmp_rewards_pkg.score:one")
    assert str(package) in code.binds and str(tmp_path) in code.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])  # shipped, not found locally
    mounts._module_code.cache_clear()
    assert str(package) not in reward_code("tmp_rewards_pkg.score:one").binds
    sandbox = Sandbox(LIMITS, _uid(5), code={"tmp_rewards_pkg.score:one": code})

    async def run():
        try:
            return await sandbox.run_rewards("tmp_rewards_pkg.score:one", [RewardItem("", "", "stop", {}, 5.0)])
        finally:
            await sandbox.close()

    (outcome,) = asyncio.run(run())
    assert (outcome.value, outcome.reason) == (3.0, None)


@pytest.mark.parametrize(
    "mounts, error",
    [
        (["data"], "'data' is not an absolute path"),
        (["/home"], "'/home' is a whole system folder"),
        (["/nonexistent-asyncrl-data"], "'/nonexistent-asyncrl-data' does not exist"),
    ],
)
def test_bad_reward_mounts_are_refused_naming_the_key(mounts, error):
    with pytest.raises(ValueError, match=f"tools.reward_mounts: {error}"):
        ToolsConfig(reward_mounts=mounts)


def test_a_program_gets_the_standard_library_alone_and_a_reward_the_interpreters_packages_too():
    """The interpreter's own site-packages (whatever was installed into it) is empty for a program."""
    from asyncrl.envs.tools.mounts import interpreter_site_packages

    folders = [p for p in interpreter_site_packages() if os.listdir(p)]
    if not folders or not CAPS.host_hidden:
        pytest.skip("the interpreter has no packages of its own here, or the sandbox shows every host file")
    assert _program(folders) == dict.fromkeys(folders, [])
    assert _reward_reads(folders, _uid(6)) == len(folders)  # a reward may import the interpreter's packages


def test_a_reward_of_the_checkouts_tests_package_imports_in_a_worker_whose_path_lacks_the_checkout(monkeypatch):
    """`tests.families:even_length_reward` (test_model_families' reward): the driver ships the folder of `tests`;
    the tool worker (a Ray worker started elsewhere) could not find it on its own `sys.path`."""
    reward = "tests.families:even_length_reward"
    code = reward_code(reward)
    assert str(CHECKOUT / "tests") in code.binds and str(CHECKOUT) in code.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.realpath(p or ".") != str(CHECKOUT)])
    monkeypatch.chdir("/")
    monkeypatch.delitem(sys.modules, "tests", raising=False)  # find_spec looks there first
    mounts._module_code.cache_clear()
    assert str(CHECKOUT / "tests") not in reward_code(reward).binds  # this process alone would not find it
    sandbox = Sandbox(LIMITS, _uid(7), code={reward: code})

    async def run():
        try:
            return await sandbox.run_rewards(reward, [RewardItem(r, "", "stop", {}, 5.0) for r in ("ab", "abc")])
        finally:
            await sandbox.close()

    assert [(o.value, o.reason) for o in asyncio.run(run())] == [(1.0, None), (0.0, None)]
    mounts._module_code.cache_clear()
