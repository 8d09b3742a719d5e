import dataclasses
import re
import socket
import urllib.request

from asyncrl.telemetry.metrics import METRICS, RunMetrics, markdown
from asyncrl.telemetry.rates import RateWindow
from asyncrl.telemetry.sinks import AlarmEvent, PoolSnapshot, SyncEvent, lag_counts


def _value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert match, f"{sample} not exported"
    return float(match.group(1))


def test_step_sync_eval_and_totals_are_exported_with_their_values():
    m = RunMetrics(port=0, correction="dis")
    m.step({"reward": 0.25, "mismatch_k3_kl": 0.002, "correction_masked_fraction": 0.1, "lag_counts": lag_counts([0, 1, 1, 3])})
    m.sync(SyncEvent(version=7, seconds=0.3, parity=2e-7))
    m.eval({"accuracy": 0.42, "version": 7})
    snapshot = PoolSnapshot(wall_s=2.0, version=7, counters={"dispatched": 10, "trained": 6, "filtered:zero_variance": 3, "in_flight": 1, "put": 99},
                            queue={}, engines={"rollout-0": {"tokens_generated": 1000, "busy_s": 3.0, "idle_s": 1.0}}, tokens_trained=400, learner_wait_s=0.5)
    m.pool(_live(snapshot))
    text = m.exposition().decode()
    assert _value(text, "asyncrl_learner_step_total") == 1
    assert _value(text, "asyncrl_policy_version") == 7
    assert _value(text, "asyncrl_eval_accuracy") == 0.42
    assert _value(text, 'asyncrl_buffer_staleness_versions_bucket{le="1.0"}') == 3  # lags 0, 1, 1
    assert _value(text, "asyncrl_buffer_staleness_versions_count") == 4
    assert _value(text, 'asyncrl_correction_masked_fraction{method="dis"}') == 0.1
    assert _value(text, 'asyncrl_buffer_samples_total{state="filtered:zero_variance"}') == 3
    assert "put" not in re.findall(r'state="([^"]+)"', text)  # only terminal states and totals
    assert _value(text, "asyncrl_learner_tokens_per_second") == 200  # 400 tokens / 2 s
    assert _value(text, "asyncrl_learner_idle_fraction") == 0.25
    assert _value(text, "asyncrl_rollout_idle_fraction") == 0.25  # 1 s idle of 4 s


def _live(snapshot: PoolSnapshot, window: RateWindow | None = None) -> PoolSnapshot:
    """The snapshot as the controller sends it: with its live rates (here since the run's start)."""
    return dataclasses.replace(snapshot, live=(window or RateWindow(30.0)).add(snapshot))


def _snapshot(wall_s: float, engines: dict, counters: dict | None = None, queue: dict | None = None, **fields) -> PoolSnapshot:
    return PoolSnapshot(wall_s=wall_s, version=3, counters=counters or {}, queue=queue or {}, engines=engines, **fields)


def test_counters_grow_by_what_the_cumulative_totals_grew_and_survive_a_replaced_engine():
    m = RunMetrics()
    m.pool(_snapshot(1.0, {"rollout-0": {"tokens_generated": 100, "stale_aborts": 1, "requests_done": 16, "vllm_requests": 2}},
                     {"dropped_stale": 2, "groups_dropped_stale": 1}, tokens_trained=50))
    m.pool(_snapshot(2.0, {"rollout-0": {"tokens_generated": 250, "stale_aborts": 1, "requests_done": 40, "vllm_requests": 5}},
                     {"dropped_stale": 6, "groups_dropped_stale": 3}, tokens_trained=80))
    # rollout-0 died; its replacement counts from 0 again, rollout-1 is new.
    m.pool(_snapshot(3.0, {"rollout-2": {"tokens_generated": 30, "requests_done": 8, "vllm_requests": 8},
                           "rollout-1": {"tokens_generated": 20, "stale_aborts": 2}}, tokens_trained=80))
    text = m.exposition().decode()
    assert _value(text, "asyncrl_rollout_generated_tokens_total") == 250 + 30 + 20
    assert _value(text, "asyncrl_rollout_samples_total") == 40 + 8
    assert _value(text, "asyncrl_rollout_vllm_requests_total") == 5 + 8
    assert _value(text, "asyncrl_learner_trained_tokens_total") == 80
    assert _value(text, 'asyncrl_buffer_samples_total{state="dropped_stale"}') == 6
    assert _value(text, "asyncrl_staleness_dropped_groups_total") == 3
    assert _value(text, "asyncrl_staleness_aborted_requests_total") == 3
    assert _value(text, 'asyncrl_engine_policy_version{engine="rollout-1"}') == 0
    assert 'engine="rollout-0"' not in text  # the dead engine's version gauge left with it


