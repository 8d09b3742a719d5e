"""The dashboard page in headless Chromium (Debian's, driven by Playwright; no browser is downloaded) during a
short real run (Ray, one vLLM CPU engine, one FSDP2 rank, the tiny model): every plot renders with data while
the run goes on, the data endpoint has every kind of record, the scale control reaches the controller, and
`asyncrl dash` on the finished run's folder serves the same rows. A screenshot is kept as an artifact."""

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


def _get(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


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
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
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
    page.goto(dashboard.url)
    state = _wait_for(page, lambda s: all(c["valued"] for c in s.values()) and s["reward"]["points"] >= 2)
    assert thread.is_alive(), "the run ended before the page showed it"
    for name, chart in state.items():
        assert chart["canvases"] >= 1 and chart["valued"], f"{name}: {chart}"
        assert len(chart["legend"]) >= 2 and all(chart["legend"]), f"{name} legend: {chart['legend']}"  # x + series
    assert "reward" in state["reward"]["legend"] and "held-out accuracy" in state["reward"]["legend"]
    assert "all lags" in state["mismatch"]["legend"]
    data = _get(dashboard.url + "api/data")
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


def test_asyncrl_dash_on_the_finished_run_serves_the_same_rows(live_run, browser):
    controller, dashboard, thread, result = live_run
    controller.request_stop("the page test is done")
    thread.join(300)
    assert result["summary"]["steps"] >= 2
    run_dir = controller.cfg.output_dir
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "dash", run_dir, "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split(": ", 1)[1].split()[0]
        steps = lambda reply: [r["data"] for r in reply["records"] if r["kind"] == "step"]  # noqa: E731
        finished, live = _get(url + "api/data"), _get(dashboard.url + "api/data")
        assert finished["live"] is False and len(steps(finished)) == result["summary"]["steps"]
        assert steps(finished) == steps(live)
        assert [r["data"] for r in finished["records"] if r["kind"] == "eval"] == [r["data"] for r in live["records"] if r["kind"] == "eval"]
        page = browser.new_page()
        page.goto(url)
        state = _wait_for(page, lambda s: s["reward"]["valued"] and s["staleness"]["valued"], timeout_s=60)
        assert state["reward"]["valued"] and state["staleness"]["valued"] and state["queue"]["valued"]
        assert page.is_hidden("#scale")  # a finished run offers no scale control
        page.close()
    finally:
        proc.terminate()
        proc.wait(10)
