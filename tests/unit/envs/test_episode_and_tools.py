import asyncio

import numpy as np
import pytest

from asyncrl.envs.episode import EpisodeBuilder
from asyncrl.envs.tools.base import InProcessTools, RewardError, ToolCall, ToolExecutor, check_reward_value
from asyncrl.envs.tools.calculator import calculate


def test_episode_interleaves_model_and_observation_tokens_exactly():
    ep = EpisodeBuilder([1, 2], dispatch_version=3)
    ep.add_model_turn([10, 11], [-0.5, -0.25], [3, 4])
    ep.add_observation([20, 21, 22])
    assert ep.context_ids == [1, 2, 10, 11, 20, 21, 22]  # the next prompt: exact tokens, nothing re-rendered
    ep.add_model_turn([12], [-1.0], [5])
    t = ep.build(prompt_id="p", group_id="g", sample_index=0, finish_reason="stop")
    assert t.response_ids.tolist() == [10, 11, 20, 21, 22, 12]
    assert t.loss_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert t.rollout_logprobs.tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert t.versions.tolist() == [3, 4, 4, 4, 4, 5]  # observations take the previous model token's version
    assert t.turn_starts == [0, 5]
    assert t.min_version == 3 and t.max_version == 5


def test_episode_rejects_ragged_turns():
    with pytest.raises(ValueError, match="differ in length"):
        EpisodeBuilder([1]).add_model_turn([1, 2], [0.0], [0, 0])


@pytest.mark.parametrize(
    "expression, value",
    [("2+3*4", "14"), ("(2+3)*4", "20"), ("7/2", "3.5"), ("8/2", "4"), ("-3**2", "-9"), ("17//5", "3"), ("17%5", "2"), ("123456*789", "97406784")],
)
def test_calculator_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "a+1", "2**1000", "9**64*9**64", "1/0", "[1]", "True+1", "1"*300])
def test_calculator_refuses_anything_but_bounded_arithmetic(expression):
    with pytest.raises(ValueError):
        calculate(expression)


def test_in_process_tools_report_tool_errors_as_results():
    tools = InProcessTools()
    assert isinstance(tools, ToolExecutor)
    ok = asyncio.run(tools.call(ToolCall("calculator", "6*7"), timeout_s=1))
    bad = asyncio.run(tools.call(ToolCall("calculator", "6/0"), timeout_s=1))
    assert (ok.output, ok.ok) == ("42", True)
    assert (bad.ok, bad.error) == (False, "error") and "division by zero" in bad.output


def test_reward_values_are_checked():
    assert check_reward_value(1) == 1.0 and check_reward_value(np.float32(0.5)) == 0.5
    for bad in ("1.0", float("nan"), None, float("inf")):
        with pytest.raises(RewardError):
            check_reward_value(bad)
    value = asyncio.run(InProcessTools().reward("exact_match", "12", "12", finish_reason="stop", extra_info={}, timeout_s=5))
    assert value == 1.0


def test_an_inline_built_in_reward_runs_on_the_event_loop_and_the_others_in_a_thread_under_their_timeout(monkeypatch):
    import threading
    import time

    from asyncrl.envs import rewards

    threads = {}

    def recorder(name, seconds=0.0):
        def reward(response, ground_truth, *, finish_reason, extra_info):
            threads[name] = threading.get_ident()
            time.sleep(seconds)
            return 1.0

        return reward

    monkeypatch.setitem(rewards.BUILTIN, "exact_match", recorder("exact_match"))
    monkeypatch.setitem(rewards.BUILTIN, "math_verify", recorder("math_verify", seconds=0.5))

    async def score(name, timeout_s):
        return threading.get_ident(), await InProcessTools().reward(name, "1", "1", finish_reason="stop", extra_info={}, timeout_s=timeout_s)

    loop_thread, value = asyncio.run(score("exact_match", 5))
    assert value == 1.0 and threads["exact_match"] == loop_thread  # no thread hop
    with pytest.raises(RewardError, match="timed out after 0.1s"):
        asyncio.run(score("math_verify", 0.1))
    assert threads["math_verify"] != loop_thread


def test_the_pool_client_scores_a_built_in_reward_itself_and_sends_user_rewards_to_a_worker():
    from asyncrl.envs.tools.pool import ToolClient

    client = ToolClient(names=())  # no tool worker at all: a built-in reward must not need one
    assert asyncio.run(client.reward("exact_match", "12", "12", finish_reason="stop", extra_info={}, timeout_s=5)) == 1.0
    with pytest.raises(Exception, match="no_tool_worker|range"):
        asyncio.run(client.reward("mypkg.rewards:score", "12", "12", finish_reason="stop", extra_info={}, timeout_s=5))
