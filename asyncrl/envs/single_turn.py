"""`single_turn`: the default environment — one generation, scored by `env.reward` through the tool executor.

This is asyncrl's behaviour from before environments existed, kept exactly: the reward sees the response
text, the ground truth, the engine's finish reason and the prompt's `extra_info`, and the episode is over
after the one turn.
"""

from __future__ import annotations

from asyncrl.envs.base import EnvContext, Observation, StepResult
from asyncrl.types import Prompt


class SingleTurnEnv:
    stop: tuple[str, ...] = ()

    def __init__(self, context: EnvContext):
        self.context = context
        self.prompt: Prompt | None = None

    async def reset(self, prompt: Prompt) -> Observation:
        self.prompt = prompt
        return Observation()

    async def step(self, action_text: str, *, finish_reason: str = "stop") -> StepResult:
        assert self.prompt is not None, "reset() first"
        reward = await self.context.tools.reward(
            self.context.reward,
            action_text,
            self.prompt.ground_truth,
            finish_reason=finish_reason,
            extra_info=dict(self.prompt.extra_info),
            timeout_s=self.context.reward_timeout_s,
        )
        return StepResult(None, reward=reward, done=True)
