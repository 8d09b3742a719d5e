"""Multi-turn trajectories in the learner: truncated episodes bootstrap, observation tokens carry nothing."""

import pytest
import torch

from asyncrl.algo.recipes import compute_advantages, compute_policy_loss, resolve_recipe
from asyncrl.learner.batch import build_batch
from asyncrl.testing import make_trajectory
from asyncrl.types import Group

# prompt [1], then a model turn [5], an observation [6, 7] (loss_mask 0), a model turn [8].
EPISODE = dict(prompt_ids=[1], rollout_logprobs=[-0.5, 0.0, 0.0, -0.25], loss_mask=[1, 0, 0, 1], reward=1.0, turn_starts=[0, 3])


@pytest.mark.parametrize(
    "finish_reason, truncated, done",
    [("stop", False, True), ("tool_error", False, True), ("length", True, False), ("max_turns", True, False),
     ("context", True, False), ("timeout", True, False), ("length", False, False)],
)
def test_only_episodes_the_model_or_its_environment_ended_are_terminal(finish_reason, truncated, done):
    t = make_trajectory([5, 6, 7, 8], finish_reason=finish_reason, truncated=truncated, **EPISODE)
    assert build_batch([Group("g0", [t])], resolve_recipe("ppo_gae")).dones.tolist() == [done]


@pytest.mark.parametrize("truncated, expected", [(True, [0.85, 0, 0, 1.1, 0]), (False, [0.6, 0, 0, 0.6, 0])])
def test_gae_skips_observation_tokens_and_bootstraps_a_truncated_episode_from_its_last_state(truncated, expected):
    # Columns 0..4 predict tokens 5, 6, 7, 8 and nothing: loss on columns 0 and 3 only. V = 0.1 .. 0.5 by
    # column; the learner bootstraps from the last column's value, V(s_T) = 0.5 (asyncrl/learner/step.py).
    # gamma 1, lambda 0.5, reward 1 on the last model token (column 3):
    #   truncated:  delta_3 = 1 + 0.5 - 0.4 = 1.1;  column 0: delta_0 = 0 + V_3 - V_0 = 0.3, A_0 = 0.3 + 0.5 * 1.1 = 0.85
    #   terminal:   delta_3 = 1 + 0   - 0.4 = 0.6;  A_0 = 0.3 + 0.5 * 0.6 = 0.6
    # Columns 1 and 2 (observation tokens) get 0 and do not enter: V_1, V_2 are never used.
    finish = "max_turns" if truncated else "stop"
    t = make_trajectory([5, 6, 7, 8], finish_reason=finish, truncated=truncated, **EPISODE)
    recipe = resolve_recipe("ppo_gae", gamma=1.0, lam=0.5, whiten_advantages=False)
    batch = build_batch([Group("g0", [t])], recipe)
    values = torch.tensor([[0.1, 99.0, -99.0, 0.4, 0.5]])  # garbage on the observation columns
    bootstrap = values[torch.arange(1), batch.seq_lens - 1]
    adv, returns = compute_advantages(recipe, batch.rewards, batch.group_ids, batch.loss_mask, values, batch.dones, bootstrap)
    assert adv[0].tolist() == pytest.approx(expected)
    assert returns[0, 1:3].tolist() == [0.0, 0.0]


def test_an_observation_tokens_logit_gets_exactly_zero_gradient():
    t = make_trajectory([5, 6, 7, 8], finish_reason="stop", **EPISODE)
    recipe = resolve_recipe("grpo")
    batch = build_batch([Group("g0", [t, t.replace(sample_index=1, reward=0.0)])], recipe)
    logits = torch.randn(2, 5, 10, requires_grad=True)
    next_tokens = torch.roll(batch.input_ids, -1, dims=1)
    logprobs = torch.log_softmax(logits, -1).gather(-1, next_tokens[..., None])[..., 0]
    loss, _ = compute_policy_loss(recipe, logprobs, logprobs.detach(), batch.rollout_logprobs, batch.advantages, batch.loss_mask, batch.token_weights)
    loss.backward()
    assert torch.equal(logits.grad[:, 1:3], torch.zeros(2, 2, 10))  # the observation tokens 6 and 7
    assert logits.grad[:, 0].abs().sum() > 0 and logits.grad[:, 3].abs().sum() > 0  # the model tokens learn
