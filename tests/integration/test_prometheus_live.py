"""A real Prometheus (the Debian package, installed by `make test`) scrapes a real streaming run (tiny model,
one vLLM CPU engine, Ray local) every second, and its HTTP API answers while the run is still going: the
staleness histogram, a mismatch series per staleness bucket, queue depth and non-zero live generated tokens/s.

The same run carries the alarm checks: `ess_fraction_below` at 1.01 must fire at the first step (the
normalised ESS is at most 1) and shows as `asyncrl_alarm{name="ess_fraction_below"} 1`; once the live checks
passed, the test arms a second rule, `k3_above` at -1 with `stop: true` (k3 >= 0 always), which trips at the
next step and ends the run the way any alarm does: checkpoint, summary, `stopped_early` naming the alarm.
Arming it late keeps the run going long enough for the live checks without guessing how long a step takes.
"""

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from asyncrl.config import AlarmRule, load_config
from asyncrl.learner.checkpoint import STATE_FILE
from asyncrl.testing import SHORT_CONTEXT

pytestmark = pytest.mark.integration

LIVE_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(prom_port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """A Prometheus server on 127.0.0.1 scraping the run's metrics port every second; -> (its port, metrics port)."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: `make test` installs it (Makefile SYSTEM_PACKAGES / system-deps)"
    tmp = tmp_path_factory.mktemp("prometheus")
    prom_port, metrics_port = _free_port(), _free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: asyncrl, static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]}}]\n"
    )
    log = open(tmp / "prometheus.log", "w")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        _wait_ready(prom_port, process, tmp / "prometheus.log")
        yield prom_port, metrics_port
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _wait_ready(prom_port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"prometheus not ready after 60 s: {log.read_text()[-2000:]}")


def _config(tmp: Path, model_dir: Path, metrics_port: int):
    overrides = {
        "mode": "streaming",
        "output_dir": str(tmp / "run"),
        "model.path": str(model_dir),
        "model.warm_start_examples": 0,
        "rollout.samples_per_prompt": 4,
        "rollout.max_tokens": 6,
        "rollout.max_model_len": SHORT_CONTEXT,
        "buffer.max_staleness": 2,
        "buffer.filter_zero_variance": False,
        "algorithm.preset": "grpo",
        "learner.prompts_per_step": 2,
        "learner.max_steps": 400,  # the stop alarm ends the run; the wall-clock bound only guards a hang
        "learner.max_wall_s": LIVE_TIMEOUT_S + 120,
        "data.eval_prompts": 8,
        "eval.every_steps": 0,
        "checkpoint.every_steps": 0,
        "checkpoint.export_hf": False,
        "telemetry.progress": False,
        "telemetry.prometheus_port": metrics_port,
        "telemetry.pool_every_s": 0.5,
        "telemetry.rate_window_s": 5,
        "telemetry.alarms": {"ess_fraction_below": {"threshold": 1.01}},
        "learner.compile": False,
    }
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def _live_checks(prom_port: int) -> dict[str, list[dict]]:
    """The queries the live run must answer; -> {check: result} (an empty result = not yet)."""
    return {
        "staleness histogram": _query(prom_port, "asyncrl_buffer_staleness_versions_count > 0"),
        "mismatch per lag": _query(prom_port, "asyncrl_mismatch_k3_kl_by_lag"),
        "queue depth": _query(prom_port, "asyncrl_queue_ready_groups"),
        "in flight": _query(prom_port, "asyncrl_queue_in_flight_samples"),
        "live tokens/s": _query(prom_port, "asyncrl_rollout_tokens_per_second > 0"),
        "alarm": _query(prom_port, 'asyncrl_alarm{name="ess_fraction_below"} == 1'),
    }


@pytest.fixture(scope="module")
def live_run(ray_cluster, tiny_model_dir, prometheus, tmp_path_factory):
    """Start the run in a thread, poll Prometheus until every live check answers, then arm the stop alarm;
    -> (config, summary, live results, whether the run was still going when they answered)."""
    from asyncrl.controller.loop import Controller

    prom_port, metrics_port = prometheus
    cfg = _config(tmp_path_factory.mktemp("live"), tiny_model_dir, metrics_port)
    controller = Controller(cfg, tiny_model_dir)
    outcome: dict = {}
    try:
        controller.start()
        thread = threading.Thread(target=lambda: outcome.update(summary=controller.run()), daemon=True)
        thread.start()
        live, deadline = {}, time.monotonic() + LIVE_TIMEOUT_S
        while thread.is_alive() and time.monotonic() < deadline:
            live = _live_checks(prom_port)
            if all(live.values()):
                break
            time.sleep(1.0)
        still_running = thread.is_alive()
        controller.alarms.config["k3_above"] = AlarmRule(threshold=-1.0, stop=True)
        thread.join(timeout=LIVE_TIMEOUT_S)
        assert not thread.is_alive(), "the stop alarm did not end the run"
        time.sleep(2.0)  # a last scrape after the final snapshot
        outcome.update(final_lags=_query(prom_port, "last_over_time(asyncrl_mismatch_k3_kl_by_lag[30m])"))
        outcome.update(k3_alarm=_query(prom_port, 'last_over_time(asyncrl_alarm{name="k3_above"}[30m])'))
        return cfg, outcome, live, still_running
    finally:
        controller.shutdown()


def test_prometheus_answers_while_the_run_is_still_going(live_run):
    _, _, live, still_running = live_run
    missing = [name for name, result in live.items() if not result]
    assert not missing, f"no answer from Prometheus for {missing} while the run went on"
    assert still_running, "the run ended before Prometheus answered every live query"
    assert float(live["live tokens/s"][0]["value"][1]) > 0
    assert {r["metric"]["state"] for r in live["in flight"]} == {"generating", "ready", "waiting"}


def test_mismatch_has_a_series_per_staleness_bucket_of_the_run(live_run):
    _, outcome, live, _ = live_run
    summary = outcome["summary"]
    lags_trained = set(summary["staleness_histogram"])
    lags_exported = {r["metric"]["lag"] for r in outcome["final_lags"]}
    assert lags_trained and lags_trained <= lags_exported, (lags_trained, lags_exported)
    assert all(int(r["metric"]["lag"]) <= 2 for r in live["mismatch per lag"])


def test_an_alarm_with_stop_ends_the_run_cleanly_with_a_checkpoint(live_run):
    cfg, outcome, _, _ = live_run
    summary = outcome["summary"]
    assert summary["stopped_early"].startswith("alarm k3_above: mismatch k3 KL"), summary["stopped_early"]
    fired = [(a["name"], a["stop"]) for a in summary["alarms"]]
    assert fired[:2] == [("ess_fraction_below", False), ("k3_above", True)]
    assert float(outcome["k3_alarm"][0]["value"][1]) == 1
    steps = summary["steps"]
    assert 0 < steps < cfg.learner.max_steps
    assert (Path(cfg.output_dir) / "checkpoints" / f"step-{steps:06d}" / STATE_FILE).is_file()
