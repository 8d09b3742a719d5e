"""Agent tasks with a calculator: `calc` (multi-operand sums of 3-digit numbers) and `word_problems`
(templated arithmetic stories checked with `math-verify`), both generated locally from a seed.

An episode, token by token (`calc`, prompt `123+456+789=`):

    model:        [123+456+789]        a tool call: the turn ends at the stop string `]`
    observation:  =1368;                the calculator's answer (`=?;` when the call failed)
    model:        1368<eos>            the final answer: scored, the episode is done

The model may also answer at once (`1368<eos>`). A tiny model cannot add three 3-digit numbers reliably in its
head but can copy an expression and a result, so the calculator is what makes the task solvable, and RL
can raise both the success rate and how often the tool is called.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from asyncrl.envs.base import EnvContext, Observation, StepInfo, StepResult
from asyncrl.envs.tools.base import ToolCall
from asyncrl.types import Prompt

CALL_OPEN, CALL_CLOSE = "[", "]"
HELDOUT_SEED = 20_261_201
OPERAND_RANGE = (100, 999)


class CalcEnv:
    """The calculator agent environment. kwargs: `reward` (default `env.reward`), `max_tool_errors` (failed calls
    after which the episode ends `tool_error`, reward 0)."""

    stop: tuple[str, ...] = (CALL_CLOSE,)

    def __init__(self, context: EnvContext, reward: str | None = None, max_tool_errors: int = 2):
        self.context = context
        self.reward = reward or context.reward
        self.max_tool_errors = max_tool_errors
        self.tool_errors = 0
        self.prompt: Prompt | None = None

    async def reset(self, prompt: Prompt) -> Observation:
        self.prompt = prompt
        return Observation()

    async def step(self, action_text: str, *, finish_reason: str = "stop") -> StepResult:
        expression = tool_call_expression(action_text) if finish_reason == "stop" else None
        if expression is None:
            return StepResult(None, reward=await self._score(action_text, finish_reason), done=True)
        result = await self.context.tools.call(ToolCall("calculator", expression), self.context.tool_timeout_s)
        if result.ok:
            return StepResult(Observation(result_text(result.output)), info=StepInfo(tool="calculator"))
        self.tool_errors += 1
        info = StepInfo(tool="calculator", tool_error=result.error or "error")
        return StepResult(Observation(result_text("?")), done=self.tool_errors >= self.max_tool_errors, info=info)

    async def _score(self, answer: str, finish_reason: str) -> float:
        assert self.prompt is not None, "reset() first"
        return await self.context.tools.reward(
            self.reward,
            answer,
            self.prompt.ground_truth,
            finish_reason=finish_reason,
            extra_info=dict(self.prompt.extra_info),
            timeout_s=self.context.reward_timeout_s,
        )


class WordProblemEnv(CalcEnv):
    """`calc`'s protocol on word problems, checked with `math-verify` unless kwargs name another reward."""

    def __init__(self, context: EnvContext, reward: str | None = "math_verify", max_tool_errors: int = 2):
        super().__init__(context, reward, max_tool_errors)


def call_text(expression: str) -> str:
    return f"{CALL_OPEN}{expression}{CALL_CLOSE}"


def result_text(output: str) -> str:
    """The observation of a calculator result (`?` for a failed call)."""
    return f"={output};"


def tool_expression(task: str, text: str) -> str:
    """The calculator expression that solves a generated problem of `task` from its prompt text (what a warm
    start teaches the model to write between `[` and `]`)."""
    if task == "calc":
        return text.rstrip("=")
    if task != "word_problems":
        raise ValueError(f"no tool expression for task {task!r} (calc, word_problems)")
    first, second = (int(n) for n in re.findall(r"\d+", text.split("\n")[0])[:2])
    if " gets " in text:
        return f"{first}+{second}"
    if " gives " in text:
        return f"{first}-{second}"
    return f"{first}*{second}"  # "buys {bags} bags with {per_bag} ..."


def tool_call_expression(action_text: str) -> str | None:
    """The expression of a turn that ends with a complete tool call `[...]`, else None (a final answer)."""
    if not action_text.endswith(CALL_CLOSE) or CALL_OPEN not in action_text:
        return None
    return action_text[action_text.rindex(CALL_OPEN) + 1 : -1]


# ---------------------------------------------------------------------------------------------------
# Problems: (prompt text, answer), a fixed-seed held-out set and endless training streams disjoint from it.


def calc_problem(rng: random.Random, operands: int = 3) -> tuple[str, str]:
    numbers = [rng.randint(*OPERAND_RANGE) for _ in range(operands)]
    return "+".join(map(str, numbers)) + "=", str(sum(numbers))


_NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn")
_ITEMS = ("apple", "book", "coin", "shell", "stamp", "card")


def word_problem(rng: random.Random, operands: int = 3) -> tuple[str, str]:
    """One templated story (sum, difference or product); `operands` is unused but keeps one signature."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(12, 99), rng.randint(2, 11)
    kind = rng.randrange(3)
    if kind == 0:
        text, answer = f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?", a + b
    elif kind == 1:
        text, answer = f"{name} has {a} {item}s and gives {b} away. How many {item}s are left?", a - b
    else:
        text, answer = f"{name} buys {b} bags with {a} {item}s in each. How many {item}s is that?", a * b
    return f"{text}\nAnswer: ", str(answer)


PROBLEMS = {"calc": calc_problem, "word_problems": word_problem}


def heldout_problems(task: str, n: int, operands: int = 3) -> list[tuple[str, str]]:
    rng = random.Random(HELDOUT_SEED)
    seen: dict[str, str] = {}
    for _ in range(50 * n):
        if len(seen) == n:
            break
        text, answer = PROBLEMS[task](rng, operands)
        seen.setdefault(text, answer)
    return list(seen.items())


def train_problems(
    task: str, seed: int, operands: int = 3, exclude: set[str] | None = None
) -> Iterator[tuple[str, str]]:
    """An endless stream of problems whose prompt is not in `exclude` (default: the 500 held-out ones)."""
    rng = random.Random(seed)
    exclude = exclude if exclude is not None else {t for t, _ in heldout_problems(task, 500, operands)}
    while True:
        text, answer = PROBLEMS[task](rng, operands)
        if text not in exclude:
            yield text, answer
