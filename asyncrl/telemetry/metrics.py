"""Prometheus metrics of a run, served by the controller when `telemetry.prometheus_port` > 0.

Names follow `asyncrl_<area>_<what>_<unit>`; deploy/grafana/dashboards/asyncrl.json plots them and
tests/unit/test_deploy_files.py keeps the two lists in step. `RunMetrics` is a telemetry `Sink`: the controller's
step, sync, eval and pool-snapshot events set the series (asyncrl/telemetry/sinks.py).
"""

from __future__ import annotations

from typing import Any

from asyncrl.telemetry.sinks import PoolSnapshot, Sink, SyncEvent


class RunMetrics(Sink):
    def __init__(self, port: int = 0, correction: str = ""):
        self.correction = correction
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("asyncrl_learner_step_total", "Optimizer steps taken", registry=r)
        self.version = Gauge("asyncrl_policy_version", "Policy version published to the engines", registry=r)
        self.reward = Gauge("asyncrl_rollout_reward_mean", "Mean reward of the last trained batch", registry=r)
        self.accuracy = Gauge("asyncrl_eval_accuracy", "Held-out accuracy at the last evaluation", registry=r)
        self.staleness = Histogram(
            "asyncrl_buffer_staleness_versions", "Policy lag of trained samples", buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r
        )
        self.samples = Gauge("asyncrl_buffer_samples_total", "Samples by terminal state (conservation counters)", ["state"], registry=r)
        self.k3 = Gauge("asyncrl_mismatch_k3_kl", "k3 KL between learner and rollout log-probs", registry=r)
        self.masked = Gauge("asyncrl_correction_masked_fraction", "Fraction of tokens masked by the correction", ["method"], registry=r)
        self.sync_seconds = Histogram(
            "asyncrl_weight_sync_seconds", "Learner step done to every engine serving the new version (with weight_sync.overlap: to the controller seeing it, an upper bound)", buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r
        )
        self.parity = Gauge("asyncrl_weight_sync_parity_max_abs_diff", "Max |engine - learner| log-prob after the last sync", registry=r)
        self.rollout_tps = Gauge("asyncrl_rollout_tokens_per_second", "Generated tokens per second over the run", registry=r)
        self.rollout_idle = Gauge("asyncrl_rollout_idle_fraction", "Fraction of time the engines had no request", registry=r)
        self.learner_idle = Gauge("asyncrl_learner_idle_fraction", "Fraction of time the learner waited for data", registry=r)
        self.learner_tps = Gauge("asyncrl_learner_tokens_per_second", "Trained tokens per second over the run", registry=r)
        if port:
            start_http_server(port, registry=r)

    def step(self, row: dict[str, Any]) -> None:
        self.steps.inc()
        self.reward.set(row["reward"])
        for lag, n in row.get("lag_counts", {}).items():
            for _ in range(n):
                self.staleness.observe(int(lag))
        if "mismatch_k3_kl" in row:
            self.k3.set(row["mismatch_k3_kl"])
        if "correction_masked_fraction" in row:
            self.masked.labels(method=self.correction).set(row["correction_masked_fraction"])

    def sync(self, event: SyncEvent) -> None:
        self.version.set(event.version)
        self.sync_seconds.observe(event.seconds)
        if event.parity is not None:
            self.parity.set(event.parity)

    def eval(self, record: dict[str, Any]) -> None:
        self.accuracy.set(record["accuracy"])

    def pool(self, snapshot: PoolSnapshot) -> None:
        self.observe_totals(snapshot.counters, snapshot.wall_s, snapshot.tokens_trained, snapshot.learner_wait_s, snapshot.engines)

    def observe_totals(self, counters: dict[str, int], wall_s: float, tokens_trained: int, learner_wait_s: float, rollout: dict) -> None:
        for state, n in counters.items():
            if state in ("trained", "dropped_stale", "in_flight", "dispatched") or state.startswith(("filtered:", "failed:")):
                self.samples.labels(state=state).set(n)
        if wall_s > 0:
            self.learner_tps.set(tokens_trained / wall_s)
            self.learner_idle.set(min(1.0, learner_wait_s / wall_s))
            generated = sum(w.get("tokens_generated", 0) for w in rollout.values())
            busy = sum(w.get("busy_s", 0.0) for w in rollout.values())
            idle = sum(w.get("idle_s", 0.0) for w in rollout.values())
            self.rollout_tps.set(generated / wall_s)
            if busy + idle > 0:
                self.rollout_idle.set(idle / (busy + idle))

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
