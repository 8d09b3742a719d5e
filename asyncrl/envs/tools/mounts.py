"""What a bwrap sandbox sees of the host's file system: the system's programs and libraries (`system_binds`),
and for a user reward the code folders it imports (`RewardCode`), each read-only. Nothing else of the host
is there: no home folders, no checkout, no run folder, no dataset (docs/tools.md, "What a sandboxed run sees").

A reward's code folders are resolved where its module can be found (`reward_code`): the driver resolves them
and ships them to the tool workers (`ToolPool`), whose own `sys.path` may lack the folder (a Ray worker starts
elsewhere); a sandbox given none resolves them in its own process.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import site
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["RewardCode", "interpreter_site_packages", "reward_code", "system_binds"]

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""The system's programs and shared libraries (the interpreter links against them; `setpriv` is one)."""
SYSTEM_FILES = ("/etc/ld.so.cache",)
"""The dynamic loader's cache: where the shared libraries of `SYSTEM_DIRS` are."""


@dataclass(frozen=True)
class RewardCode:
    """What a sandboxed reward process needs to import its module: host paths bound read-only at the same place
    (`binds`: the module's top-level package folder or file, asyncrl's package folder, the environment's
    site-packages) and the `sys.path` entries that find them (`path`)."""

    binds: tuple[str, ...]
    path: tuple[str, ...]

    def merged(self, other: RewardCode) -> RewardCode:
        return RewardCode(_unique([*self.binds, *other.binds]), _unique([*self.path, *other.path]))


def reward_code(reward: str) -> RewardCode:
    """The code folders of `reward` (`module:function`) as this process finds them (nothing of a module it
    cannot find: the sandbox's import then fails naming it), with asyncrl's and the environment's."""
    return _module_code(reward.split(":", 1)[0].split(".")[0]).merged(_module_code("asyncrl")).merged(_site_code())


@functools.lru_cache(maxsize=64)
def _module_code(top: str) -> RewardCode:
    """The folder (package) or file (module) of the top-level module `top`, and the folder that holds it. Only
    the top-level name is looked up: nothing of the user's code runs here."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return RewardCode((), ())
    if spec.submodule_search_locations:  # a package (a namespace package may span folders)
        places = [os.path.realpath(p) for p in spec.submodule_search_locations]
    elif spec.origin and os.path.isfile(spec.origin):
        places = [os.path.realpath(spec.origin)]
    else:
        return RewardCode((), ())  # built in, frozen: the interpreter's own
    return RewardCode(_unique(places), _unique(os.path.dirname(p) for p in places))


def _site_code() -> RewardCode:
    """The site-packages folders of this process's `sys.path` and environment (the reward's dependencies)."""
    entries = [*sys.path, *site.getsitepackages()]
    found = [os.path.realpath(p) for p in entries if os.path.basename(p) in ("site-packages", "dist-packages")]
    folders = _unique(p for p in found if os.path.isdir(p))
    return RewardCode(folders, folders)


def interpreter_site_packages() -> list[str]:
    """The site-packages folders of the interpreter's own installation (not a virtual environment's): what a
    program's sandbox shows empty (the standard library is all it gets; and `site` has nothing to scan)."""
    base = {"base": sys.base_prefix, "platbase": sys.base_prefix}
    paths = sysconfig.get_paths(scheme=sysconfig.get_default_scheme(), vars=base)
    return list(_unique(os.path.realpath(paths[k]) for k in ("purelib", "platlib")))


def system_binds() -> list[str]:
    """bwrap's arguments for `SYSTEM_DIRS` (a symbolic link stays one, as with merged /usr) and `SYSTEM_FILES`."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in SYSTEM_FILES:
        if os.path.isfile(path):  # its folder enterable by every uid (bwrap would make it 0700), and empty
            args += ["--perms", "0755", "--dir", os.path.dirname(path), "--ro-bind", path, path]
    return args


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))
