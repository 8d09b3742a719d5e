"""The dashboard's records, its HTTP API (data, scale) and the run folder it reads back (`asyncrl dash`)."""

import dataclasses
import json
import subprocess
import sys
import urllib.error
import urllib.request

from asyncrl.cluster.control import LocalControl
from asyncrl.telemetry.dashboard import Dashboard, serve_run_dir
from asyncrl.telemetry.record import EventLog, load_run, pool_point
from asyncrl.telemetry.sinks import AlarmEvent, LiveRates, PoolSnapshot, SyncEvent, Telemetry

ROW = {"step": 1, "version": 1, "reward": 0.5, "loss": float("nan"), "lag_counts": {"0": 3, "1": 1}, "wall_s": 2.0, "mismatch_k3_kl": 1e-4}
SNAPSHOT = PoolSnapshot(
    wall_s=4.0, version=1, counters={"trained": 4}, queue={"ready_groups": 2, "backlog_groups": 6},
    engines={"rollout-0": {"busy_s": 3.0, "idle_s": 1.0, "tokens_generated": 40, "version": 1}},
    tokens_trained=10, learner_wait_s=1.0, pool_sizes={"rollout": 1, "rollout_joining": 0},
)  # fmt: skip


def _server(dash):
    return dash.server if isinstance(dash, Dashboard) else dash


def _get(dash, path: str = "api/data") -> dict:
    """GET with the server's token (the page's own calls send it the same way)."""
    server = _server(dash)
    request = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {server.token}"})
    return json.loads(urllib.request.urlopen(request, timeout=10).read())


def _post(dash, body: dict, path: str = "api/scale") -> tuple[int, dict]:
    server = _server(dash)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {server.token}"}
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _untimed(reply: dict) -> list:
    """(kind, data) of each record, sorted, without the time stamp each sink takes itself."""
    return sorted((r["kind"], json.dumps({k: v for k, v in r["data"].items() if k != "time"}, sort_keys=True)) for r in reply["records"])


def _feed(telemetry):
    telemetry.phase("starting the learner")
    telemetry.step(ROW)
    telemetry.eval({"version": 1, "step": 1, "accuracy": 0.25, "samples_trained": 4})
    telemetry.sync(SyncEvent(version=1, seconds=0.5))
    telemetry.pool(SNAPSHOT)
    telemetry.alarm(AlarmEvent("ess_fraction", 0.2, 0.5, "ESS fraction 0.2 < 0.5"))


def test_pool_point_flattens_a_snapshot_into_rates_and_fractions_over_the_run():
    point = pool_point(SNAPSHOT)
    assert point["rollout_tokens_per_s"] == 10.0  # 40 tokens / 4 s
    assert point["learner_tokens_per_s"] == 2.5  # 10 / 4
    assert point["rollout_busy_fraction"] == 0.75  # 3 s busy of 4
    assert point["learner_idle_fraction"] == 0.25 and point["learner_busy_fraction"] == 0.75  # waited 1 s of 4
    assert point["queue/ready_groups"] == 2 and point["pool/rollout"] == 1 and point["engine_version/rollout-0"] == 1
    assert "learner_idle_window" not in point  # no live window measured


def test_pool_point_carries_the_window_the_autoscaler_reads_beside_the_whole_run():
    """A run that waited 1 s of 4 overall but 90% of the last window: the page shows both, not only the 25%."""
    live = LiveRates(window_s=2.0, generated_tokens_per_s=0.0, trained_tokens_per_s=0.0, rollout_idle_fraction=0.05,
                     learner_idle_fraction=0.9, stale_drop_fraction=0.0)  # fmt: skip
    point = pool_point(dataclasses.replace(SNAPSHOT, live=live))
    assert point["learner_idle_fraction"] == 0.25 and point["learner_idle_window"] == 0.9
    assert point["rollout_idle_window"] == 0.05


