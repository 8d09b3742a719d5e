"""Live rates over a window of snapshots, and the staleness split of a trained batch."""

import numpy as np
import pytest

from asyncrl.telemetry.figures import batch_figures
from asyncrl.telemetry.rates import RateWindow
from asyncrl.telemetry.record import pool_point
from asyncrl.telemetry.sinks import PoolSnapshot
from asyncrl.testing import make_trajectory
from asyncrl.types import Batch, Group


def _snapshot(wall_s, generated, trained=0, busy=0.0, idle=0.0, wait=0.0, counters=None):
    engines = {"e": {"tokens_generated": generated, "busy_s": busy, "idle_s": idle}}
    return PoolSnapshot(wall_s=wall_s, version=0, counters=counters or {}, queue={}, engines=engines, tokens_trained=trained, learner_wait_s=wait)


def test_first_snapshot_measures_from_the_start_of_the_run():
    live = RateWindow(30.0).add(_snapshot(5.0, generated=500, trained=100, busy=4.0, idle=1.0, wait=1.0))
    assert (live.window_s, live.generated_tokens_per_s, live.trained_tokens_per_s) == (5.0, 100.0, 20.0)
    assert live.rollout_idle_fraction == pytest.approx(0.2)
    assert live.learner_idle_fraction == pytest.approx(0.2)


def test_window_slides_and_keeps_one_snapshot_before_it():
    window = RateWindow(10.0)
    for t, generated in [(5, 100), (10, 200), (15, 1200), (20, 2200)]:
        live = window.add(_snapshot(float(t), generated))
    # Oldest kept: t=10 (the last one at least 10 s before t=20): (2200 - 200) / 10 s.
    assert live.window_s == 10.0
    assert live.generated_tokens_per_s == 200.0


def test_stale_drop_fraction_counts_samples_finished_in_the_window():
    window = RateWindow(60.0)
    window.add(_snapshot(1.0, 0, counters={"trained": 10, "dropped_stale": 0}))
    live = window.add(_snapshot(2.0, 0, counters={"trained": 16, "dropped_stale": 2, "filtered:zero_variance": 2, "dispatched": 99, "in_flight": 5}))
    assert live.stale_drop_fraction == pytest.approx(2 / 20)  # 2 dropped of 20 finished since t=0


def test_a_replaced_engine_never_gives_a_negative_rate():
    window = RateWindow(1.0)  # the window starts at t=1, when the engine that died had counted 1000 tokens
    window.add(_snapshot(1.0, 1000))
    assert window.add(_snapshot(2.0, 10)).generated_tokens_per_s == 0.0


def test_a_dead_engines_last_counters_keep_the_rates_whole():
    window = RateWindow(10.0)
    window.add(_snapshot(10.0, 1000, busy=8.0, idle=2.0))
    # "e" died after reporting 1200 tokens and 9 s busy; "e2" generated 300 tokens in 4 s busy, 1 s idle since.
    retired = {"e": {"tokens_generated": 1200, "busy_s": 9.0, "idle_s": 2.0}}
    replacement = {"e2": {"tokens_generated": 300, "busy_s": 4.0, "idle_s": 1.0}}
    now = PoolSnapshot(wall_s=20.0, version=0, counters={}, queue={}, engines=replacement, retired=retired)
    assert now.engine_total("tokens_generated") == 1500
    live = window.add(now)
    assert live.generated_tokens_per_s == pytest.approx((1500 - 1000) / 10)
    assert live.rollout_idle_fraction == pytest.approx(1 / 6)  # 1 s idle of (9 - 8) + 4 busy and 1 idle
    assert pool_point(now)["rollout_tokens_per_s"] == pytest.approx(1500 / 20)  # the run's mean, dead engine included


def test_batch_figures_split_lag_into_generating_and_queued():
    # Consumed at version 5: one sample generated over versions 2..3 (lag 3 = 1 generating + 2 queued),
    # one generated at version 5 (lag 0).
    a = make_trajectory(2, versions=[2, 3], rollout_logprobs=[-0.5, -1.5])
    b = make_trajectory(4, versions=5, rollout_logprobs=-1.0, loss_mask=[1, 1, 0, 0])
    batch = Batch([Group("g0", [a, b])], version=5)
    figures = batch_figures(batch)
    assert batch.lags == [3, 0]
    assert figures["lag_generating_counts"] == {"0": 1, "1": 1}
    assert figures["lag_queued_counts"] == {"0": 1, "2": 1}
    assert figures["response_length_mean"] == 3.0
    assert figures["entropy_mc_nats"] == pytest.approx((0.5 + 1.5 + 1.0 + 1.0) / 4)  # masked tokens do not count
    assert np.isfinite(figures["entropy_mc_nats"])
