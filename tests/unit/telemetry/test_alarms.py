"""Alarms fire once per crossing with the figure and the threshold, clear when the figure returns, and stop the
run only when their rule says so. The figures are chosen so every crossing can be checked by eye."""

import pytest

from asyncrl.config import AlarmRule
from asyncrl.telemetry.alarms import Alarms
from asyncrl.telemetry.sinks import LiveRates, PoolSnapshot, SyncEvent
from tests.sinks import RecordingSink


def _alarms(**rules) -> tuple[Alarms, RecordingSink, list[str]]:
    report, stops = RecordingSink(), []
    return Alarms({name: AlarmRule(**rule) for name, rule in rules.items()}, report, stops.append), report, stops


def _snapshot(stale_drop_fraction: float = 0.0, learner_idle_fraction: float = 0.0, window_s: float = 30.0) -> PoolSnapshot:
    live = LiveRates(window_s, 0.0, 0.0, 0.0, learner_idle_fraction, stale_drop_fraction)
    return PoolSnapshot(wall_s=60.0, version=1, counters={}, queue={}, engines={}, live=live)


def test_k3_above_fires_once_with_figure_and_threshold_then_clears():
    alarms, report, stops = _alarms(k3_above={"threshold": 0.01})
    alarms.step({"step": 1, "mismatch_k3_kl": 0.005})
    assert report.alarms == []
    alarms.step({"step": 2, "mismatch_k3_kl": 0.02})
    alarms.step({"step": 3, "mismatch_k3_kl": 0.03})  # still beyond: no second event
    (fired,) = report.alarms
    assert (fired.name, fired.value, fired.threshold, fired.active, fired.stop) == ("k3_above", 0.02, 0.01, True, False)
    assert report.notes == ["ALARM k3_above: mismatch k3 KL 0.02 (step 2) is above the threshold 0.01"]
    alarms.step({"step": 4, "mismatch_k3_kl": 0.01})  # equal to the threshold is within it
    assert [e.active for e in report.alarms] == [True, False]
    assert "cleared" in report.notes[-1]
    assert stops == [] and alarms.active == {}


def test_ess_below_is_a_lower_bound():
    alarms, report, _ = _alarms(ess_fraction_below={"threshold": 0.5})
    alarms.step({"step": 1, "mismatch_kappa_ess": 0.6})
    alarms.step({"step": 2, "mismatch_kappa_ess": 0.4})
    assert [(e.name, e.value) for e in report.alarms] == [("ess_fraction_below", 0.4)]
    assert "0.4 (step 2) is below the threshold 0.5" in report.notes[0]


def test_stop_true_asks_the_controller_to_stop_naming_the_alarm():
    alarms, report, stops = _alarms(parity_above={"threshold": 1e-3, "stop": True})
    alarms.sync(SyncEvent(version=3, seconds=0.1, parity=None))  # an unprobed sync has no figure
    alarms.sync(SyncEvent(version=4, seconds=0.1, parity=0.002))
    assert stops == ["alarm parity_above: weight-sync parity max |engine - learner| log-prob 0.002 above 0.001"]
    assert report.alarms[0].stop


def test_snapshot_alarms_wait_for_a_window_that_starts_after_the_first_step():
    alarms, report, _ = _alarms(learner_idle_above={"threshold": 0.5})
    alarms.pool(_snapshot(learner_idle_fraction=1.0))  # no step yet: the learner waits for start-up
    alarms.step({"step": 1, "wall_s": 40.0})
    alarms.pool(_snapshot(learner_idle_fraction=1.0))  # at 60 s the window [30, 60] s still holds start-up
    assert report.alarms == []


def test_snapshot_alarms_read_the_live_window():
    alarms, report, _ = _alarms(stale_drops_above={"threshold": 0.1}, learner_idle_above={"threshold": 0.5})
    alarms.step({"step": 1, "wall_s": 30.0})
    alarms.pool(_snapshot(stale_drop_fraction=0.25, learner_idle_fraction=0.5))  # window [30, 60] s
    assert [(e.name, e.value) for e in report.alarms] == [("stale_drops_above", 0.25)]  # idle 0.5 is not above 0.5
    assert "(the last 30 s)" in report.notes[0]
    alarms.pool(_snapshot(window_s=0.0, learner_idle_fraction=1.0))  # no window measured yet: nothing to judge
    assert len(report.alarms) == 1


def test_rules_are_off_by_default():
    alarms, report, _ = _alarms()
    alarms.step({"step": 1, "wall_s": 0.0, "mismatch_k3_kl": 99.0, "mismatch_kappa_ess": 0.0})
    alarms.pool(_snapshot(stale_drop_fraction=1.0, learner_idle_fraction=1.0))
    assert report.alarms == []


def test_config_overrides_reach_the_rules():
    from asyncrl.config import load_config

    cfg = load_config(None, ["telemetry.alarms.k3_above.threshold=0", "telemetry.alarms.k3_above.stop=true"])
    assert cfg.telemetry.alarms == {"k3_above": AlarmRule(threshold=0, stop=True)}
    assert cfg.telemetry.bind_host == "127.0.0.1"
    with pytest.raises(Exception, match="threshhold"):
        load_config(None, ["telemetry.alarms.k3_above.threshhold=0"])
    with pytest.raises(Exception, match="k3_abov"):
        load_config(None, ["telemetry.alarms.k3_abov.threshold=0"])


def test_fired_lists_every_crossing_of_the_run_once_the_controllers_starved_included():
    from asyncrl.telemetry.sinks import AlarmEvent, Telemetry

    report = RecordingSink()
    telemetry = Telemetry([report])
    alarms = Alarms({"k3_above": AlarmRule(threshold=0.01)}, telemetry, [].append)
    telemetry.sinks.append(alarms)  # as the controller wires it: its own events come back through the fan-out
    alarms.step({"step": 1, "mismatch_k3_kl": 0.02})
    starved = AlarmEvent("starved", 64, 8, "learner starved: 64 groups in a row filtered")
    telemetry.alarm(starved)
    telemetry.alarm(AlarmEvent("starved", 64, 8, "no longer starved", active=False))
    assert [(e.name, e.value) for e in alarms.fired] == [("k3_above", 0.02), ("starved", 64)]
    assert [e.name for e in report.alarms] == ["k3_above", "starved", "starved"]
