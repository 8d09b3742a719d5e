"""Object storage (`s3://`, `gs://`) through fsspec: where a run's files and a remote `model.path` live when
`storage.uri` or `model.path` names a bucket.

Every writer writes into a node-local staging copy of the remote folder (`staging`: the same relative path under
`$ASYNCRL_CACHE/storage/<scheme>/<bucket>/...` on each node) and uploads what it wrote (`Store.upload`); readers
download into the same staging place (`Store.download`). Every remote operation is retried with backoff while
the storage is unreachable, each failed try logged naming the operation and the URI, for up to
`outage_timeout_s`; then `StorageError` says what was not written and where the local copy is.

Credentials come from the environment of each process (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_SESSION_TOKEN`, `AWS_PROFILE`, `GOOGLE_APPLICATION_CREDENTIALS`, ...), never from the config.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["SCHEMES", "StorageError", "Store", "cache_root", "is_remote", "join", "staging"]

SCHEMES = ("s3", "gs")
"""Object stores a URI may name; each needs its fsspec implementation installed (s3fs, gcsfs)."""
_PACKAGES = {"s3": "s3fs", "gs": "gcsfs"}
_MAX_DELAY_S = 8.0
_SLOWEST_TRANSFER_BYTES_PER_S = 8 << 20
"""A transfer gets `request_timeout_s` plus one second per 8 MiB before it counts as failed (and is retried)."""
log = logging.getLogger("asyncrl.storage")
T = TypeVar("T")
OnRetry = Callable[[str], None] | None
"""Told each failed try's message (the run's telemetry notes it in events.jsonl)."""


class StorageError(OSError):
    """The object store stayed unreachable for `outage_timeout_s`, or refused an operation."""


def cache_root() -> Path:
    """This node's cache ($ASYNCRL_CACHE, default ~/.cache/asyncrl): models, shipped models, storage staging."""
    return Path(os.environ.get("ASYNCRL_CACHE", Path.home() / ".cache" / "asyncrl"))


def is_remote(uri: str | os.PathLike[str] | None) -> bool:
    return isinstance(uri, str) and uri.split("://", 1)[0] in SCHEMES and "://" in uri


def join(uri: str, *parts: str) -> str:
    """`uri/part/...`, with single slashes."""
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts if p.strip("/"))])


def staging(uri: str) -> Path:
    """This node's local copy of the remote folder `uri`."""
    scheme, rest = uri.split("://", 1)
    return cache_root() / "storage" / scheme / rest.strip("/")


_filesystems: dict[tuple, Any] = {}
_filesystems_lock = threading.Lock()


