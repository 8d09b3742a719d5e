"""What a trained batch looked like, for the step row (metrics.jsonl and every telemetry sink).

A sample's lag at consumption (`Batch.lags`) splits into versions that elapsed while it was generated
(max_version - min_version: weights changed under an in-flight request) and while it waited in the queue
(consumption version - max_version): the two knobs a user turns against staleness differ (request length
vs queue depth and eta).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncrl.telemetry.sinks import lag_counts

if TYPE_CHECKING:
    from asyncrl.types import Batch


def batch_figures(batch: Batch) -> dict[str, Any]:
    """`lag_generating_counts`, `lag_queued_counts` (histograms like `lag_counts`), `version_span_max` (the largest
    `Trajectory.version_span`: weight updates one episode lived through), `response_length_mean` (tokens)
    and `entropy_mc_nats`: mean -log mu of the sampled model tokens, an unbiased estimate of the sampling
    distribution's per-token entropy that needs no extra forward pass."""
    trajectories = [t for g in batch.groups for t in g.trajectories]
    logprob_sum = sum(float(t.rollout_logprobs[t.loss_mask != 0].sum()) for t in trajectories)
    model_tokens = sum(int((t.loss_mask != 0).sum()) for t in trajectories)
    return {
        "lag_generating_counts": lag_counts([t.max_version - t.min_version for t in trajectories]),
        "lag_queued_counts": lag_counts([batch.version - t.max_version for t in trajectories]),
        "version_span_max": max((t.version_span for t in trajectories), default=0),
        "response_length_mean": sum(len(t.response_ids) for t in trajectories) / max(1, len(trajectories)),
        "entropy_mc_nats": -logprob_sum / model_tokens if model_tokens else 0.0,
    }
