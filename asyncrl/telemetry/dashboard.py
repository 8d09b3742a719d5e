"""The run's dashboard page, for users without Grafana: a telemetry sink that keeps the run's records in
memory and serves them, with the page that plots them, from a thread of the controller.

Routes: `/` (the page), `/static/<file>` (its script, style and the vendored uPlot charting library: nothing
is fetched from the internet, the machine may be offline), `/api/data?since=N` (the records after number N,
JSON; the page polls it) and `POST /api/scale` with `{"rollout": N}` and/or `{"learner": M}` (resize the
rollout pool, or the learner's ranks, through the controller's control API, the mechanism `asyncrl scale`
uses; a finished run answers 409).

`asyncrl dash RUN_DIR` serves the same page from a run folder (`serve_run_dir`).

Every route but `/static/` asks for the server's token (`asyncrl.cluster.http_guard`: Host, Origin, token, and
`application/json` for the POST): the address printed at start carries it (`page_url`, `?token=...`) and the page
embeds it for its own calls. A request body is capped at `MAX_BODY_BYTES`; a client has `TIMEOUT_S` per read.
"""

from __future__ import annotations

import html
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

from asyncrl.cluster.http_guard import DASHBOARD_TOKEN_ENV, Guard, beyond_loopback_error, is_loopback, new_token
from asyncrl.telemetry.record import Record, Recorder, RunLog, load_run

STATIC = Path(__file__).resolve().parent / "static"
MAX_BODY_BYTES = 4096
"""Largest request body the server reads (`{"rollout": N}` needs a few bytes); larger ones get 413."""
TIMEOUT_S = 10.0
"""Seconds a client may take to send a request line, its headers or its body before the connection is closed."""
MAX_SINCE_DIGITS = 18

Scaler = Callable[[str, int], int]
"""Asks for a pool ("rollout" or "learner") of N workers or ranks; returns N (raises ValueError for a size it
refuses)."""
SCALED_POOLS = ("rollout", "learner")


