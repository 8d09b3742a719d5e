"""The driver's side of a run folder on an object store (`storage.uri` = `s3://...`, `gs://...`).

The driver writes its files (config, metrics.jsonl, events.jsonl, summary.json, bad_batches/, tensorboard/) into
its staging copy of the run folder (`Config.run_dir()`); `RunMirror` uploads what changed every
`storage.sync_every_s` in a thread, and everything again when the run ends. The files other processes write are
uploaded by their writers: checkpoint shards and exports by the learner ranks, the trajectory log by the replay
queue when it closes; `LEFT_TO_WRITERS` names them.

Outage policy: an upload that fails is retried with backoff, each failed try noted (events.jsonl and the log)
naming the operation and the URI; nothing is lost meanwhile (the files stay in the staging copy and a later sync
sends them). When the storage stays unreachable for `storage.outage_timeout_s`, the run is asked to stop: it
checkpoints (the learner's upload waits the same time again) and the final upload raises `StorageError` naming the
local folder that holds what was not uploaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.remote import StorageError, is_remote, join
from asyncrl.telemetry.sinks import Sink

__all__ = ["LEFT_TO_WRITERS", "RunMirror", "pull_run_files"]

LEFT_TO_WRITERS = ("checkpoints", "final_model", "best_model")
"""Top-level entries of the run folder the mirror does not upload (their writers do), besides trajectory logs."""
PULLED_ON_RESUME = ("metrics.jsonl", "events.jsonl")
"""What a resumed run appends to: fetched from the store when this machine's staging copy lacks it."""


def pull_run_files(cfg: Config) -> None:
    """A run resuming from an object store goes on appending to its predecessor's rows and events."""
    if not (cfg.checkpoint.resume_from and cfg.storage.uri and is_remote(cfg.storage.uri)):
        return
    store, out = cfg.storage.store(), cfg.run_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name in PULLED_ON_RESUME:
        if (out / name).exists():
            continue
        try:
            (out / name).write_text(store.read_text(join(cfg.run_uri(), name)))
        except FileNotFoundError:
            continue


class RunMirror(Sink):
    """Uploads the driver's staging copy of the run folder (a sink: the run's close uploads everything)."""

    def __init__(self, cfg: Config, note: Callable[[str], None], stop: Callable[[str], None]):
        self.local, self.uri, self.store = cfg.run_dir(), cfg.run_uri(), cfg.storage.store()
        self.every_s = cfg.storage.sync_every_s
        self._note, self._stop = note, stop
        self._sent: dict[Path, tuple[int, int]] = {}
        """File -> (size, mtime_ns) when it was last uploaded."""
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: StorageError | None = None
        """Why the background upload gave up (the run was asked to stop)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="asyncrl-storage-sync", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._closing.wait(self.every_s):
            try:
                self.upload_changed()
            except StorageError as e:
                self.failure = e
                self._stop(f"{e}; the run's files are kept in {self.local}")
                return

    def upload_changed(self) -> int:
        """Upload every file of the staging copy that changed since its last upload; -> files uploaded."""
        with self._lock:
            uploaded = 0
            for path in self._changed():
                stat = path.stat()
                self.store.upload(path, join(self.uri, str(path.relative_to(self.local))), on_retry=self._note)
                self._sent[path] = (stat.st_size, stat.st_mtime_ns)
                uploaded += 1
            return uploaded

    def _changed(self) -> list[Path]:
        if not self.local.is_dir():
            return []
        changed = []
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            top = path.relative_to(self.local).parts[0]
            if top in LEFT_TO_WRITERS or top.startswith(("trajectories.", "best_model.")) or top.endswith(".partial"):
                continue
            stat = path.stat()
            if self._sent.get(path) != (stat.st_size, stat.st_mtime_ns):
                changed.append(path)
        return changed

    def finish(self) -> None:
        """Stop the thread and upload what is left (retried for up to `storage.outage_timeout_s`); raises
        `StorageError` naming the local folder when the storage stays unreachable."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.upload_changed()
        except StorageError as e:
            raise StorageError(f"{e}; the run's files not uploaded are kept in {self.local}") from e

    def close(self, summary: dict[str, Any]) -> None:
        self.finish()  # the last events (the run's close) were written by the sinks before this one
