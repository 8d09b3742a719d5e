"""Multi-turn episodes on a real vLLM CPU engine (tiny 0.3M model, `add` alphabet), token by token.

One engine for the module, driven in-process. A scripted environment answers every model turn with the
observation `=12` and ends the episode after three turns; model turns end at the stop string `+`, at EOS
or at 4 tokens. The model is random, so the checks are the ones that hold for any sample: the layout of
masks, versions and turn starts, the stop string kept as sampled, and the engine's own log-probs of the
final sequence equal to the rollout log-probs of every model token (the context of every turn was exactly
the tokens of the sequence: nothing was re-tokenized).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asyncrl.envs.base import Observation, StepResult
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.episode_runner import EpisodeLimits, EpisodeRunner
from asyncrl.testing import make_prompt, make_request

pytestmark = pytest.mark.integration

PROMPT = [1, 5, 6, 14, 7, 8, 15]  # <bos> 12+34=
OBSERVATION = "=12"
SAMPLING = SamplingSpec(max_tokens=4, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop, tiny_model_dir):
    from asyncrl.rollout.engine import Engine

    engine = Engine(str(tiny_model_dir), name="engine-0", max_model_len=256, max_num_seqs=16, kv_cache_gib=1)
    loop.run_until_complete(engine.start())
    yield engine
    loop.run_until_complete(engine.shutdown())


class ThreeTurns:
    """Observation `=12` after each turn; done (reward 1) after the third. `on_step(k)` runs inside step k."""

    def __init__(self, on_step=None, turns: int = 3, stop: tuple[str, ...] = ("+",)):
        self.steps, self.turns, self.stop = 0, turns, stop
        self.on_step = on_step

    async def reset(self, prompt):
        return Observation()

    async def step(self, action_text, *, finish_reason="stop"):
        self.steps += 1
        if self.on_step is not None:
            await self.on_step(self.steps)
        if self.steps >= self.turns:
            return StepResult(None, reward=1.0, done=True)
        return StepResult(Observation(OBSERVATION))


def _episode(loop, engine, make_env, limits=EpisodeLimits(8, 200, 60.0), sampling=SAMPLING, request_id="e"):
    runner = EpisodeRunner(engine, make_env, limits)
    return loop.run_until_complete(runner.run(make_request(make_prompt(request_id, PROMPT, "1")), sampling))


def _model_positions(t) -> np.ndarray:
    return np.flatnonzero(t.loss_mask == 1)


def _check_layout(t, engine):
    """Turns of model tokens separated by exactly the observation's tokens; a `+` only ever ends a turn."""
    observation = engine.encode(OBSERVATION)
    assert observation == [15, 5, 6]  # '=' '1' '2': one token per character, no special tokens
    ends = t.turn_starts[1:] + [len(t.response_ids)]
    for k, (start, end) in enumerate(zip(t.turn_starts, ends)):
        turn_end = end - (len(observation) if k < len(t.turn_starts) - 1 else 0)
        assert t.loss_mask[start:turn_end].tolist() == [1] * (turn_end - start)
        assert t.response_ids[turn_end:end].tolist() == (observation if end != turn_end else [])
        assert t.loss_mask[turn_end:end].tolist() == [0] * (end - turn_end)
        plus = [i for i in range(start, turn_end) if t.response_ids[i] == 14]
        assert plus in ([], [turn_end - 1])  # the stop string's token stays in the sequence, as the last of its turn


