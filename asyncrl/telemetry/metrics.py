"""Prometheus metrics of a run, served by the controller when `telemetry.prometheus_port` > 0.

Names follow `asyncrl_<area>_<what>_<unit>`; counters (`_total`) for counts, gauges for levels, histograms for
distributions. `METRICS` is the one list: `RunMetrics` registers it, the metric table of docs/metrics.md is
printed from it (`python -m asyncrl.telemetry.metrics`), and tests/unit/test_deploy_files.py checks every Grafana
query against the registry. `RunMetrics` is a telemetry `Sink`: the controller's step, sync, eval, pool-snapshot
and alarm events set the series while the run goes on (asyncrl/telemetry/sinks.py). Counters follow the run's
cumulative totals (the queue's conservation counters, the engines' token counts): each snapshot adds what grew
since the last.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.telemetry.sinks import AlarmEvent, PoolSnapshot, Sink, SyncEvent

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
QUANTILES = ("p01", "p05", "p50", "p95", "p99")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


def _mismatch(name: str, help: str, labels: tuple[str, ...] = ()) -> list[MetricSpec]:
    """A mismatch figure of the whole batch, and the same figure per staleness bucket (label `lag`)."""
    return [
        MetricSpec(name, "gauge", help, labels),
        MetricSpec(f"{name}_by_lag", "gauge", f"{help}, per policy lag", labels + ("lag",)),
    ]


METRICS: list[MetricSpec] = [
    # learning
    MetricSpec("asyncrl_learner_step_total", "counter", "Optimizer steps taken"),
    MetricSpec("asyncrl_policy_version", "gauge", "Learner policy version (the latest published to the engines)"),
    MetricSpec("asyncrl_rollout_reward_mean", "gauge", "Mean reward of the last trained batch"),
    MetricSpec("asyncrl_eval_accuracy", "gauge", "Held-out accuracy at the last evaluation"),
    MetricSpec("asyncrl_eval_policy_version", "gauge", "Policy version the last held-out accuracy was measured at"),
    MetricSpec("asyncrl_learner_loss", "gauge", "Policy loss of the last step"),
    MetricSpec("asyncrl_learner_grad_norm", "gauge", "Pre-clip gradient norm of the last step"),
    MetricSpec(
        "asyncrl_learner_kl_ref",
        "gauge",
        "KL of the policy to the frozen reference policy (the recipe's estimator), mean over loss tokens",
    ),
    MetricSpec(
        "asyncrl_rollout_entropy_nats",
        "gauge",
        "Mean -log mu of the sampled tokens of the last batch (a Monte-Carlo estimate of the sampling entropy)",
    ),
    MetricSpec("asyncrl_rollout_response_length_tokens", "gauge", "Mean response length of the last trained batch"),
    # staleness
    MetricSpec(
        "asyncrl_buffer_staleness_versions",
        "histogram",
        "Policy lag of trained samples at consumption",
        buckets=LAG_BUCKETS,
    ),
    MetricSpec(
        "asyncrl_staleness_generating_versions",
        "histogram",
        "Versions that elapsed while a trained sample was generated",
        buckets=LAG_BUCKETS,
    ),
    MetricSpec(
        "asyncrl_staleness_queued_versions",
        "histogram",
        "Versions that elapsed while a trained sample waited in the queue",
        buckets=LAG_BUCKETS,
    ),
    MetricSpec("asyncrl_engine_policy_version", "gauge", "Policy version each rollout engine serves", ("engine",)),
    MetricSpec(
        "asyncrl_staleness_aborted_requests_total",
        "counter",
        "Requests engines aborted because they would exceed max_staleness",
    ),
    MetricSpec(
        "asyncrl_staleness_dropped_groups_total",
        "counter",
        'Groups dropped as stale (samples: asyncrl_buffer_samples_total{state="dropped_stale"})',
    ),
    MetricSpec(
        "asyncrl_staleness_masked_tokens_total",
        "counter",
        "Tokens masked out of the loss as older than max_staleness (stale_policy continue)",
    ),
    MetricSpec(
        "asyncrl_staleness_admission_headroom_groups",
        "gauge",
        "Groups admission control would still start at the current version",
    ),
    MetricSpec(
        "asyncrl_staleness_admission_blocked",
        "gauge",
        "1 while prompts wait in the backlog because admission control holds them back",
    ),
    MetricSpec(
        "asyncrl_staleness_ready_hold",
        "gauge",
        "1 while prompts wait in the backlog because a learner batch is ready (buffer.max_ready_batches)",
    ),
    # mismatch (learner vs rollout log-probs)
    *_mismatch("asyncrl_mismatch_k1_kl", "k1 KL(mu || pi_train) = mean(log mu - log pi_train)"),
    *_mismatch("asyncrl_mismatch_k3_kl", "k3 KL between learner and rollout log-probs"),
    *_mismatch("asyncrl_mismatch_chi2", "Token chi-squared divergence mean(kappa^2) - 1"),
    *_mismatch("asyncrl_mismatch_logprob_abs_diff_max", "Max |log pi_train - log mu| over tokens"),
    *_mismatch("asyncrl_mismatch_logprob_abs_diff_mean", "Mean |log pi_train - log mu| over tokens"),
    *_mismatch("asyncrl_mismatch_ess_fraction", "Normalised effective sample size of kappa = pi_train / mu"),
    *_mismatch("asyncrl_mismatch_is_weight", "Quantile of the IS weight kappa = pi_train / mu", ("quantile",)),
    *_mismatch(
        "asyncrl_correction_clipped_fraction",
        "Fraction of tokens whose kappa exceeds the IS cap (algorithm.tis_cap)",
        ("method",),
    ),
    *_mismatch(
        "asyncrl_correction_masked_fraction",
        "Fraction of tokens masked by the correction (per lag: at pi_old, the step's first update)",
        ("method",),
    ),
    # queue
    MetricSpec("asyncrl_queue_ready_groups", "gauge", "Groups ready for the learner"),
    MetricSpec("asyncrl_queue_backlog_groups", "gauge", "Prompts waiting for admission"),
    MetricSpec(
        "asyncrl_queue_in_flight_samples",
        "gauge",
        "Samples dispatched and not yet terminal, by state (generating, ready, waiting)",
        ("state",),
    ),
    MetricSpec(
        "asyncrl_buffer_samples_total",
        "counter",
        "Samples by terminal state and reason, and dispatched (conservation counters)",
        ("state",),
    ),
    MetricSpec("asyncrl_pool_workers", "gauge", "Workers per pool (rollout, rollout_joining, learner)", ("pool",)),
    # throughput
    MetricSpec("asyncrl_rollout_generated_tokens_total", "counter", "Tokens the engines generated"),
    MetricSpec(
        "asyncrl_rollout_samples_total",
        "counter",
        "Generations the engines finished: one per sample, or per model turn of an agent episode "
        "(failed ones included)",
    ),
    MetricSpec(
        "asyncrl_rollout_vllm_requests_total",
        "counter",
        "Requests the engines sent to vLLM: one per group started together (rollout.group_requests)",
    ),
    MetricSpec("asyncrl_learner_trained_tokens_total", "counter", "Tokens the learner trained on"),
    MetricSpec(
        "asyncrl_rollout_tokens_per_second",
        "gauge",
        "Generated tokens per second over the last telemetry.rate_window_s",
    ),
    MetricSpec(
        "asyncrl_learner_tokens_per_second", "gauge", "Trained tokens per second over the last telemetry.rate_window_s"
    ),
    MetricSpec(
        "asyncrl_rollout_idle_fraction",
        "gauge",
        "Fraction of engine time with no request, over the last telemetry.rate_window_s",
    ),
    MetricSpec(
        "asyncrl_learner_idle_fraction",
        "gauge",
        "Fraction of time the learner waited for data, over the last telemetry.rate_window_s",
    ),
    MetricSpec(
        "asyncrl_learner_step_seconds",
        "histogram",
        "Seconds of each part of a step: wait (for data), forward_backward, optimizer, sync",
        ("phase",),
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
    ),
    MetricSpec(
        "asyncrl_weight_sync_seconds",
        "histogram",
        "Export start to the last engine serving the new version (its own stamp, also with weight_sync.overlap)",
        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
    ),
    MetricSpec("asyncrl_weight_sync_bytes_total", "counter", "Bytes of weights sent to the engines"),
    MetricSpec(
        "asyncrl_weight_sync_parity_max_abs_diff", "gauge", "Max |engine - learner| log-prob after the last probed sync"
    ),
    # alarms
    MetricSpec(
        "asyncrl_alarm", "gauge", "1 while the alarm's figure is beyond its threshold (telemetry.alarms)", ("name",)
    ),
]

MISMATCH_ROW_KEYS = {
    "asyncrl_mismatch_k1_kl": "mismatch_kl",
    "asyncrl_mismatch_k3_kl": "mismatch_k3_kl",
    "asyncrl_mismatch_chi2": "mismatch_chi2_token",
    "asyncrl_mismatch_logprob_abs_diff_max": "mismatch_logprob_abs_diff_max",
    "asyncrl_mismatch_logprob_abs_diff_mean": "mismatch_logprob_abs_diff_mean",
    "asyncrl_mismatch_ess_fraction": "mismatch_kappa_ess",
    "asyncrl_correction_clipped_fraction": "mismatch_kappa_clipped_fraction",
    "asyncrl_correction_masked_fraction": "correction_masked_fraction",
}
"""Metric -> the step row's key (`mismatch_<figure>`; per lag `mismatch_<figure>/lag=<lag>`,
asyncrl/algo/metrics.py)."""
STEP_GAUGES = {
    "asyncrl_rollout_reward_mean": "reward",
    "asyncrl_learner_loss": "loss",
    "asyncrl_learner_grad_norm": "grad_norm",
    "asyncrl_learner_kl_ref": "kl_ref",
    "asyncrl_rollout_entropy_nats": "entropy_mc_nats",
    "asyncrl_rollout_response_length_tokens": "response_length_mean",
}
"""Gauge -> the step row's key it shows."""
STEP_PHASES = {
    "wait": "learner_wait_s",
    "forward_backward": "time_forward_backward_s",
    "optimizer": "time_optimizer_s",
    "sync": "sync_s",
}
"""Step-time phase -> the step row's key."""


