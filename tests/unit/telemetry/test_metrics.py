import re

from asyncrl.telemetry.metrics import RunMetrics
from asyncrl.telemetry.sinks import PoolSnapshot, SyncEvent, lag_counts


def _value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert match, f"{sample} not exported"
    return float(match.group(1))


def test_step_sync_eval_and_totals_are_exported_with_their_values():
    m = RunMetrics(port=0, correction="dis")
    m.step({"reward": 0.25, "mismatch_k3_kl": 0.002, "correction_masked_fraction": 0.1, "lag_counts": lag_counts([0, 1, 1, 3])})
    m.sync(SyncEvent(version=7, seconds=0.3, parity=2e-7))
    m.eval({"accuracy": 0.42})
    m.pool(PoolSnapshot(wall_s=2.0, version=7, counters={"dispatched": 10, "trained": 6, "filtered:zero_variance": 3, "in_flight": 1, "put": 99},
                        queue={}, engines={"rollout-0": {"tokens_generated": 1000, "busy_s": 3.0, "idle_s": 1.0}}, tokens_trained=400, learner_wait_s=0.5))
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


def test_lag_counts_is_a_sorted_histogram_with_string_keys():
    assert lag_counts([2, 0, 10, 2]) == {"0": 1, "2": 2, "10": 1}
    assert list(lag_counts([10, 2, 0])) == ["0", "2", "10"]  # numeric, not lexical, order
