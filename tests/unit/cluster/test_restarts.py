"""The restart budget of a pool's slots: restarts counted per slot across replacements, a spent budget and a
crash loop both quarantine the slot, and other slots are not affected."""

from asyncrl.cluster.restarts import RestartBudget


def test_a_slot_is_restarted_until_its_budget_is_spent_across_its_replacements():
    budget = RestartBudget(max_restarts=2, quarantine_failures=10, quarantine_window_s=60)
    assert budget.failed("rollout-0", now=0.0) is None
    budget.replaced("rollout-0", "rollout-3")
    assert budget.slot("rollout-3") == "rollout-0"
    assert budget.failed("rollout-3", now=100.0) is None
    budget.replaced("rollout-3", "rollout-5")
    assert budget.slot("rollout-5") == "rollout-0"  # a replacement of a replacement keeps the first slot
    assert budget.failed("rollout-5", now=200.0) == "its restart budget is spent (2 restarts)"
    assert budget.summary() == {"restarts": {"rollout-0": 2}, "quarantined": {"rollout-0": "its restart budget is spent (2 restarts)"}}
    assert budget.failed("rollout-1", now=200.0) is None  # another slot has its own budget


def test_failures_close_together_quarantine_a_slot_and_old_ones_fall_out_of_the_window():
    budget = RestartBudget(max_restarts=100, quarantine_failures=3, quarantine_window_s=60)
    assert budget.failed("w", now=0.0) is None
    assert budget.failed("w", now=50.0) is None
    assert budget.failed("w", now=70.0) is None  # the failure at 0 s is out of the window: 2 within 60 s
    assert budget.failed("w", now=100.0) == "3 failures within 60s"
    assert budget.quarantined == {"w": "3 failures within 60s"} and budget.restarts["w"] == 3


def test_a_budget_of_zero_never_restarts():
    budget = RestartBudget(max_restarts=0, quarantine_failures=3, quarantine_window_s=60)
    assert budget.failed("tool-0") == "its restart budget is spent (0 restarts)"