class Dashboard(Recorder):
    """The live page of a running job. `scaler` is set by the controller once it can resize its pool."""

    def __init__(self, title: str, host: str = "127.0.0.1", port: int = 0, token: str = ""):
        self.log = RunLog(title, live=True)
        self.scaler: Scaler | None = None
        self.server = DashboardServer(self.log, host, port, scale=lambda pool, n: self._scale(pool, n), token=token)
        self.url = self.server.url
        self.page_url = self.server.page_url

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
    """`ThreadingHTTPServer` on (host, port) in a daemon thread; a taken port falls back to a free one. `token`
    "" = a fresh one (a host beyond loopback must be given one: ValueError otherwise). `url` is the base address,
    `page_url` the page's address with the token (the one line to print; never to a file)."""

    def __init__(self, log: RunLog, host: str, port: int, scale: Scaler | None = None, token: str = ""):
        if not token and not is_loopback(host):
            key, where = "telemetry.dashboard_token", "the dashboard's host"
            raise ValueError(beyond_loopback_error(key, DASHBOARD_TOKEN_ENV, where, host))
        guard = Guard(host, token or new_token())
        scale_method = staticmethod(scale) if scale else None
        handler = type("Handler", (_Handler,), {"log": log, "scale": scale_method, "guard": guard})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError:  # another run (or a test) holds the port: any free one will do, the address is printed
            self.httpd = ThreadingHTTPServer((host, 0), handler)
        self.httpd.daemon_threads = True
        # An AF_INET(6) socket names its host as a str (typeshed also allows bytes, for other address families).
        bound_host, bound_port = cast(tuple[str, int], self.httpd.server_address[:2])
        self.url = f"http://{bound_host}:{bound_port}/"
        self.token = guard.token
        self.page_url = f"{self.url}?token={guard.token}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="asyncrl-dashboard", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    log: RunLog
    scale: Scaler | None
    guard: Guard
    timeout = TIMEOUT_S  # a client that stalls mid-request loses its connection instead of holding a thread
    default_request_version = "HTTP/1.0"  # a garbled request line gets a status line with its 400, not HTTP/0.9

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        url = urlparse(self.path)
        if url.path.startswith("/static/") and "/" not in url.path[len("/static/") :]:
            return self._file(STATIC / url.path[len("/static/") :])  # the page's public assets: no token
        if self._refused(url.query):
            return
        if url.path == "/api/data":
            since = parse_qs(url.query).get("since", ["0"])[0]
            start = int(since) if since.isdigit() and len(since) <= MAX_SINCE_DIGITS else 0
            self._json(HTTPStatus.OK, self.log.since(start))
        elif url.path in ("/", "/index.html"):
            self._page()
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {url.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self._refused(""):
            return
        if urlparse(self.path).path != "/api/scale":
            return self._json(HTTPStatus.NOT_FOUND, {"error": "POST /api/scale only"})
        raw = self._body()
        if raw is None:
            return
        try:
            body = json.loads(raw or b"{}")
            if self.scale is None:
                raise LookupError("this page shows a finished run: nothing to scale")
            sizes = {pool: int(body[pool]) for pool in SCALED_POOLS if pool in body}
            if not sizes:
                raise KeyError("rollout")
            self._json(HTTPStatus.OK, {pool: self.scale(pool, size) for pool, size in sizes.items()})
        except (KeyError, ValueError, TypeError, RecursionError) as e:  # before LookupError: the caller's mistake
            self._json(HTTPStatus.BAD_REQUEST, {"error": f'want {{"rollout": N}} or {{"learner": N}}, N >= 1: {e}'})
        except LookupError as e:
            self._json(HTTPStatus.CONFLICT, {"error": str(e)})

    def do_PUT(self) -> None:  # noqa: N802
        self._json(HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"{self.command} is not served: GET, or POST /api/scale"})

    do_DELETE = do_PATCH = do_OPTIONS = do_PUT  # noqa: N815 - no CORS preflight is ever granted

    def _refused(self, query: str) -> bool:
        """Answer and return True when the guard refuses the request (Host, Origin, token, content type)."""
        tokens = parse_qs(query).get("token")
        refusal = self.guard.refusal(self.command, self.headers, tokens[0] if tokens else None)
        if refusal is not None:
            self._json(refusal[0], {"error": refusal[1]})
        return refusal is not None

    def _body(self) -> bytes | None:
        """The request body, at most MAX_BODY_BYTES; None once a 4xx naming the problem is sent."""
        length = self.headers.get("Content-Length")
        if length is None:
            self._json(HTTPStatus.LENGTH_REQUIRED, {"error": "Content-Length is required (no chunked bodies)"})
        elif not length.strip().isdigit():
            self._json(HTTPStatus.BAD_REQUEST, {"error": f"Content-Length {length[:40]!r} is not a byte count"})
        elif int(length) > MAX_BODY_BYTES:
            self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"body over {MAX_BODY_BYTES} bytes"})
        else:
            return self.rfile.read(int(length))
        self.close_connection = True  # the unread body must not be parsed as the next request
        return None

    def _page(self) -> None:
        """index.html with the token embedded, for the page's own calls."""
        meta = f'<meta name="asyncrl-token" content="{html.escape(self.guard.token)}">'
        page = (STATIC / "index.html").read_text().replace("<head>", f"<head>\n  {meta}", 1)
        self._send(HTTPStatus.OK, page.encode(), "text/html; charset=utf-8")

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
        self.send_header("X-Frame-Options", "DENY")  # no other site frames the scale control (clickjacking)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")  # the page's address carries the token
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


def serve_run_dir(run_dir: Path, host: str = "127.0.0.1", port: int = 0, token: str = "") -> DashboardServer:
    """The page of a finished or crashed run, from its files (`asyncrl dash`); no scale control."""
    return DashboardServer(load_run(run_dir), host, port, token=token)
