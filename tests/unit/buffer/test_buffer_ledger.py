"""The replay queue's books on their own: conservation, staleness figures, checkpoint parts."""

import pytest

from asyncrl.buffer.ledger import ConservationError, Ledger


def ledger_with(dispatched: int, fates: list[str], trained_lags: list[int]) -> Ledger:
    ledger = Ledger()
    ledger.dispatch(dispatched)
    for fate in fates:
        ledger.finish(fate)
    ledger.record_trained(trained_lags, latencies_s=[0.5] * len(trained_lags), response_lengths=[4] * len(trained_lags))
    return ledger


def test_conservation_holds_with_every_kind_of_terminal_state_and_some_in_flight():
    ledger = ledger_with(6, ["trained", "trained", "dropped_stale", "filtered:overlong", "failed:timeout"], [0, 2])
    c = ledger.check(members_in_flight=1)
    assert (c["dispatched"], c["in_flight"], c["trained"], c["requeued"]) == (6, 1, 2, 0)  # 6 = 2 + 1 + 1 + 1 + 1


def test_a_missing_sample_or_a_member_count_mismatch_raises():
    ledger = ledger_with(3, ["trained"], [0])
    ledger.counts["dispatched"] += 1
    with pytest.raises(ConservationError, match=r"dispatched 4 != trained 1 .* in_flight 2 \(= 3\)"):
        ledger.check(members_in_flight=2)
    ledger.counts["dispatched"] -= 1
    with pytest.raises(ConservationError, match="in_flight counter 2 != 1 members"):
        ledger.check(members_in_flight=1)


def test_staleness_figures_of_trained_samples():
    ledger = ledger_with(4, ["trained"] * 4, [0, 1, 1, 3])
    assert ledger.staleness_histogram() == {0: 1, 1: 2, 3: 1}
    s = ledger.staleness_stats()
    assert (s["staleness_mean"], s["staleness_max"], s["staleness_hist:1"]) == (1.25, 3, 2)  # (0 + 1 + 1 + 3) / 4
    assert Ledger().staleness_stats() == {"staleness_mean": 0.0, "staleness_max": 0}


def test_state_dict_leaves_in_flight_work_out_and_restores_with_nothing_in_flight():
    ledger = ledger_with(8, ["trained"] * 2, [1, 1])
    ledger.count("groups_started", 4)
    state = ledger.state_dict(redispatched_groups=3)
    assert state["counters"] == {"dispatched": 2, "trained": 2, "groups_started": 1}  # 6 samples of 3 groups go back
    restored = Ledger()
    restored.load_state_dict({"counters": state["counters"], "staleness": {"1": 2}})  # JSON turns keys into strings
    assert restored.check(members_in_flight=0)["dispatched"] == 2
    assert restored.staleness_histogram() == {1: 2}
