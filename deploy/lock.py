"""The install lock, requirements.lock: every distribution of a CPU install (`.[cpu,test,bench]`) at one version
with its wheel's sha256, so two machines that run `make install` get the same dependency set.

    python deploy/lock.py check [--extras cpu,test,bench]   # `make install` runs it first
    python deploy/lock.py write [--extras ...] [--drop a,b]   # `make lock`
    python deploy/lock.py uv-index                            # pip's index settings as uv flags (`make install`)

`check` fails, naming `make lock`, when a requirement of pyproject.toml (the project's and those of the extras)
is not met by a pinned version, or names a package the lock lacks. `write` resolves the project with pip's
resolver (`pip lock`), preferring the versions pinned already (the current lock, else the running environment's
`pip freeze`), so refreshing after a pyproject.toml change moves only what the change needs; `--drop` leaves out
packages the install removes (the CUDA-only wheels vLLM drags in on CPU machines). The hashes are those of the
wheels for this machine's Python and platform (x86-64 Linux, CPython 3.11): other platforms install from the
loose ranges (`make install EXTRAS=...`, docs/development.md).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a fresh venv has only pip, which vendors packaging
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
PYPROJECT = ROOT / "pyproject.toml"
REFRESH = "make lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of the `name==version` lines of a lock or a `pip freeze` output."""
    found = {}
    for line in path.read_text().splitlines():
        if m := PIN.match(line.strip()):
            found[canonicalize_name(m[1])] = m[2]
    return found


def requirements(extras: list[str]) -> list[Requirement]:
    """The project's requirements with those of `extras`, self-references (`asyncrl[agent]`) expanded."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    optional, name = project.get("optional-dependencies", {}), canonicalize_name(project["name"])
    wanted, seen, out = list(extras), set(), [Requirement(r) for r in project["dependencies"]]
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (EXTRAS)")
        seen.add(extra)
        for raw in optional[extra]:
            req = Requirement(raw)
            if canonicalize_name(req.name) == name:
                wanted += sorted(req.extras)
            else:
                out.append(req)
    return out


def out_of_step(extras: list[str]) -> list[str]:
    """One line per requirement of pyproject.toml the lock does not meet (empty: in step)."""
    if not LOCK.exists():
        return [f"{LOCK.name} is missing"]
    pinned, problems = pins(LOCK), []
    for req in requirements(extras):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        version = pinned.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req} is not in {LOCK.name}")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req} is not met by the pinned {req.name}=={version}")
    return problems


def check(extras: list[str]) -> int:
    problems = out_of_step(extras)
    if problems:
        print(f"{LOCK.name} is out of step with pyproject.toml:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        print(f"refresh it with `{REFRESH}` (and commit it)", file=sys.stderr)
        return 1
    return 0


def write(extras: list[str], drop: set[str]) -> int:
    """Resolve `.[extras]` preferring the pinned versions; write the lock with one wheel hash per package."""
    prefer = pins(LOCK) if LOCK.exists() else _freeze()
    pylock = ROOT / "pylock.tmp.toml"  # pip writes the project's path relative to the lock: inside the checkout
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "prefer.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(prefer.items()) if n not in drop))
        cmd = [sys.executable, "-m", "pip", "lock", "-q", "--progress-bar", "off", "-o", str(pylock)]
        cmd += ["-c", str(constraints), f"{ROOT}[{','.join(extras)}]"]
        if subprocess.run(cmd).returncode != 0:
            pylock.unlink(missing_ok=True)
            print(
                f"pip could not resolve pyproject.toml with the versions of {LOCK.name}: remove the lines of the "
                f"packages whose ranges changed from {LOCK.name} and rerun `{REFRESH}`",
                file=sys.stderr,
            )
            return 1
        locked = tomllib.loads(pylock.read_text())["packages"]
        pylock.unlink()
    project = canonicalize_name(tomllib.loads(PYPROJECT.read_text())["project"]["name"])
    lines = [_HEADER.format(extras=",".join(extras), drop=",".join(sorted(drop)) or "-")]
    for package in sorted(locked, key=lambda p: canonicalize_name(p["name"])):
        name = canonicalize_name(package["name"])
        if name == project or name in drop:
            continue
        files = package.get("wheels", []) + ([package["sdist"]] if "sdist" in package else [])
        hashes = " ".join(f"--hash=sha256:{f['hashes']['sha256']}" for f in files)
        lines.append(f"{name}=={package['version']} {hashes}")
    LOCK.write_text("\n".join(lines) + "\n")
    moved = {n: (v, pins(LOCK).get(n)) for n, v in prefer.items() if pins(LOCK).get(n) not in (None, v)}
    print(f"wrote {LOCK.name}: {len(lines) - 1} packages; versions moved: {moved or 'none'}")
    return 0


def uv_index(pip_config: str, default_index: str) -> list[str]:
    """uv's flags for the indexes and wheel folders in `pip config list` output (uv reads no pip configuration), so
    uv installs the lock from where pip would; an environment setting overrides the same key of a file. pip's main
    index (`index-url`, else `default_index`) comes first: pip keeps, of a version's files on several indexes, the
    one whose hash is locked, while uv takes the first index's and then checks its hash."""
    found: dict[str, str] = {}
    for line in pip_config.splitlines():
        scope, _, rest = line.partition(".")
        key, _, value = rest.partition("=")
        if key in ("index-url", "extra-index-url", "find-links") and (scope == ":env:" or key not in found):
            found[key] = value.strip().strip("'\"")
    indexes = [found.get("index-url", default_index), *found.get("extra-index-url", "").split()]
    return [arg for url in indexes for arg in ("--extra-index-url", url)] + [
        arg for folder in found.get("find-links", "").split() for arg in ("--find-links", folder)
    ]


def _pip_config() -> str:
    return subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout


def _freeze() -> dict[str, str]:
    with tempfile.NamedTemporaryFile("w+", suffix=".txt") as f:
        f.write(subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                               text=True, check=True).stdout)  # fmt: skip
        f.flush()
        return pins(Path(f.name))


_HEADER = """\
# The install lock: `make install` installs exactly these (--require-hashes --no-deps), then the project.
# Generated by `make lock` (python deploy/lock.py write) for extras {extras}, CPython 3.11 on x86-64 Linux;
# left out (removed by the CPU install): {drop}. The loose ranges stay in pyproject.toml."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "write", "uv-index"])
    parser.add_argument("--extras", default="cpu,test,bench")
    parser.add_argument("--drop", default="", help="comma-separated packages to leave out of the lock")
    args = parser.parse_args()
    extras = [e for e in args.extras.split(",") if e]
    if args.command == "check":
        return check(extras)
    if args.command == "uv-index":
        from pip._internal.models.index import PyPI

        print(" ".join(uv_index(_pip_config(), PyPI.simple_url)))
        return 0
    return write(extras, {canonicalize_name(d) for d in args.drop.split(",") if d})


if __name__ == "__main__":
    sys.exit(main())
