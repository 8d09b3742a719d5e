"""Staleness of long and multi-turn episodes: the stale abort judges a later turn by the episode's oldest model
token, and the version span of an episode reaches the trajectory log and the step metrics."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from asyncrl.buffer.storage import trajectories_to_arrow
from asyncrl.envs.episode import EpisodeBuilder
from asyncrl.rollout.engine import Engine
from asyncrl.rollout.sampling import Member
from asyncrl.telemetry.figures import batch_figures
from asyncrl.testing import make_prompt, make_request, make_trajectory
from asyncrl.types import Batch, Group


def _episode_after_two_turns() -> EpisodeBuilder:
    builder = EpisodeBuilder([1, 2], dispatch_version=2)
    builder.add_model_turn([5, 6], [-0.1, -0.2], [2, 2])
    builder.add_observation([7])
    builder.add_model_turn([8], [-0.3], [4])
    return builder


def test_a_later_turn_is_aborted_by_its_episodes_oldest_model_token():
    builder = _episode_after_two_turns()
    assert builder.oldest_model_version == 2 and EpisodeBuilder([1]).oldest_model_version is None
    first_turn = make_request(make_prompt("first"))
    oldest = builder.oldest_model_version
    later_turn = dataclasses.replace(make_request(make_prompt("later")), context_min_version=oldest)
    engine = Engine("unused", name="e")
    engine._llm, engine._version = object(), 5  # started (no vLLM call: the members have no stream yet)
    # Both members sampled their first token at version 4, so their own lag at version 5 is 1 = η: only the later
    # turn, whose episode holds tokens of version 2 (lag 3 > η), is certain to exceed the bound.
    members = {r.request_id: Member(r, first_version=4) for r in (first_turn, later_turn)}
    engine._running.update(members)
    assert members[later_turn.request_id].oldest_version == 2 and members[first_turn.request_id].oldest_version == 4
    assert asyncio.run(engine.abort_stale(abort_after_lag=1)) == 1
    reason = engine._abort_reasons[later_turn.request_id]
    assert reason.startswith("stale: oldest token at version 2, engine serves 5") and len(engine._abort_reasons) == 1
    # A later turn is doomed by its episode even before its own first token.
    waiting = dataclasses.replace(make_request(make_prompt("waiting")), context_min_version=1)
    engine._running = {waiting.request_id: Member(waiting)}
    assert asyncio.run(engine.abort_stale(abort_after_lag=3)) == 1


def test_version_span_is_in_the_trajectory_the_log_and_the_step_metrics():
    episode = _episode_after_two_turns().build(prompt_id="p", group_id="g", sample_index=0, finish_reason="stop")
    single = make_trajectory(3, versions=7)
    masked = make_trajectory(3, versions=[1, 6, 6], loss_mask=[0, 1, 1])  # stale_policy continue masked version 1
    assert (episode.version_span, single.version_span, masked.version_span) == (2, 0, 0)
    assert trajectories_to_arrow([episode, single]).column("version_span").to_pylist() == [2, 0]
    figures = batch_figures(Batch([Group("g", [episode, single])], version=6))
    assert figures["version_span_max"] == 2
    assert np.array_equal(episode.versions, [2, 2, 2, 4])  # the observation carries its model turn's version