def test_a_three_turn_episode_is_token_exact(loop, engine):
    # One token per model turn (max_tokens 1): the last turn is cut by max_tokens, so the episode is truncated.
    t = _episode(loop, engine, lambda: ThreeTurns(stop=()), sampling=SamplingSpec(max_tokens=1, temperature=1.0, seed=5), request_id="one")
    a, b, c = t.response_ids[[0, 4, 8]].tolist()
    assert t.response_ids.tolist() == [a, 15, 5, 6, b, 15, 5, 6, c]  # observation "=12" after turns 1 and 2
    assert t.loss_mask.tolist() == [1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert t.turn_starts == [0, 4, 8] and t.versions.tolist() == [engine.version] * 9
    assert (t.num_turns, t.finish_reason, t.truncated, t.reward, t.failure) == (3, "length", True, 1.0, None)
    assert t.rollout_logprobs[[1, 2, 3, 5, 6, 7]].tolist() == [0.0] * 6
    # The engine's log-probs of the final sequence (T = 1, as sampled) are the rollout log-probs of every model
    # token: each turn was sampled from exactly the tokens before it.
    scored = loop.run_until_complete(engine.score(PROMPT + t.response_ids.tolist(), len(PROMPT)))
    assert np.allclose(scored[[0, 4, 8]], t.rollout_logprobs[[0, 4, 8]], atol=1e-4)


def test_turns_ending_at_a_stop_string_keep_it_and_stay_token_exact(loop, engine):
    t = _episode(loop, engine, ThreeTurns, request_id="plus")
    assert t.num_turns == 3 and t.reward == 1.0 and t.finish_reason in ("stop", "length")
    _check_layout(t, engine)
    scored = loop.run_until_complete(engine.score(PROMPT + t.response_ids.tolist(), len(PROMPT)))
    model = _model_positions(t)
    assert np.allclose(scored[model], t.rollout_logprobs[model], atol=1e-4)


def test_an_in_flight_update_between_turns_labels_the_later_turns_with_the_new_version(loop, engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from asyncrl.weights.buckets import hf_named_tensors, pack_buckets

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    buckets = pack_buckets(hf_named_tensors(model), bucket_bytes=1 << 20)
    v0 = engine.version

    async def update_after_first_turn(step):
        if step == 1:
            await engine.update_weights(buckets, version=v0 + 1, in_flight=True)

    t = _episode(loop, engine, lambda: ThreeTurns(update_after_first_turn), request_id="u")
    _check_layout(t, engine)
    assert t.turn_versions == [v0, v0 + 1, v0 + 1] and t.dispatch_version == v0
    first_end = t.turn_starts[1]
    assert set(t.versions[:first_end].tolist()) == {v0} and set(t.versions[first_end:].tolist()) == {v0 + 1}
    # The later turns were sampled by the new weights: the engine (now serving them) scores them alike.
    scored = loop.run_until_complete(engine.score(PROMPT + t.response_ids.tolist(), len(PROMPT)))
    later = [i for i in _model_positions(t) if i >= first_end]
    assert np.allclose(scored[later], t.rollout_logprobs[later], atol=1e-4)


@pytest.mark.parametrize(
    "limits, sampling, stop, finish",
    [
        (EpisodeLimits(2, 200, 60.0), SAMPLING, ("+",), "max_turns"),
        (EpisodeLimits(8, len(PROMPT) + 9, 60.0), SAMPLING, ("+",), "context"),
        # 50 ms for a first turn of 180 tokens: a CPU decode step takes over 1 ms, so the episode's clock cuts the
        # turn mid-generation on any host (at 0.5 s a warmed engine on a fast host reached the context first).
        (EpisodeLimits(8, 200, 0.05), SamplingSpec(max_tokens=180, ignore_eos=True, stream_interval=1, timeout_s=60), (), "timeout"),
    ],
)
def test_limits_end_an_episode_truncated_with_their_finish_reason(loop, engine, limits, sampling, stop, finish):
    t = _episode(loop, engine, lambda: ThreeTurns(turns=100, stop=stop), limits=limits, sampling=sampling, request_id=finish)
    assert (t.finish_reason, t.truncated, t.failure) == (finish, True, None)
    assert len(PROMPT) + len(t.response_ids) <= limits.max_total_tokens and t.num_turns <= limits.max_turns
    if finish == "timeout":
        assert t.num_turns == 1 and len(t.response_ids) < sampling.max_tokens  # cut by the clock, not by a length
