"""End to end: each mode runs a short W1 `add` job from the same warm start on real Ray + vLLM + FSDP2.

What is asserted is what the system guarantees: every mode trains and publishes each step, sync is
on-policy, streaming stays within its staleness bound, samples are conserved, engines match the learner
after every sync, and the policy does not collapse (a too-large step size did exactly that in
development: 0.50 -> 0.06 held-out accuracy in 5 SAO steps at lr 2e-4). A held-out accuracy *gain* is
not asserted yet: on this workload the gain is still within noise (see the README results section).
"""

import pytest

from asyncrl.config import REPO_CONFIGS, load_config

pytestmark = pytest.mark.e2e

STEPS = {"streaming": 8, "sao": 8, "sync": 4}
FILES = {"streaming": "default.yaml", "sao": "sao.yaml", "sync": "sync.yaml"}


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    from asyncrl.controller.run import run

    out = tmp_path_factory.mktemp("e2e")
    overrides = ["eval.every_steps=0", "telemetry.progress=false", "checkpoint.export_hf=false"]
    return {
        mode: run(load_config(REPO_CONFIGS / FILES[mode], [f"output_dir={out / mode}", f"learner.max_steps={STEPS[mode]}", *overrides]))
        for mode in STEPS
    }


def test_every_mode_trains_and_publishes_each_step_from_the_same_warm_start(runs):
    assert {m: s["final_version"] for m, s in runs.items()} == STEPS
    starts = {s["start_accuracy"] for s in runs.values()}
    assert len(starts) == 1 and 0.0 < starts.pop() < 0.9  # low but non-zero warm start, shared


def test_no_mode_collapses_the_policy(runs):
    for mode, s in runs.items():
        assert s["final_accuracy"] >= s["start_accuracy"] - 0.15, (mode, s["evals"])


def test_sync_is_on_policy_and_streaming_stays_within_its_bound(runs):
    assert set(runs["sync"]["staleness_histogram"]) == {"0"}
    assert max(int(k) for k in runs["streaming"]["staleness_histogram"]) <= 4
    assert max(int(k) for k in runs["sao"]["staleness_histogram"]) <= 4


def test_engines_match_the_learner_after_every_sync(runs):
    for mode, s in runs.items():
        assert s["parity_max_abs_diff_mean"] < 1e-5, mode


def test_every_mode_conserves_samples(runs):
    for mode, s in runs.items():
        c = s["counters"]
        terminal = c["trained"] + c.get("dropped_stale", 0) + sum(v for k, v in c.items() if k.startswith(("filtered:", "failed:")))
        assert c["dispatched"] == terminal + c["in_flight"], mode
        assert s["samples_trained"] == c["trained"], mode
