"""Helpers of the W1 benchmark scripts (benchmarks/ is not a package: scripts import each other by path)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

import agent_recipes  # noqa: E402
from learning_add import accuracy_at, run_figures, runs  # noqa: E402
from plain_grpo import group_advantages  # noqa: E402
from profile_run import thread_cores, thread_times  # noqa: E402


def test_group_advantages_normalise_within_each_group():
    # Group 1: mean 0.25, sample std 0.5 -> (1 - 0.25) / 0.5 = 1.5 and (0 - 0.25) / 0.5 = -0.5.
    # Group 2: all equal -> no signal.
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group=4)
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]), atol=1e-5)


def test_group_advantages_without_std_only_centre():
    # Dr. GRPO: group mean 0.25 -> 0.75 and -0.25; the all-equal group still gets 0.
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group=4, std_normalise=False)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))


EVALS = [
    {"samples_trained": 0, "wall_s": 0.0, "accuracy": 0.3},
    {"samples_trained": 2560, "wall_s": 8.0, "accuracy": 0.52},
    {"samples_trained": 5120, "wall_s": 16.0, "accuracy": 0.71},
]


def test_run_figures_give_milestone_times_and_seconds_per_256_samples():
    figures = run_figures(EVALS, "wall_s")
    assert figures == {"time_to_0.5_s": 8.0, "time_to_0.7_s": 16.0, "s_per_256_samples": 0.8}  # 16 s / 20 steps


def test_accuracy_at_takes_the_last_evaluation_not_past_the_sample_count():
    assert [accuracy_at(EVALS, n) for n in (0, 2559, 2560, 10_000)] == [0.3, 0.3, 0.52, 0.71]


def test_mini_batch_runs_take_their_own_overrides_and_only_the_chosen_modes():
    planned = runs(4, ("streaming",), ["learner.lr=2.5e-5"])
    assert planned == [
        ("streaming", "default.yaml", []),
        ("streaming_mb4", "default.yaml", ["learner.mini_batches=4", "learner.lr=2.5e-5"]),
    ]
    assert [name for name, _, _ in runs(1)] == ["sync", "streaming", "sao"]


def test_limit_model_follows_its_formulas():
    from limits import EngineFigures, limit_model, w2_fractions

    # 2 batches of 100 + 300 tokens. Engine: best all-at-once run 1 s -> E = 400 tokens/s; vLLM alone 0.9 s.
    # Batch by batch 1 s each: 2 s where the saturated engine needs 1 s -> straggler factor 2.
    engine = EngineFigures(engine_s=[2.0, 1.0], vllm_s=[0.9, 0.95], batch_s=[1.0, 1.0], trajectories=[],
                           engine_cpu_s=[0.3, 0.2], vllm_cpu_s=[0.1, 0.15])
    # Both at once the engine kept 300 of its 400 tokens/s and the learner 100 of its 200: capacity 0.75 + 0.5.
    together = {"engine_tokens_per_s": 300.0, "learner_tokens_per_s": 100.0}
    # sao's learner (critic too): 3 s for the 400 tokens -> 133.3 tokens/s.
    model = limit_model(engine, [100, 300], {"sync": [0.5, 0.5], "streaming": [1.0, 1.0], "sao": [1.5, 1.5]}, requests=100, together=together)
    assert model["engine_tokens_per_s"] == 400.0
    assert abs(model["engine_over_vllm"] - 0.9) < 1e-12
    assert model["straggler_factor"] == 2.0
    assert model["client_cpu_ms_per_request"] == {"engine": 2.0, "vllm_alone": 1.0}  # best run's CPU s / 100 requests
    assert abs(model["sync_limit_tokens_per_s"] - 400 / 3) < 1e-9  # 400 tokens / (2 s generating + 1 s training)
    assert model["learner_tokens_per_s"] == {"sync": 400.0, "streaming": 200.0, "sao": 400 / 3}
    assert (model["streaming_limit_tokens_per_s"], model["streaming_bound_by"]) == (200.0, "learner")  # min(400, 200)
    assert abs(model["shared_core_bound_tokens_per_s"] - 400 / 3) < 1e-9  # 1 / (1/400 + 1/200)
    assert model["concurrency_capacity"] == 1.25
    assert abs(model["streaming_limit_measured_tokens_per_s"] - 500 / 3) < 1e-9  # 1.25 / (1/400 + 1/200), under min(E, L)
    assert abs(model["sao_limit_tokens_per_s"] - 125.0) < 1e-9  # 1.25 / (1/400 + 3/400), under sao's 133.3
    limit = limit_model(engine, [100, 300], {"sync": [0.5, 0.5], "streaming": [1.0, 1.0]}, requests=100,
                        together={"engine_tokens_per_s": 400.0, "learner_tokens_per_s": 200.0})
    assert limit["streaming_limit_measured_tokens_per_s"] == 200.0  # c = 2 would allow 266.7: min(E, L) caps it
    # W2's session timed the engine alone at 800 tokens/s: the machine was 2x faster then.
    w2 = {"engine_alone": {"tokens_per_s": 800.0},
          "modes": [{"mode": "sync", "trained_tokens_per_s": 120.0}, {"mode": "streaming", "trained_tokens_per_s": 150.0},
                    {"mode": "sao", "trained_tokens_per_s": 100.0}]}
    fractions = w2_fractions(model, w2)
    assert abs(fractions["sync"]["fraction_of_limit"] - 0.9) < 1e-9 and abs(fractions["streaming"]["fraction_of_limit"] - 0.9) < 1e-9  # 150 / 166.7
    assert abs(fractions["sync"]["fraction_of_limit_load_normalised"] - 0.45) < 1e-9  # 120 / (133.3 x 2)
    assert abs(fractions["streaming"]["fraction_of_limit_load_normalised"] - 0.45) < 1e-9
    assert fractions["streaming"]["fraction_of_min_e_l"] == 0.75 and "fraction_of_min_e_l" not in fractions["sync"]  # 150 / 200
    assert (fractions["sao"]["fraction_of_limit"], fractions["sao"]["limit"]) == (0.8, "sao")  # 100 / 125, its own limit


def test_w1_limit_model_counts_the_filtered_groups_as_engine_work_and_leaves_the_warm_up_step_out():
    from learning_add import limit_fractions
    from limits import w1_model

    # 3 batches of 100 trained samples; batch 0 is the learner's warm-up. The run generated 1.5 samples per
    # trained one (a third filtered). Engine: 450 generated samples in 0.5 s at best -> 900/s -> E = 600 trained/s.
    engine = {"engine_s": [0.9, 0.5], "generated": 450, "batch_s": [9.0, 0.2, 0.3]}
    # Learner: 1 thread 0.25 s per batch after the warm-up -> L = 400/s; 2 threads 0.15 s -> 666.7/s.
    step_s = {"1": [5.0, 0.25, 0.25], "2": [5.0, 0.15, 0.15]}
    # Together the engine kept 450 of its 900 generated/s and the learner 300 of its 400: c = 0.5 + 0.75.
    both = {"engine_samples_per_s": 450.0, "learner_samples_per_s": 300.0}
    model = w1_model(engine, [100, 100, 100], step_s, both, generated_per_trained=1.5)
    assert model["engine_generated_samples_per_s"] == 900.0 and model["engine_samples_per_s"] == 600.0
    assert model["learner_samples_per_s"] == {"1": 400.0, "2": 200 / 0.3}
    assert model["concurrency_capacity"] == 1.25
    assert abs(model["capacity_bound_samples_per_s"] - 300.0) < 1e-9  # 1.25 / (1/600 + 1/400)
    assert (model["limit_samples_per_s"], model["bound_by"]) == (model["capacity_bound_samples_per_s"], "learner")
    assert abs(model["sync_limit_samples_per_s"] - 200 / 0.8) < 1e-9  # 200 samples / (0.2 + 0.3 generating + 2 x 0.15 training)
    # Runs: streaming 256 samples in 1.28 s = 200/s, sync 125/s; the peer 1.024 s = 250/s. sao's model: no sync limit.
    sao = w1_model(engine, [100, 100, 100], {"1": step_s["1"]}, both, generated_per_trained=1.0)
    assert sao["engine_samples_per_s"] == 900.0 and "sync_limit_samples_per_s" not in sao
    results = {"streaming": {"s_per_256_samples": 1.28}, "sync": {"s_per_256_samples": 2.048}, "trl": {"s_per_256_samples": 1.024},
               "sao": {"s_per_256_samples": 2.56}}
    rows = limit_fractions({"streaming": model, "sao": sao}, results)
    assert abs(rows["streaming"]["fraction_of_limit"] - 200 / 300) < 1e-9 and abs(rows["streaming"]["limit_over_peer"] - 1.2) < 1e-9
    assert abs(rows["sync"]["fraction_of_limit"] - 0.5) < 1e-9 and abs(rows["sync"]["over_peer"] - 0.5) < 1e-9  # 125 / 250
    # sao: c / (1/900 + 1/400) = 346.15 trained samples/s; the run 100/s.
    assert abs(rows["sao"]["limit_samples_per_s"] - 1.25 / (1 / 900 + 1 / 400)) < 1e-9 and abs(rows["sao"]["samples_per_s"] - 100.0) < 1e-9
    assert "fraction_of_limit" not in rows["trl"] and limit_fractions({"streaming": model}, {"streaming": results["streaming"]}).keys() == {"streaming"}
    assert limit_fractions({"streaming": model}, {"streaming": results["streaming"]})["streaming"].keys() == {"samples_per_s", "limit_samples_per_s", "fraction_of_limit"}
    # The peer's groups were all-equal (zero advantage) on 36% of its samples: 250 x 0.64 = 160 informative samples/s.
    results["trl"]["informative_fraction"] = 0.64
    rows = limit_fractions({"streaming": model}, results)
    assert abs(rows["trl"]["informative_samples_per_s"] - 160.0) < 1e-9
    assert abs(rows["streaming"]["over_peer_informative"] - 1.25) < 1e-9 and abs(rows["streaming"]["limit_over_peer_informative"] - 300 / 160) < 1e-9


def test_the_peers_informative_fraction_is_one_minus_its_mean_zero_std_share():
    from learning_add import informative_fraction

    steps = [{"step": 1, "frac_reward_zero_std": 0.5}, {"step": 2, "frac_reward_zero_std": 0.25}, {"step": 3}]
    assert informative_fraction(steps) == 1 - 0.375 and informative_fraction([{"step": 1}]) is None


def test_trained_samples_are_counted_as_the_peer_counts_them_and_with_a_non_zero_advantage():
    from learning_add import consumed_per_trained, sample_rates

    # asyncrl: groups #0-#3 started before the last trained one (#3): 2 samples trained in each of #0 and #3, 1 + 1
    # consumed by two filters; #1 dropped, #4 (filtered) started after it: (4 + 2) / 4. 0.5 s per 256 = 512 trained/s.
    fates = [("a#0", "trained"), ("a#0", "trained"), ("b#1", "dropped_stale"), ("c#2", "filtered:zero_variance"),
             ("c#3", "trained"), ("c#3", "trained"), ("d#2", "filtered:overlong"), ("e#4", "filtered:zero_variance")]  # fmt: skip
    consumed = consumed_per_trained(fates)
    assert consumed == 1.5 and consumed_per_trained([("e#4", "filtered:zero_variance")]) is None
    assert sample_rates({"s_per_256_samples": 0.5, "consumed_per_trained": consumed}) == {"as_trl_counts": 768.0, "nonzero_advantage": 512.0}
    # The peer trains every group: 0.25 s per 256 = 1,024/s, 60% of them in groups whose rewards differ.
    assert sample_rates({"s_per_256_samples": 0.25, "informative_fraction": 0.6}) == {"as_trl_counts": 1024.0, "nonzero_advantage": 614.4}
    assert sample_rates({"s_per_256_samples": 0.25}) == {"as_trl_counts": 1024.0, "nonzero_advantage": None}  # the plain loop
    assert sample_rates({"s_per_256_samples": None}) == {"as_trl_counts": None, "nonzero_advantage": None}


def test_wait_replay_waits_for_the_straggler_as_the_queue_does():
    from wait_bound import StepCost, Stream, fit_step_cost, replay_wait

    one_s = StepCost(1.0, 0.0)  # every engine step 1 s; the learner trains 10 tokens/s
    # eta = 0 is sync: group 0 (2 tokens) 0-2 s, trained 2-3 s; only then group 1 is admitted: 3-6 s, trained 6-7 s.
    sync = replay_wait(Stream([2, 3], [10, 10], 1), steps=2, batch_groups=1, eta=0, step_cost=one_s, learner_rate=10.0)
    assert sync == {"seconds": 7.0, "tokens": 20, "tokens_per_s": 20 / 7, "learner_wait_s": 5.0}
    # eta = 1: groups 0 (4 tokens) and 1 (1 token) start at once; group 1 is done at 1 s and trained 1-2 s. At
    # version 1 group 0 (admitted at 0 = 1 - eta) holds the learner although group 2 is ready at 3 s: it
    # trains group 0 once it is done at 4 s, 4-5 s. The learner waited 1 s + 2 s.
    eta1 = replay_wait(Stream([4, 1, 1], [10, 10, 10], 1), steps=2, batch_groups=1, eta=1, step_cost=one_s, learner_rate=10.0)
    assert eta1 == {"seconds": 5.0, "tokens": 20, "tokens_per_s": 4.0, "learner_wait_s": 3.0}
    # G = 2 at 0.5 s + 0.25 s per sequence: a step with two groups running takes 1.5 s, with one 1 s. Group 1 is
    # done at 1.5 s (trained 1.5-2.5 s); group 0 has 2 tokens left at 2.5 s, 1 at 4 s (group 2 done beside it)
    # and is done at 5 s, trained 5-6 s. The learner waited 1.5 s + 2.5 s.
    two = replay_wait(Stream([4, 1, 1], [10, 10, 10], 2), steps=2, batch_groups=1, eta=1, step_cost=StepCost(0.5, 0.25), learner_rate=10.0)
    assert (two["seconds"], two["learner_wait_s"]) == (6.0, 4.0)
    cost = fit_step_cost([(1, 0.003), (11, 0.004), (21, 0.005)])
    assert abs(cost.fixed_s - 0.0029) < 1e-12 and abs(cost.per_sequence_s - 0.0001) < 1e-12


def test_wait_replay_slows_the_learner_only_while_the_engine_decodes():
    from wait_bound import StepCost, Stream, replay_wait

    # Groups 0 (4 tokens) and 1 (1 token), 1 s per engine step, the learner 1 s per step alone and half as fast
    # beside the engine: step 0 trains group 1 from 1 s beside group 0's decoding, done at 3 s; step 1 waits for
    # group 0 (done at 4 s) and trains with the engine idle, 4-5 s. Waited 1 s + 1 s.
    slowed = replay_wait(Stream([4, 1], [10, 10], 1), steps=2, batch_groups=1, eta=1, step_cost=StepCost(1.0, 0.0), learner_rate=10.0, learner_slowdown=2.0)
    assert (slowed["seconds"], slowed["learner_wait_s"]) == (5.0, 2.0)


def test_wait_replay_holds_starts_while_the_ready_lead_is_full():
    from wait_bound import StepCost, Stream, replay_wait

    # One group in flight at a time, 1 s each; the learner takes 2 s per step. eta alone: the engine keeps
    # generating while the learner trains (steps 1-3, 3-5, 5-7 s). With one ready batch of lead the engine stops
    # while a batch waits: group 1 starts at 3 s, when step 0 ends, so each step waits 1 s (1-3, 4-6, 7-9 s).
    args = dict(steps=3, batch_groups=1, eta=3, step_cost=StepCost(1.0, 0.0), learner_rate=5.0, max_in_flight=1)
    free = replay_wait(Stream([1] * 8, [10] * 8, 1), **args)
    held = replay_wait(Stream([1] * 8, [10] * 8, 1), ready_lead=1, **args)
    assert (free["seconds"], free["learner_wait_s"]) == (7.0, 1.0)
    assert (held["seconds"], held["learner_wait_s"]) == (9.0, 3.0)


def test_streaming_under_wait_is_held_to_the_wait_limit():
    from limits import w2_fractions

    model = {"sync_limit_tokens_per_s": 100.0, "streaming_limit_measured_tokens_per_s": 400.0, "streaming_limit_tokens_per_s": 500.0,
             "engine_tokens_per_s": 1000.0, "wait": {"wait_limit_tokens_per_s": 250.0}}
    w2 = {"config": {"stale_policy": "wait"}, "engine_alone": {"tokens_per_s": 1000.0},
          "modes": [{"mode": "sync", "trained_tokens_per_s": 90.0}, {"mode": "streaming", "trained_tokens_per_s": 200.0}]}
    waited = w2_fractions(model, w2)
    assert waited["streaming"]["fraction_of_limit"] == 0.8 and waited["streaming"]["limit"] == "wait"  # 200 / 250
    assert waited["streaming"]["fraction_of_capacity_limit"] == 0.5 and waited["sync"]["fraction_of_limit"] == 0.9
    w2["config"]["stale_policy"] = "continue"  # the learner never waits: the capacity limit
    assert w2_fractions(model, w2)["streaming"]["fraction_of_limit"] == 0.5


def test_thread_cores_add_up_the_threads_of_each_name_over_the_window():
    before = {1: ("ray::IDLE", 10.0), 2: ("worker.io", 3.0)}
    after = {1: ("ray::IDLE", 12.0), 2: ("worker.io", 3.2), 3: ("worker.io", 0.6)}  # thread 3 started meanwhile
    assert thread_cores(before, after, 4.0) == [["ray::IDLE", 0.5], ["worker.io", 0.2]]


def test_thread_times_count_this_threads_cpu():
    import os
    import threading
    import time

    tid = threading.get_native_id()
    before = thread_times(os.getpid())[tid][1]
    end = time.thread_time() + 0.2
    while time.thread_time() < end:
        pass
    assert thread_times(os.getpid())[tid][1] - before >= 0.15


def _w2_row(mode: str, tokens_per_s: float, samples_per_s: float) -> dict:
    keys = ("window_s", "generated_mean_response_tokens", "mean_response_tokens", "generated_tokens_per_s",
            "rollout_idle_fraction", "learner_idle_fraction", "staleness_mean")
    return {"mode": mode, "recipe": mode, "samples_trained": 64, "tokens_trained": 640, "rollout_efficiency": None,
            "trained_tokens_per_s": tokens_per_s, "trained_samples_per_s": samples_per_s, "staleness_max": 1,
            "dropped_stale": 0, "stale_tokens_masked": 0, **dict.fromkeys(keys, 1.0)}


def test_w2_speedups_and_table_take_sync_as_the_reference():
    # The test suite smoke-runs async_speedup.py with streaming alone; its sync-relative figures are pinned here.
    from async_speedup import fmt_table, speedup_ratios

    rows = [_w2_row("sync", 1000.0, 10.0), _w2_row("streaming", 2500.0, 20.0), _w2_row("sao", 500.0, 4.0)]
    assert speedup_ratios(rows) == {
        "streaming_over_sync": 2.5, "streaming_over_sync_samples_per_s": 2.0,
        "sao_over_sync": 0.5, "sao_over_sync_samples_per_s": 0.4,
    }
    assert speedup_ratios(rows[1:]) == {}
    vs_sync = [line.split()[8] for line in fmt_table(rows, None).splitlines()[1:]]
    assert vs_sync == ["1.00x", "2.50x", "0.50x"]
    assert [line.split()[8] for line in fmt_table(rows[1:], None).splitlines()[1:]] == ["-", "-"]


def test_w2_rounds_report_each_modes_median_round_and_the_speedups_within_rounds():
    from async_speedup import median_rows, round_ratios
    from report import _async_rounds

    def row(mode, round_index, tokens_per_s):
        return {**_w2_row(mode, tokens_per_s, tokens_per_s / 10), "round": round_index}

    # sync's second round is the slow spell: the median drops it, the within-round ratio shows it.
    rows = [row("sync", 0, 2000.0), row("streaming", 0, 4000.0),
            row("sync", 1, 1000.0), row("streaming", 1, 5000.0),
            row("sync", 2, 2200.0), row("streaming", 2, 4400.0)]
    picked = median_rows(rows)
    assert [(r["mode"], r["round"], r["trained_tokens_per_s"]) for r in picked] == [("sync", 0, 2000.0), ("streaming", 2, 4400.0)]
    assert round_ratios(rows) == {"streaming_over_sync": [2.0, 5.0, 2.0]}
    # An even count takes the lower middle round; a round without sync has no ratio.
    assert median_rows(rows[:4])[0]["trained_tokens_per_s"] == 1000.0
    assert round_ratios([row("streaming", 0, 1.0)]) == {}
    runs = [{k: r[k] for k in ("round", "mode", "trained_tokens_per_s")} for r in rows]
    line = _async_rounds({"rounds": 3, "runs": runs, "round_ratios": round_ratios(rows)})[0]
    assert "sync 2,000 / 1,000 / 2,200; streaming 4,000 / 5,000 / 4,400" in line
    assert "streaming / sync 2.00x / 5.00x / 2.00x" in line
    assert _async_rounds({"rounds": 1, "runs": runs}) == []


@pytest.mark.parametrize("decay", [{"lr_decay": "cosine", "min_lr_ratio": 0.1}, {"lr_decay": "linear"}, {}])
def test_the_peer_steps_at_asyncrls_learning_rates(decay):
    from peer_trl import lr_schedule
    from transformers import get_scheduler

    from asyncrl.config import LearnerConfig
    from asyncrl.learner.state import lr_factor

    cfg = LearnerConfig(max_steps=10, **decay)
    schedule = lr_schedule(cfg)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler(schedule["lr_scheduler_type"], optimizer, num_warmup_steps=0, num_training_steps=10,
                              scheduler_specific_kwargs=schedule.get("lr_scheduler_kwargs"))
    peer = []
    for _ in range(10):
        peer.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert peer == pytest.approx([lr_factor(cfg)(k) for k in range(10)])


def test_a_schedule_the_peer_cannot_mirror_is_refused():
    from peer_trl import lr_schedule

    from asyncrl.config import LearnerConfig

    with pytest.raises(ValueError, match="min_lr_ratio = 0.2"):
        lr_schedule(LearnerConfig(lr_decay="linear", min_lr_ratio=0.2, max_steps=10))


def test_a_nan_step_survives_when_the_run_went_past_it():
    from soak import Checkpoint, Leg, _nan_survived

    def leg(checkpoint_step):
        return Leg(index=0, ending="SIGTERM", resumed_from=None, started_s=0.0, resumable_at=Checkpoint(checkpoint_step, 0))

    skipped, trained = {"step": 36, "skipped_step": 1}, {"step": 36}
    assert _nan_survived(leg(30), [35, 36, 37], skipped) is True  # a later step followed
    assert _nan_survived(leg(36), [35, 36], skipped) is True  # the leg's last step, but checkpointed after it
    assert _nan_survived(leg(35), [35, 36], skipped) is None  # the next leg replays it: not known here
    assert _nan_survived(leg(40), [35, 36, 37], trained) is False  # a NaN step that was not skipped


def test_agent_recipe_figures_measure_the_drop_after_the_best(tmp_path):
    # Best 0.88 at step 25, lowest after it 0.0: drop 0.88. A dip below an earlier best counts even when a later
    # evaluation is the best of all (0.90 at 10, 0.69 at 25, 0.905 at 40: drop 0.21).
    events = tmp_path / "events.jsonl"
    rows = [{"kind": "note", "data": {"text": "x"}}] + [
        {"kind": "eval", "data": {"step": s, "accuracy": a, "tool_call_rate": 1.0}}
        for s, a in [(0, 0.01), (10, 0.87), (25, 0.88), (30, 0.79), (40, 0.0)]
    ]
    events.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert not agent_recipes.finished(events)
    falls = agent_recipes.figures(agent_recipes.eval_curve(events))
    assert (falls["start"], falls["best"], falls["best_step"], falls["final"], falls["drop"]) == (0.01, 0.88, 25, 0.0, 0.88)
    rises = agent_recipes.figures([(0, 0.1, None), (5, 0.06, None), (10, 0.9, None), (15, 0.86, None)])
    assert rises["drop"] == 0.04 and agent_recipes.holds([rises]) and not agent_recipes.holds([rises, falls])
    dips = agent_recipes.figures([(0, 0.1, None), (10, 0.9, None), (25, 0.69, None), (40, 0.905, None)])
    assert (dips["best"], dips["drop"]) == (0.905, 0.21) and not agent_recipes.holds([dips])
    events.write_text(events.read_text() + json.dumps({"kind": "close", "data": {"steps": 40, "error": None}}) + "\n")
    assert agent_recipes.finished(events)