def _build(spec: MetricSpec, registry):
    from prometheus_client import Counter, Gauge, Histogram

    if spec.kind == "histogram":
        return Histogram(spec.name, spec.help, spec.labels, buckets=spec.buckets, registry=registry)
    kind = Counter if spec.kind == "counter" else Gauge
    return kind(spec.name, spec.help, spec.labels, registry=registry)


def _terminal_or_dispatched(state: str) -> bool:
    return state in ("trained", "dropped_stale", "dispatched") or state.startswith(("filtered:", "failed:"))


class RunMetrics(Sink):
    def __init__(self, port: int = 0, correction: str = "", host: str = "127.0.0.1"):
        from prometheus_client import CollectorRegistry, start_http_server

        self.correction = correction
        self.registry = CollectorRegistry()
        self.m = {spec.name: _build(spec, self.registry) for spec in METRICS}
        self._totals: dict[tuple[str, str], float] = {}
        self._engines: set[str] = set()
        """Engines with a version gauge; one that left the pool (died, removed) loses it."""
        if port:
            start_http_server(port, addr=host, registry=self.registry)

    def _advance(self, name: str, total: float, key: str = "", **labels: str) -> None:
        """Move counter `name` (with `labels`) up to the cumulative `total` of source `key`; a source whose total
        went down started afresh (a replaced engine), so all of its new total is new."""
        last = self._totals.get((name, key or str(labels)), 0.0)
        delta = total - last if total >= last else total
        self._totals[(name, key or str(labels))] = total
        if delta > 0:
            (self.m[name].labels(**labels) if labels else self.m[name]).inc(delta)

    # ------------------------------------------------------------------ step

    def step(self, row: dict[str, Any]) -> None:
        m = self.m
        m["asyncrl_learner_step_total"].inc()
        for name, key in STEP_GAUGES.items():
            if key in row:
                m[name].set(row[key])
        for name, key in (
            ("asyncrl_buffer_staleness_versions", "lag_counts"),
            ("asyncrl_staleness_generating_versions", "lag_generating_counts"),
            ("asyncrl_staleness_queued_versions", "lag_queued_counts"),
        ):
            for lag, n in row.get(key, {}).items():
                for _ in range(n):
                    m[name].observe(int(lag))
        for phase, key in STEP_PHASES.items():
            if key in row:
                m["asyncrl_learner_step_seconds"].labels(phase=phase).observe(row[key])
        self._mismatch(row)

    def _mismatch(self, row: dict[str, Any]) -> None:
        """The batch's mismatch figures and, from the `mismatch_<figure>/lag=<lag>` keys, each staleness bucket's."""
        method = {"method": self.correction}
        for name, key in MISMATCH_ROW_KEYS.items():
            labels = method if name.startswith("asyncrl_correction") else {}
            self._set(name, row, key, labels)
        for q in QUANTILES:
            self._set("asyncrl_mismatch_is_weight", row, f"mismatch_kappa_is_weight_{q}", {"quantile": q})

    def _set(self, name: str, row: dict[str, Any], key: str, labels: dict[str, str]) -> None:
        if key in row:
            (self.m[name].labels(**labels) if labels else self.m[name]).set(row[key])
        prefix = f"{key}/lag="
        for k, value in row.items():
            if k.startswith(prefix):
                self.m[f"{name}_by_lag"].labels(**labels, lag=k[len(prefix) :]).set(value)

    # ------------------------------------------------------------------ sync, eval, alarm

    def sync(self, event: SyncEvent) -> None:
        self.m["asyncrl_policy_version"].set(event.version)
        self.m["asyncrl_weight_sync_seconds"].observe(event.seconds)
        self.m["asyncrl_weight_sync_bytes_total"].inc(event.bytes)
        if event.parity is not None:
            self.m["asyncrl_weight_sync_parity_max_abs_diff"].set(event.parity)

    def eval(self, record: dict[str, Any]) -> None:
        self.m["asyncrl_eval_accuracy"].set(record["accuracy"])
        self.m["asyncrl_eval_policy_version"].set(record["version"])

    def alarm(self, event: AlarmEvent) -> None:
        self.m["asyncrl_alarm"].labels(name=event.name).set(1.0 if event.active else 0.0)

    # ------------------------------------------------------------------ pool snapshots

    def pool(self, snapshot: PoolSnapshot) -> None:
        m = self.m
        m["asyncrl_policy_version"].set(snapshot.version)
        for state, n in snapshot.counters.items():
            if _terminal_or_dispatched(state):
                self._advance("asyncrl_buffer_samples_total", n, state=state)
        self._advance("asyncrl_staleness_dropped_groups_total", snapshot.counters.get("groups_dropped_stale", 0))
        self._advance("asyncrl_staleness_masked_tokens_total", snapshot.counters.get("stale_tokens_masked", 0))
        self._advance("asyncrl_learner_trained_tokens_total", snapshot.tokens_trained)
        for engine in self._engines - snapshot.engines.keys():
            m["asyncrl_engine_policy_version"].remove(engine)
        self._engines = set(snapshot.engines)
        for engine, stats in snapshot.engines.items():
            m["asyncrl_engine_policy_version"].labels(engine=engine).set(stats.get("version", 0))
            self._advance("asyncrl_rollout_generated_tokens_total", stats.get("tokens_generated", 0), key=engine)
            self._advance("asyncrl_rollout_samples_total", stats.get("requests_done", 0), key=engine)
            self._advance("asyncrl_rollout_vllm_requests_total", stats.get("vllm_requests", 0), key=engine)
            self._advance("asyncrl_staleness_aborted_requests_total", stats.get("stale_aborts", 0), key=engine)
        for pool, n in snapshot.pool_sizes.items():
            m["asyncrl_pool_workers"].labels(pool=pool).set(n)
        self._queue(snapshot)
        if snapshot.live is not None:
            live = snapshot.live
            m["asyncrl_rollout_tokens_per_second"].set(live.generated_tokens_per_s)
            m["asyncrl_learner_tokens_per_second"].set(live.trained_tokens_per_s)
            m["asyncrl_rollout_idle_fraction"].set(live.rollout_idle_fraction)
            m["asyncrl_learner_idle_fraction"].set(live.learner_idle_fraction)

    def _queue(self, snapshot: PoolSnapshot) -> None:
        """Queue levels; in-flight samples split into generating (an engine holds them), ready, and waiting
        (not yet handed to an engine, or finished and waiting for their group)."""
        q, m = snapshot.queue, self.m
        generating = sum(e.get("requests_in_flight", 0) for e in snapshot.engines.values())
        ready = q.get("ready_samples", 0)
        m["asyncrl_queue_ready_groups"].set(q.get("ready_groups", 0))
        m["asyncrl_queue_backlog_groups"].set(q.get("backlog_groups", 0))
        in_flight = m["asyncrl_queue_in_flight_samples"]
        in_flight.labels(state="generating").set(generating)
        in_flight.labels(state="ready").set(ready)
        in_flight.labels(state="waiting").set(max(0, snapshot.counters.get("in_flight", 0) - generating - ready))
        headroom = q.get("admission_limit_groups", 0) - q.get("groups_ahead", 0)
        m["asyncrl_staleness_admission_headroom_groups"].set(headroom)
        m["asyncrl_staleness_admission_blocked"].set(float(headroom <= 0 and q.get("backlog_groups", 0) > 0))
        m["asyncrl_staleness_ready_hold"].set(q.get("ready_hold", 0.0))

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def markdown() -> str:
    """The metric table of docs/metrics.md: every metric with its type, labels and meaning."""
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.labels)
        lines.append(f"| `{spec.name}` | {spec.kind} | {labels} | {spec.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