def test_data_endpoint_returns_the_records_after_since_with_nan_as_null():
    dash = Dashboard("run-a", port=0)
    _feed(Telemetry([dash]))
    everything = _get(dash)
    assert everything["title"] == "run-a" and everything["live"] is True and everything["seq"] == 6
    assert [r["kind"] for r in everything["records"]] == ["phase", "step", "eval", "sync", "pool", "alarm"]
    assert everything["records"][1]["data"]["loss"] is None  # NaN is not JSON a browser can parse
    newer = _get(dash, "api/data?since=4")
    assert [(r["seq"], r["kind"]) for r in newer["records"]] == [(5, "pool"), (6, "alarm")]
    assert _get(dash, "api/data?since=6")["records"] == []
    page = urllib.request.urlopen(dash.page_url, timeout=10).read().decode()
    assert "/static/uPlot.iife.min.js" in page and f'content="{dash.server.token}"' in page  # the page's own calls
    assert urllib.request.urlopen(dash.url + "static/uPlot.iife.min.js", timeout=10).read().startswith(b"/*! https://github.com/leeoniya/uPlot")
    dash.server.stop()


def test_scale_goes_to_the_controls_wanted_size_and_a_finished_run_refuses_it():
    dash = Dashboard("run-b", port=0)
    assert _post(dash, {"rollout": 2})[0] == 409  # no controller attached yet
    control = LocalControl()
    dash.scaler = control.set_size
    assert _post(dash, {"rollout": 3}) == (200, {"rollout": 3})
    assert control.poll().rollout == 3 and control.poll().learner is None
    assert _post(dash, {"learner": 2}) == (200, {"learner": 2})
    assert control.poll().rollout == 3 and control.poll().learner == 2
    assert _post(dash, {"rollout": 0})[0] == 400
    assert _post(dash, {"learner": 0})[0] == 400
    assert _post(dash, {"workers": 2})[0] == 400
    dash.close({"steps": 1})
    assert _get(dash)["live"] is False
    assert _post(dash, {"rollout": 2})[0] == 409
    assert control.poll().rollout == 3
    dash.server.stop()


def test_a_run_folder_reads_back_as_the_same_records(tmp_path):
    live = Dashboard("run", port=0)
    telemetry = Telemetry([EventLog(tmp_path), live])
    _feed(telemetry)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(ROW) + "\n" + '{"step": 2, "torn')  # died mid-line
    assert load_run(tmp_path).live is False
    server = serve_run_dir(tmp_path, port=0)
    loaded, shown = _get(server), _get(live)
    assert loaded["title"] == tmp_path.name and loaded["live"] is False
    assert _untimed(loaded) == _untimed(shown) and len(shown["records"]) == 6
    assert _post(server, {"rollout": 2})[0] == 409
    server.stop()
    live.server.stop()


