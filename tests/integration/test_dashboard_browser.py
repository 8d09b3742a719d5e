"""The dashboard page in headless Chromium (Debian's, driven by Playwright; no browser is downloaded) during a
short real run (Ray, one vLLM CPU engine, one FSDP2 rank, the tiny model): every plot renders with data while
the run goes on, the data endpoint has every kind of record, the scale control reaches the controller, and
`asyncrl dash` on the finished run's folder serves the same rows. A page of another origin cannot scale the job
and a DNS-rebinding page (a forged Host) is refused. A screenshot is kept as an artifact."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.telemetry.dashboard import Dashboard
from asyncrl.testing import SHORT_CONTEXT

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHARTS = ["reward", "staleness", "mismatch", "queue", "busy", "throughput", "sync", "pool"]
ARTIFACT = Path("runs/artifacts/dashboard.png")


def _config(out: Path, model_dir: Path):
    overrides = {
        "output_dir": str(out),
        "model.path": str(model_dir),
        "model.preset": "tiny-0.3m",
        "model.warm_start_examples": 0,
        "rollout.samples_per_prompt": 4,
        "rollout.max_tokens": 6,
        "rollout.max_model_len": SHORT_CONTEXT,
        "buffer.max_staleness": 1,
        "buffer.filter_zero_variance": False,
        "algorithm.preset": "grpo",
        "learner.prompts_per_step": 4,
        "learner.max_steps": 500,  # the test stops it once it has seen what it checks
        "data.eval_prompts": 8,
        "eval.every_steps": 2,
        "telemetry.progress": False,
        "telemetry.pool_every_s": 0.5,
        "checkpoint.every_steps": 0,
        "checkpoint.export_hf": False,
        "learner.compile": False,
    }
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def _get(url: str, token: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    return json.loads(urllib.request.urlopen(request, timeout=10).read())


@pytest.fixture(scope="module")
def live_run(ray_cluster, tiny_model_dir, tmp_path_factory):
    """A controller running in a thread; yields (controller, dashboard, thread) and stops it at the end."""
    from asyncrl.controller.loop import Controller

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (Makefile SYSTEM_PACKAGES, system-deps)")
    controller = Controller(_config(tmp_path_factory.mktemp("dash") / "run", tiny_model_dir), tiny_model_dir)
    (dashboard,) = [s for s in controller.telemetry.sinks if isinstance(s, Dashboard)]
    result: dict = {}
    controller.start()
    thread = threading.Thread(target=lambda: result.update(summary=controller.run()), daemon=True)
    thread.start()
    try:
        yield controller, dashboard, thread, result
    finally:
        controller.request_stop("test over")
        thread.join(300)
        controller.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # rebind.test resolves to 127.0.0.1, as a DNS-rebinding domain would once its page is loaded
        rules = "--host-resolver-rules=MAP rebind.test 127.0.0.1"
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", rules])
        yield chromium
        chromium.close()


def _rendered(page) -> dict:
    """Per chart: canvases drawn, legend labels and whether any series has a value (from the page's uPlot)."""
    return page.evaluate(
        """(ids) => Object.fromEntries(ids.map((id) => {
            const box = document.getElementById("chart-" + id);
            const chart = window.dash.charts[id];
            return [id, {
                canvases: box ? box.querySelectorAll("canvas").length : 0,
                legend: box ? [...box.querySelectorAll(".u-legend .u-series th")].map((th) => th.textContent.trim()) : [],
                points: chart ? chart.data[0].length : 0,
                valued: chart ? chart.data.slice(1).some((s) => s.some((v) => v !== null && v !== undefined)) : false,
            }];
        }))""",
        CHARTS,
    )


def _wait_for(page, check, timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while True:
        state = _rendered(page)
        if check(state) or time.monotonic() > deadline:
            return state
        time.sleep(1.0)


def test_the_page_plots_the_running_job_and_its_scale_control_reaches_the_controller(live_run, browser):
    controller, dashboard, thread, _ = live_run
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(dashboard.page_url)
    state = _wait_for(page, lambda s: all(c["valued"] for c in s.values()) and s["reward"]["points"] >= 2)
    assert thread.is_alive(), "the run ended before the page showed it"
    for name, chart in state.items():
        assert chart["canvases"] >= 1 and chart["valued"], f"{name}: {chart}"
        assert len(chart["legend"]) >= 2 and all(chart["legend"]), f"{name} legend: {chart['legend']}"  # x + series
    assert "reward" in state["reward"]["legend"] and "held-out accuracy" in state["reward"]["legend"]
    assert "all lags" in state["mismatch"]["legend"]
    data = _get(dashboard.url + "api/data", dashboard.server.token)
    assert data["live"] is True
    assert {"step", "eval", "sync", "pool", "phase"} <= {r["kind"] for r in data["records"]}

    page.fill("#scale-n", "2")
    page.click("#scale button")
    page.wait_for_function("document.getElementById('scale-result').textContent.includes('asked for 2')", timeout=60_000)
    page.wait_for_function("document.getElementById('notes').textContent.includes('scaling the rollout pool 1 -> 2')", timeout=120_000)
    assert [e["kind"] for e in controller.fleet.pool_events if e["kind"] == "scaled_up"] == ["scaled_up"]

    shot = Path(controller.cfg.output_dir) / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACT)
    print(f"dashboard screenshot: {shot} (copied to {ARTIFACT.resolve()})")
    page.close()


class _Recorded:
    """The dashboard's guard, recording (method, Host, Origin, refusal status) of each request it checks."""

    def __init__(self, guard):
        self.guard, self.seen = guard, []

    def refusal(self, method, headers, query_token=None):
        refusal = self.guard.refusal(method, headers, query_token)
        self.seen.append((method, headers.get("Host"), headers.get("Origin"), refusal and int(refusal[0])))
        return refusal

    def __getattr__(self, name):
        return getattr(self.guard, name)


HOSTILE = """<!doctype html><script>
async function attack(target) {
  const out = {};
  // the "simple" cross-site request a web page can send without a preflight
  out.simple = await fetch(target + "api/scale", { method: "POST", mode: "no-cors", headers: { "Content-Type": "text/plain" },
    body: JSON.stringify({ rollout: 3 }) }).then(() => "sent", (e) => "failed: " + e);
  // a JSON call with a guessed token needs a CORS preflight, which the dashboard never grants
  out.json = await fetch(target + "api/scale", { method: "POST", headers: { "Content-Type": "application/json",
    Authorization: "Bearer guess" }, body: JSON.stringify({ rollout: 3 }) }).then((r) => r.status, (e) => "blocked");
  return out;
}
</script>"""


def test_a_page_of_another_origin_cannot_scale_the_job_and_a_forged_host_is_refused(live_run, browser):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    controller, dashboard, thread, _ = live_run
    assert thread.is_alive()
    handler = dashboard.server.httpd.RequestHandlerClass
    recorded = handler.guard = _Recorded(handler.guard)

    class Hostile(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(HOSTILE.encode())

        def log_message(self, *args):
            pass

    evil = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    wanted = controller.fleet.control.poll()
    try:
        page = browser.new_page()
        page.goto(f"http://localhost:{evil.server_address[1]}/")  # another origin, on this machine
        outcome = page.evaluate("(target) => attack(target)", dashboard.url)
        assert outcome["json"] == "blocked", outcome
        origin = f"http://localhost:{evil.server_address[1]}"
        assert ("POST", dashboard.url[7:-1], origin, 403) in recorded.seen, recorded.seen  # refused for its Origin

        # DNS rebinding: rebind.test now resolves to 127.0.0.1, so its page is same-origin with the dashboard's port
        # and may send any header, even the real token: the Host it carries names rebind.test and is refused.
        port = dashboard.url.rsplit(":", 1)[1].strip("/")
        page.goto(f"http://rebind.test:{port}/?token={dashboard.server.token}")
        assert "does not name this server" in page.content()
        status = page.evaluate(
            """([token]) => fetch("/api/scale", { method: "POST", body: JSON.stringify({ rollout: 3 }),
                headers: { "Content-Type": "application/json", Authorization: "Bearer " + token } }).then((r) => r.status)""",
            [dashboard.server.token],
        )
        assert status == 403 and ("POST", f"rebind.test:{port}", f"http://rebind.test:{port}", 403) in recorded.seen
        assert controller.fleet.control.poll() == wanted  # nothing reached the controller
        page.close()
    finally:
        handler.guard = recorded.guard
        evil.shutdown()
        evil.server_close()


def test_asyncrl_dash_on_the_finished_run_serves_the_same_rows(live_run, browser):
    controller, dashboard, thread, result = live_run
    controller.request_stop("the page test is done")
    thread.join(300)
    assert result["summary"]["steps"] >= 2
    run_dir = controller.cfg.output_dir
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "dash", run_dir, "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        page_url = proc.stdout.readline().split(": ", 1)[1].split()[0]
        url, token = page_url.split("?token=")
        steps = lambda reply: [r["data"] for r in reply["records"] if r["kind"] == "step"]  # noqa: E731
        finished, live = _get(url + "api/data", token), _get(dashboard.url + "api/data", dashboard.server.token)
        assert finished["live"] is False and len(steps(finished)) == result["summary"]["steps"]
        assert steps(finished) == steps(live)
        assert [r["data"] for r in finished["records"] if r["kind"] == "eval"] == [r["data"] for r in live["records"] if r["kind"] == "eval"]
        page = browser.new_page()
        page.goto(page_url)
        state = _wait_for(page, lambda s: s["reward"]["valued"] and s["staleness"]["valued"], timeout_s=60)
        assert state["reward"]["valued"] and state["staleness"]["valued"] and state["queue"]["valued"]
        assert page.is_hidden("#scale")  # a finished run offers no scale control
        page.close()
    finally:
        proc.terminate()
        proc.wait(10)