def test_live_rates_keep_a_dead_engines_tokens():
    m, window = RunMetrics(), RateWindow(10.0)
    m.pool(_live(_snapshot(10.0, {"rollout-0": {"tokens_generated": 1000}}), window))
    # rollout-0 died at 1400 tokens (its last report); its replacement generated 100 since.
    m.pool(_live(_snapshot(20.0, {"rollout-1": {"tokens_generated": 100}}, retired={"rollout-0": {"tokens_generated": 1400}}), window))
    text = m.exposition().decode()
    assert _value(text, "asyncrl_rollout_tokens_per_second") == 50  # (1400 + 100 - 1000) / 10 s, not 0
    assert _value(text, "asyncrl_rollout_generated_tokens_total") == 1000 + 100  # the counter saw rollout-0 at 1000


def test_live_rates_use_the_recent_window_not_the_whole_run():
    m, window = RunMetrics(), RateWindow(10.0)
    m.pool(_live(_snapshot(10.0, {"e": {"tokens_generated": 1000, "busy_s": 10.0, "idle_s": 0.0}}), window))
    m.pool(_live(_snapshot(20.0, {"e": {"tokens_generated": 1500, "busy_s": 12.0, "idle_s": 8.0}}, learner_wait_s=5.0), window))
    text = m.exposition().decode()
    assert _value(text, "asyncrl_rollout_tokens_per_second") == 50  # (1500 - 1000) tokens / 10 s, not 1500 / 20
    assert _value(text, "asyncrl_rollout_idle_fraction") == 0.8  # 8 s idle of the window's 10 engine-seconds
    assert _value(text, "asyncrl_learner_idle_fraction") == 0.5  # 5 s waited of 10


def test_queue_levels_in_flight_states_and_admission():
    m = RunMetrics()
    queue = {"ready_groups": 2, "ready_samples": 8, "backlog_groups": 5, "admission_limit_groups": 12, "groups_ahead": 12, "ready_hold": 1.0}
    engines = {"a": {"requests_in_flight": 3, "version": 4}, "b": {"requests_in_flight": 1, "version": 5}}
    m.pool(_snapshot(1.0, engines, {"in_flight": 20}, queue, pool_sizes={"rollout": 2, "learner": 1}))
    text = m.exposition().decode()
    assert _value(text, "asyncrl_queue_ready_groups") == 2
    assert _value(text, "asyncrl_queue_backlog_groups") == 5
    assert _value(text, 'asyncrl_queue_in_flight_samples{state="generating"}') == 4
    assert _value(text, 'asyncrl_queue_in_flight_samples{state="ready"}') == 8
    assert _value(text, 'asyncrl_queue_in_flight_samples{state="waiting"}') == 20 - 4 - 8
    assert _value(text, "asyncrl_staleness_admission_headroom_groups") == 0
    assert _value(text, "asyncrl_staleness_admission_blocked") == 1
    assert _value(text, "asyncrl_staleness_ready_hold") == 1
    assert _value(text, 'asyncrl_engine_policy_version{engine="b"}') == 5
    assert _value(text, 'asyncrl_pool_workers{pool="rollout"}') == 2


