"""The environment protocol: every shipped environment through it, the registry, the user extension point,
and the locally generated agent tasks."""

import asyncio
import random

import pytest

from asyncrl.envs import calc
from asyncrl.envs.base import BUILTIN_ENVS, Env, EnvContext, Observation, StepResult, make_env, resolve_env
from asyncrl.envs.tools.base import InProcessTools
from asyncrl.testing import make_prompt

# (env, prompt text, ground truth, a correct final answer, a tool call and its observation or None)
CASES = {
    "single_turn": ("12+30=", "42", "42", None),
    "calc": ("123+456+789=", "1368", "1368", ("[123+456+789]", "=1368;")),
    "word_problems": ("Ann has 12 apples and gets 30 more. How many apples does Ann have now?\nAnswer: ", "42",
                      "The answer is 42", ("[12+30]", "=42;")),
}


def _run(coro):
    return asyncio.run(coro)


async def _episode(env: Env, text: str, truth: str, steps: list[tuple[str, str]]) -> list[StepResult]:
    reset = await env.reset(make_prompt("p", [1, 2], truth, text=text))
    assert isinstance(reset, Observation)
    return [await env.step(action, finish_reason=finish) for action, finish in steps]


def test_every_shipped_environment_is_tested_here():
    assert set(CASES) == set(BUILTIN_ENVS)


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_contract_a_correct_answer_ends_the_episode_with_reward_one(name):
    text, truth, answer, _ = CASES[name]
    env = make_env(name, {}, EnvContext(InProcessTools()))
    assert isinstance(env, Env) and isinstance(env.stop, tuple)
    (result,) = _run(_episode(env, text, truth, [(answer, "stop")]))
    assert (result.done, result.reward, result.info.tool) == (True, 1.0, None)


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_contract_an_answer_cut_at_max_tokens_scores_zero(name):
    text, truth, answer, _ = CASES[name]
    (result,) = _run(_episode(make_env(name, {}, EnvContext()), text, truth, [(answer, "length")]))
    assert result.done and result.reward == 0.0


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[3]])
def test_contract_a_tool_call_is_answered_with_an_observation_and_the_episode_goes_on(name):
    text, truth, answer, (call, observation) = CASES[name]
    env = make_env(name, {}, EnvContext())
    assert call.endswith(env.stop)  # the turn ends at the call's close marker
    tool, final = _run(_episode(env, text, truth, [(call, "stop"), (answer, "stop")]))
    assert (tool.observation, tool.done, tool.reward, tool.info.tool) == (Observation(observation), False, 0.0, "calculator")
    assert final.done and final.reward == 1.0


def test_failed_tool_calls_come_back_as_observations_until_the_limit_ends_the_episode():
    env = make_env("calc", {"max_tool_errors": 2}, EnvContext())
    first, second = _run(_episode(env, "1+1=", "2", [("[1/0]", "stop"), ("[2**999]", "stop")]))
    assert (first.observation, first.done, first.info.tool_error) == (Observation("=?;"), False, "error")
    assert second.done and second.info.tool_error == "error" and second.reward == 0.0


class UserEnv:
    """A user environment: echoes the prompt's ground truth as its observation once, then scores length."""

    stop = ("!",)

    def __init__(self, context, bonus: float = 0.0):
        self.bonus = bonus

    async def reset(self, prompt):
        self.truth = prompt.ground_truth
        return Observation(">")

    async def step(self, action_text, *, finish_reason="stop"):
        return StepResult(None, reward=len(action_text) + self.bonus, done=True)


class NotAsync:
    stop = ()

    def __init__(self, context):
        pass

    def reset(self, prompt):
        return Observation()

    def step(self, action_text, *, finish_reason="stop"):
        return StepResult(None, done=True)


def test_a_user_environment_plugs_in_by_import_path_with_its_kwargs():
    env = make_env(f"{__name__}:UserEnv", {"bonus": 0.5}, EnvContext())
    (result,) = _run(_episode(env, "", "7", [("abc", "stop")]))
    assert result.reward == 3.5


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("nope", {}, "unknown environment 'nope'"),
        ("no_such_module_xyz:Env", {}, "cannot import environment"),
        (f"{__name__}:Missing", {}, "cannot import environment"),
        (f"{__name__}:NotAsync", {}, "lacks `async def reset`"),
        (f"{__name__}:CASES", {}, "is not a class"),
        ("calc", {"bogus": 1}, "rejected env.kwargs"),
    ],
)
def test_a_bad_environment_is_refused_naming_what_is_wrong(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_env(name, kwargs, EnvContext())


def test_builtin_environments_resolve_to_classes():
    assert resolve_env("calc") is calc.CalcEnv and issubclass(resolve_env("word_problems"), calc.CalcEnv)


@pytest.mark.parametrize("task", sorted(calc.PROBLEMS))
def test_agent_tasks_are_seeded_and_training_never_sees_the_heldout_set(task):
    heldout = calc.heldout_problems(task, 100)
    assert heldout == calc.heldout_problems(task, 100) and len({t for t, _ in heldout}) == 100
    stream = calc.train_problems(task, seed=3, exclude={t for t, _ in heldout})
    train = [next(stream) for _ in range(500)]
    assert not {t for t, _ in train} & {t for t, _ in heldout}


def test_calc_problems_are_sums_of_three_digit_numbers():
    text, answer = calc.calc_problem(random.Random(0))
    numbers = [int(x) for x in text.rstrip("=").split("+")]
    assert len(numbers) == 3 and all(100 <= n <= 999 for n in numbers) and answer == str(sum(numbers))


def test_word_problem_answers_follow_their_story():
    for text, answer in calc.heldout_problems("word_problems", 30):
        numbers = [int(w) for w in text.replace("?", " ").split() if w.isdigit()]
        a, b = (numbers[1], numbers[0]) if "bags" in text else numbers
        expected = a + b if "more" in text else a - b if "away" in text else a * b
        assert answer == str(expected), text


@pytest.mark.parametrize(
    "text, expression",
    [("Ann has 12 apples and gets 30 more. How many apples does Ann have now?\nAnswer: ", "12+30"),
     ("Ben has 45 coins and gives 7 away. How many coins are left?\nAnswer: ", "45-7"),
     ("Eva buys 4 bags with 70 cards in each. How many cards is that?\nAnswer: ", "4*70")],
)
def test_the_tool_expression_of_a_word_problem_is_its_story_as_arithmetic(text, expression):
    assert calc.tool_expression("word_problems", text) == expression
    assert calc.tool_expression("calc", "123+456+789=") == "123+456+789"


def test_every_generated_problem_is_solved_by_its_tool_expression():
    from asyncrl.envs.tools.calculator import calculate

    for task in calc.PROBLEMS:
        for text, answer in calc.heldout_problems(task, 200):
            assert calculate(calc.tool_expression(task, text)) == answer, (task, text)
    with pytest.raises(ValueError, match="no tool expression for task 'add'"):
        calc.tool_expression("add", "1+2=")


@pytest.mark.parametrize("response, reward", [("42", 1.0), ("The answer is 42", 1.0), ("\\frac{84}{2}", 1.0), ("41", 0.0)])
def test_math_verify_reward(response, reward):
    from asyncrl.envs.rewards import math_verify

    assert math_verify(response, "42") == reward
