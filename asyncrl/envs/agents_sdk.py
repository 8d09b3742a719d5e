"""The `calc` task driven by the OpenAI Agents SDK (`openai-agents`, the `agents` extra), unmodified: its own agent
loop (`Runner.run`) with `OpenAIChatCompletionsModel` on the client the rollout worker hands the harness, so every
call goes to the worker's endpoint and is captured token-exactly.

    rollout:
      openai_port: -1
      openai_agent: asyncrl.envs.agents_sdk:agent

The agent is what a user writes for any OpenAI-compatible server: instructions, one function tool, a turn limit.
The SDK's tracing is turned off (it would upload traces to OpenAI; a run reaches nothing outside it).
"""

from __future__ import annotations

import json
from typing import Any

from asyncrl.envs.chat_calc import MAX_MODEL_CALLS, SYSTEM, run_tool
from asyncrl.envs.rewards import exact_match


def calc_agent(client: Any, model: str) -> Any:
    """The SDK agent: instructions `SYSTEM`, the tool `calculator(expression)`, the chat-completions model `model`
    served through `client`. Its tool schema is `asyncrl.envs.chat_calc.CALCULATOR_TOOL`."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return run_tool("calculator", json.dumps({"expression": expression}))

    return Agent(
        name="calc",
        instructions=SYSTEM,
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=ModelSettings(),
    )


async def agent(client: Any, prompt: str, episode: Any) -> tuple[float, dict[str, Any]]:
    """One episode: `Runner.run` on the prompt, at most MAX_MODEL_CALLS model calls; the final output scored by
    exact match. 0 when the turn limit ends the run (truncated) and when the SDK stops it for the model's own
    mistake (`ModelBehaviorError`: a call to a tool the agent lacks, arguments that are not JSON): a wrong episode
    the policy learns from, not an infrastructure failure kept out of training."""
    from agents import RunConfig, Runner
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
    from agents.items import ToolCallItem

    config = RunConfig(tracing_disabled=True)
    try:
        result = await Runner.run(
            calc_agent(client, episode.model), prompt, max_turns=MAX_MODEL_CALLS, run_config=config
        )
    except (MaxTurnsExceeded, ModelBehaviorError) as e:
        calls = sum(isinstance(item, ToolCallItem) for item in (e.run_data.new_items if e.run_data else []))
        return 0.0, {"truncated": isinstance(e, MaxTurnsExceeded), "tool_calls": calls}
    calls = sum(isinstance(item, ToolCallItem) for item in result.new_items)
    return exact_match(str(result.final_output), episode.prompt.ground_truth), {"tool_calls": calls}