def test_step_row_sets_mismatch_per_lag_staleness_split_and_step_phases():
    m = RunMetrics(correction="tis")
    m.step({
        "reward": 0.5, "loss": -0.1, "grad_norm": 2.0, "entropy_mc_nats": 0.7, "response_length_mean": 12.5,
        "mismatch_k3_kl": 0.01, "mismatch_k3_kl/lag=0": 0.001, "mismatch_k3_kl/lag=2": 0.03,
        "mismatch_kappa_is_weight_p99/lag=2": 1.8, "mismatch_kappa_clipped_fraction/lag=2": 0.25, "mismatch_kappa_ess": 0.9,
        "lag_counts": {"0": 1, "2": 3}, "lag_generating_counts": {"0": 2, "1": 2}, "lag_queued_counts": {"0": 1, "1": 3},
        "learner_wait_s": 0.2, "time_forward_backward_s": 1.5, "time_optimizer_s": 0.1, "sync_s": 0.4,
    })
    text = m.exposition().decode()
    assert _value(text, "asyncrl_mismatch_k3_kl") == 0.01
    assert _value(text, 'asyncrl_mismatch_k3_kl_by_lag{lag="0"}') == 0.001
    assert _value(text, 'asyncrl_mismatch_k3_kl_by_lag{lag="2"}') == 0.03
    assert _value(text, 'asyncrl_mismatch_is_weight_by_lag{lag="2",quantile="p99"}') == 1.8
    assert _value(text, 'asyncrl_correction_clipped_fraction_by_lag{lag="2",method="tis"}') == 0.25
    assert _value(text, "asyncrl_mismatch_ess_fraction") == 0.9
    assert _value(text, 'asyncrl_staleness_generating_versions_bucket{le="0.0"}') == 2
    assert _value(text, 'asyncrl_staleness_queued_versions_bucket{le="0.0"}') == 1
    assert _value(text, "asyncrl_staleness_queued_versions_sum") == 3
    assert _value(text, 'asyncrl_learner_step_seconds_sum{phase="forward_backward"}') == 1.5
    assert _value(text, 'asyncrl_learner_step_seconds_count{phase="sync"}') == 1
    assert _value(text, "asyncrl_learner_loss") == -0.1
    assert _value(text, "asyncrl_rollout_response_length_tokens") == 12.5


def test_sync_bytes_accumulate_and_alarms_set_and_clear_their_gauge():
    m = RunMetrics()
    m.sync(SyncEvent(version=1, seconds=0.1, bytes=1000))
    m.sync(SyncEvent(version=2, seconds=0.1, bytes=1000))
    m.alarm(AlarmEvent("k3_above", 0.5, 0.1, "k3 high"))
    m.alarm(AlarmEvent("ess_fraction_below", 0.5, 0.6, "ess low"))
    m.alarm(AlarmEvent("ess_fraction_below", 0.7, 0.6, "cleared", active=False))
    text = m.exposition().decode()
    assert _value(text, "asyncrl_weight_sync_bytes_total") == 2000
    assert _value(text, 'asyncrl_alarm{name="k3_above"}') == 1
    assert _value(text, 'asyncrl_alarm{name="ess_fraction_below"}') == 0


def test_the_endpoint_binds_the_configured_host_and_serves_the_registry():
    port = _free_port()
    m = RunMetrics(port=port)
    m.step({"reward": 0.5})
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert _value(text, "asyncrl_rollout_reward_mean") == 0.5
    assert not _reachable(_other_address(), port)  # 127.0.0.1 only: another interface's address refuses


def test_metric_table_lists_every_metric_with_its_type():
    table = markdown()
    for spec in METRICS:
        assert f"| `{spec.name}` | {spec.kind} |" in table


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _other_address() -> str | None:
    """An address of this machine that is not loopback (None when it has none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def _reachable(address: str | None, port: int) -> bool:
    if address is None:
        return False
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((address, port)) == 0


def test_lag_counts_is_a_sorted_histogram_with_string_keys():
    assert lag_counts([2, 0, 10, 2]) == {"0": 1, "2": 2, "10": 1}
    assert list(lag_counts([10, 2, 0])) == ["0", "2", "10"]  # numeric, not lexical, order


def test_docs_metrics_lists_the_generated_metric_table():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "metrics.md").read_text()
    assert markdown() in page, "regenerate the metric table of docs/metrics.md: python -m asyncrl.telemetry.metrics"