def test_asyncrl_dash_serves_a_run_folder_and_names_a_folder_without_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(ROW) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "dash", str(tmp_path), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        page_url = line.split(": ", 1)[1].split()[0]
        url, token = page_url.split("?token=")
        data = json.loads(urllib.request.urlopen(f"{url}api/data?token={token}", timeout=10).read())
        assert [r["data"]["reward"] for r in data["records"]] == [0.5]
    finally:
        proc.terminate()
        proc.wait(10)
    empty = subprocess.run([sys.executable, "-m", "asyncrl.cli", "dash", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert empty.returncode == 2 and "has no metrics.jsonl" in empty.stderr


def test_a_taken_port_falls_back_to_a_free_one():
    first = Dashboard("a", port=0)
    port = int(first.url.rsplit(":", 1)[1].strip("/"))
    second = Dashboard("b", port=port)
    assert second.url != first.url and _get(second)["title"] == "b"
    first.server.stop()
    second.server.stop()


def _raw(server, method: str, path: str, headers: dict, body: bytes | None = None) -> tuple[int, dict]:
    """One request with exactly these headers (urllib adds Host and Content-Length only when not given)."""
    request = urllib.request.Request(server.url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_scale_refuses_cross_site_forged_host_tokenless_and_non_json_calls():
    dash = Dashboard("run-c", port=0)
    control = LocalControl()
    dash.scaler = control.set_size
    server, body = dash.server, json.dumps({"rollout": 4}).encode()
    auth = {"Authorization": f"Bearer {server.token}"}
    own = {**auth, "Content-Type": "application/json", "Origin": server.url.rstrip("/")}
    cases = {
        "text/plain from another site": ({"Content-Type": "text/plain", "Origin": "http://evil.example"}, 403),
        "foreign Origin with the token": ({**own, "Origin": "http://evil.example"}, 403),
        "forged Host (DNS rebinding)": ({**own, "Host": "evil.example:8470", "Origin": "http://evil.example:8470"}, 403),
        "no token": ({"Content-Type": "application/json"}, 401),
        "wrong token": ({**own, "Authorization": "Bearer " + "x" * 32}, 401),
        "text/plain with the token": ({**auth, "Content-Type": "text/plain"}, 415),
    }
    for name, (headers, status) in cases.items():
        got, reply = _raw(server, "POST", "api/scale", headers, body)
        assert (got, control.poll().rollout) == (status, None), f"{name}: {got} {reply}"
        assert reply["error"], name
    assert _raw(server, "GET", "api/data", {})[0] == 401  # reading the run asks for the token too
    assert _raw(server, "GET", "", {"Host": "evil.example"})[0] == 403
    assert _raw(server, "POST", "api/scale", own, body) == (200, {"rollout": 4})  # the page's own call
    assert _raw(server, "POST", "api/scale", {**own, "Host": f"localhost:{server.url.rsplit(':', 1)[1]}".rstrip("/"),
                                             "Origin": f"http://localhost:{server.url.rsplit(':', 1)[1]}".rstrip("/")}, body)[0] == 200  # fmt: skip
    dash.server.stop()


def test_a_dashboard_beyond_loopback_needs_a_token_and_asyncrl_check_names_the_key(monkeypatch):
    import pytest

    from asyncrl.config import load_config

    monkeypatch.delenv("ASYNCRL_DASHBOARD_TOKEN", raising=False)
    with pytest.raises(ValueError, match="telemetry.dashboard_token"):
        Dashboard("exposed", host="0.0.0.0", port=0)
    with pytest.raises(ValueError, match=r"telemetry.bind_host=0.0.0.0 .* set telemetry.dashboard_token"):
        load_config(None, ["telemetry.bind_host=0.0.0.0"])
    assert load_config(None, ["telemetry.bind_host=0.0.0.0", "telemetry.dashboard_port=0"]).telemetry.bind_host
    monkeypatch.setenv("ASYNCRL_DASHBOARD_TOKEN", "s3cret-from-env")
    cfg = load_config(None, ["telemetry.bind_host=0.0.0.0"])
    assert cfg.telemetry.resolved_dashboard_token() == "s3cret-from-env" and "s3cret" not in json.dumps(cfg.dump())  # env, not the config


def test_the_token_is_printed_once_with_the_address_and_written_nowhere(tmp_path, capsys):
    from asyncrl.config import load_config
    from asyncrl.controller.records import build_telemetry

    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", "telemetry.dashboard_port=0", "telemetry.progress=false"])
    cfg.telemetry.dashboard_port = 65531  # loaded off, then on (a taken port falls back to a free one)
    telemetry = build_telemetry(cfg)
    (dash,) = [s for s in telemetry.sinks if isinstance(s, Dashboard)]
    printed = capsys.readouterr().out
    assert printed.count(dash.server.token) == 1 and f"dashboard: {dash.page_url}" in printed
    telemetry.close({"steps": 0})
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert f"dashboard: {dash.url} (token on the console)" in events and dash.server.token not in events
    assert dash.server.token not in json.dumps(_get(dash))  # nor in the page's notes
    dash.server.stop()