@dataclass(frozen=True)
class Store:
    """How this run talks to its object store (sent to every actor that reads or writes there)."""

    endpoint_url: str | None = None
    """An S3-compatible server's address (MinIO, Ceph, a local test server); None: the provider's own."""
    request_timeout_s: float = 20.0
    """Longest wait for one request (a transfer: plus one second per 8 MiB): a server that stopped answering is
    retried after this. Enforced around each operation (a PUT waiting for `100 Continue` has no socket timeout)."""
    outage_timeout_s: float = 600.0
    """How long one operation is retried (with backoff) before it fails with `StorageError`."""

    def filesystem(self, uri: str) -> tuple[Any, str]:
        """(fsspec filesystem, path inside it) for `uri`; one filesystem per scheme and settings per process."""
        scheme = uri.split("://", 1)[0]
        key = (scheme, self.endpoint_url, self.request_timeout_s, os.getpid())
        with _filesystems_lock:
            if key not in _filesystems:
                _filesystems[key] = self._open(scheme)
        fs = _filesystems[key]
        return fs, fs._strip_protocol(uri)

    def _open(self, scheme: str) -> Any:
        import fsspec

        try:
            fsspec.get_filesystem_class(scheme)
        except ImportError as e:
            raise StorageError(f"{scheme}:// storage needs the package {_PACKAGES[scheme]} (pip install it)") from e
        if scheme != "s3":
            return fsspec.filesystem(scheme, skip_instance_cache=True)
        timeouts = {"connect_timeout": self.request_timeout_s, "read_timeout": self.request_timeout_s}
        return fsspec.filesystem(
            "s3",
            skip_instance_cache=True,
            use_listings_cache=False,
            endpoint_url=self.endpoint_url,
            config_kwargs={**timeouts, "retries": {"max_attempts": 1}},
        )

    def retry(self, operation: str, uri: str, call: Callable[[], T], on_retry: OnRetry = None) -> T:
        """`call()`, retried with backoff (0.5 s doubling to 8 s) for up to `outage_timeout_s`; each failed try is
        logged (and passed to `on_retry`) naming `operation` and `uri`. A missing object or a refused permission
        is not retried."""
        began, delay = time.monotonic(), 0.5
        while True:
            try:
                return call()
            except (FileNotFoundError, PermissionError):
                raise
            except Exception as e:  # noqa: BLE001 - botocore/aiohttp errors share no base class
                elapsed = time.monotonic() - began
                why = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__}: no answer in time"
                if elapsed + delay > self.outage_timeout_s:
                    raise StorageError(
                        f"storage: {operation} {uri} failed for {elapsed:.0f} s (storage.outage_timeout_s = "
                        f"{self.outage_timeout_s:g}): {why}"
                    ) from e
                message = f"storage: {operation} {uri} failed ({why}); retrying in {delay:g} s"
                log.warning(message)
                if on_retry is not None:
                    on_retry(message)
                time.sleep(delay)
                delay = min(delay * 2, _MAX_DELAY_S)

    # ------------------------------------------------------------------------------------------------
    # Operations (each retried)

    def _timeout(self, num_bytes: int = 0) -> float:
        return self.request_timeout_s + num_bytes / _SLOWEST_TRANSFER_BYTES_PER_S

    def upload(self, local: str | Path, uri: str, on_retry: OnRetry = None) -> int:
        """Copy the file or folder `local` to `uri` (a folder's files keep their relative paths); -> bytes sent."""
        local = Path(local)
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        sent = 0
        for path in files:
            target = uri if path == local else join(uri, str(path.relative_to(local)))
            fs, remote = self.filesystem(target)
            timeout = self._timeout(path.stat().st_size)
            put = lambda fs=fs, path=path, remote=remote, t=timeout: fs.put_file(str(path), remote, timeout=t)  # noqa: E731
            self.retry("upload", target, put, on_retry)
            sent += path.stat().st_size
        return sent

    def download(self, uri: str, local: str | Path, on_retry: OnRetry = None) -> Path:
        """Copy the folder `uri` (every object under it) into `local`, which appears whole (renamed into place)."""
        local = Path(local)
        fs, root = self.filesystem(uri)
        sizes = self.retry("list", uri, lambda: fs.find(root, detail=True, timeout=self._timeout()), on_retry)
        if not sizes:
            raise FileNotFoundError(f"{uri} holds no files")
        tmp = local.with_name(local.name + f".part-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        for name, info in sizes.items():
            target = tmp / name[len(root) :].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            timeout = self._timeout(int(info.get("size") or 0))
            get = lambda n=name, t=target, s=timeout: fs.get_file(n, str(t), timeout=s)  # noqa: E731
            self.retry("download", f"{uri.split('://')[0]}://{name}", get, on_retry)
        shutil.rmtree(local, ignore_errors=True)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(local)
        return local

    def exists(self, uri: str) -> bool:
        fs, path = self.filesystem(uri)
        return bool(self.retry("check", uri, lambda: fs.exists(path, timeout=self._timeout())))

    def read_text(self, uri: str) -> str:
        fs, path = self.filesystem(uri)
        return self.retry("read", uri, lambda: fs.cat_file(path, timeout=self._timeout())).decode()

    def write_text(self, uri: str, text: str, on_retry: OnRetry = None) -> None:
        fs, path = self.filesystem(uri)
        self.retry("write", uri, lambda: fs.pipe_file(path, text.encode(), timeout=self._timeout()), on_retry)

    def listdir(self, uri: str) -> list[str]:
        """Names directly under the folder `uri` ([] when there is none)."""
        fs, path = self.filesystem(uri)
        try:
            entries = self.retry("list", uri, lambda: fs.ls(path, detail=False, timeout=self._timeout()))
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def move(self, uri: str, to: str) -> None:
        """Move the folder `uri` to `to` (copied, then deleted: object stores have no rename)."""
        fs, path = self.filesystem(uri)
        _, target = self.filesystem(to)
        self.retry("move", uri, lambda: fs.mv(path, target, recursive=True))

    def remove(self, uri: str) -> None:
        """Delete the folder or file `uri` (nothing when it does not exist)."""
        fs, path = self.filesystem(uri)
        try:
            self.retry("delete", uri, lambda: fs.rm(path, recursive=True, timeout=self._timeout()))
        except FileNotFoundError:
            pass

    def probe(self, uri: str) -> str | None:
        """Write, read back and delete a small object under `uri`: None when that works, else why not (one try)."""
        target = join(uri, f".asyncrl-probe-{os.getpid()}-{time.time_ns()}")
        try:
            fs, path = self.filesystem(target)
            fs.pipe_file(path, b"ok", timeout=self._timeout())
            ok = fs.cat_file(path, timeout=self._timeout()) == b"ok"
            fs.rm(path, timeout=self._timeout())
        except Exception as e:  # noqa: BLE001 - any failure is the answer
            return f"{type(e).__name__}: {e}"
        return None if ok else "the object read back differs from the one written"
