"""The run's dashboard page, for users without Grafana: a telemetry sink that keeps the run's records in
memory and serves them, with the page that plots them, from a thread of the controller.

Routes: `/` (the page), `/static/<file>` (its script, style and the vendored uPlot charting library: nothing
is fetched from the internet, the machine may be offline), `/api/data?since=N` (the records after number N,
JSON; the page polls it) and `POST /api/scale` with `{"rollout": N}` and/or `{"learner": M}` (resize the
rollout pool, or the learner's ranks, through the controller's control API, the mechanism `asyncrl scale`
uses; a finished run answers 409).

`asyncrl dash RUN_DIR` serves the same page from a run folder (`serve_run_dir`).
"""

from __future__ import annotations

import json
import math
import mimetypes
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, urlparse

from asyncrl.telemetry.record import Record, Recorder, RunLog, load_run

STATIC = Path(__file__).resolve().parent / "static"

Scaler = Callable[[str, int], int]
"""Asks for a pool ("rollout" or "learner") of N workers or ranks; returns N (raises ValueError for a size it
refuses)."""
SCALED_POOLS = ("rollout", "learner")


class Dashboard(Recorder):
    """The live page of a running job. `scaler` is set by the controller once it can resize its pool."""

    def __init__(self, title: str, host: str = "127.0.0.1", port: int = 0):
        self.log = RunLog(title, live=True)
        self.scaler: Scaler | None = None
        self.server = DashboardServer(self.log, host, port, scale=lambda pool, n: self._scale(pool, n))
        self.url = self.server.url

    def record(self, rec: Record) -> None:
        self.log.append(rec)

    def close(self, summary: dict[str, Any]) -> None:
        super().close(summary)
        self.log.live = False  # the page stops offering the scale control; it stays up until the process exits

    def _scale(self, pool: str, size: int) -> int:
        if self.scaler is None or not self.log.live:
            raise LookupError("the run is not running (or not started yet): nothing to scale")
        return self.scaler(pool, size)


class DashboardServer:
    """`ThreadingHTTPServer` on (host, port) in a daemon thread; a taken port falls back to a free one."""

    def __init__(self, log: RunLog, host: str, port: int, scale: Scaler | None = None):
        handler = type("Handler", (_Handler,), {"log": log, "scale": staticmethod(scale) if scale else None})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError:  # another run (or a test) holds the port: any free one will do, the address is printed
            self.httpd = ThreadingHTTPServer((host, 0), handler)
        self.httpd.daemon_threads = True
        # An AF_INET(6) socket names its host as a str (typeshed also allows bytes, for other address families).
        bound_host, bound_port = cast(tuple[str, int], self.httpd.server_address[:2])
        self.url = f"http://{bound_host}:{bound_port}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="asyncrl-dashboard", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    log: RunLog
    scale: Scaler | None

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        url = urlparse(self.path)
        if url.path == "/api/data":
            since = parse_qs(url.query).get("since", ["0"])[0]
            self._json(HTTPStatus.OK, self.log.since(int(since) if since.isdigit() else 0))
        elif url.path in ("/", "/index.html"):
            self._file(STATIC / "index.html")
        elif url.path.startswith("/static/") and "/" not in url.path[len("/static/") :]:
            self._file(STATIC / url.path[len("/static/") :])
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {url.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if urlparse(self.path).path != "/api/scale":
            return self._json(HTTPStatus.NOT_FOUND, {"error": "POST /api/scale only"})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.scale is None:
                raise LookupError("this page shows a finished run: nothing to scale")
            sizes = {pool: int(body[pool]) for pool in SCALED_POOLS if pool in body}
            if not sizes:
                raise KeyError("rollout")
            self._json(HTTPStatus.OK, {pool: self.scale(pool, size) for pool, size in sizes.items()})
        except (KeyError, ValueError, TypeError) as e:  # before LookupError: a missing key is the caller's mistake
            self._json(HTTPStatus.BAD_REQUEST, {"error": f'want {{"rollout": N}} or {{"learner": N}}, N >= 1: {e}'})
        except LookupError as e:
            self._json(HTTPStatus.CONFLICT, {"error": str(e)})

    def _json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        # NaN and inf are not JSON (a browser's JSON.parse rejects them): a skipped step's loss becomes null.
        self._send(status, json.dumps(_finite(payload), allow_nan=False).encode(), "application/json")

    def _file(self, path: Path) -> None:
        if not path.is_file():
            return self._json(HTTPStatus.NOT_FOUND, {"error": f"no file {path.name}"})
        self._send(HTTPStatus.OK, path.read_bytes(), mimetypes.guess_type(path.name)[0] or "application/octet-stream")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - one line per poll would drown the run's output
        pass


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def serve_run_dir(run_dir: Path, host: str = "127.0.0.1", port: int = 0) -> DashboardServer:
    """The page of a finished or crashed run, from its files (`asyncrl dash`); no scale control."""
    return DashboardServer(load_run(run_dir), host, port)
