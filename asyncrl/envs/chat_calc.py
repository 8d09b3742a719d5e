"""The `calc` task as an OpenAI-style tool-calling conversation, in a model family's chat format.

A conversation (what the built-in harness `agent` sends and what `asyncrl.envs.warm_start.warm_start_chat_calc`
teaches), with the calculator offered as a function tool:

    system:     SYSTEM (+ the tool's signature, written by the chat template)
    user:       123+456+789=
    assistant:  tool_calls = [calculator(expression="123+456+789")]   (ChatML: a <tool_call>{json}</tool_call> block)
    tool:       1368
    assistant:  1368                                                   (scored: exact match with the ground truth)

The model may also answer at once. The harness runs the calculator itself (`calculate`: parsed, never `eval`) and
returns the reward, so the episode the endpoint captures is exactly what the model sampled and was shown.
"""

from __future__ import annotations

import json
from typing import Any

from asyncrl.envs.calc import tool_expression
from asyncrl.envs.rewards import exact_match
from asyncrl.envs.tools.calculator import calculate

SYSTEM = "Answer with a number. Use the calculator."
TOOL_NAME = "calculator"
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "properties": {"expression": {"title": "Expression", "type": "string"}},
            "required": ["expression"],
            "title": "calculator_args",
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}
"""The calculator as a function tool, key for key as the OpenAI Agents SDK sends `calculator(expression: str)`
(`asyncrl.envs.agents_sdk`): the chat template writes the tools into the prompt as given, so the warm start
teaches the prompt either harness sends."""
MAX_MODEL_CALLS = 3


def question(prompt_text: str) -> list[dict[str, Any]]:
    """The opening messages of an episode on a `calc` prompt (`123+456+789=`)."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt_text}]


def tool_call_message(expression: str, call_id: str = "call_0") -> dict[str, Any]:
    """The assistant message that calls the calculator on `expression` (arguments as OpenAI sends them: JSON text)."""
    arguments = json.dumps({"expression": expression})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}],
    }


def tool_message(content: str, call_id: str = "call_0") -> dict[str, Any]:
    """The message that answers tool call `call_id` with `content`."""
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def conversation(prompt_text: str, answer: str, use_tool: bool, task: str = "calc") -> list[dict[str, Any]]:
    """A solved episode of `task` (`calc`, `word_problems`): the question, then (with `use_tool`) the call on the
    expression that solves it and its result, then the answer."""
    messages = question(prompt_text)
    if use_tool:
        messages += [
            tool_call_message(tool_expression(task, prompt_text)),
            tool_message(answer),
        ]
    return messages + [{"role": "assistant", "content": answer}]


def called_expression(reply: str) -> str | None:
    """The expression of a reply that is exactly one Hermes-style calculator call (`<tool_call>\n{json}\n</tool_call>`,
    as ChatML writes it), else None."""
    head, tail = "<tool_call>\n", "\n</tool_call>"
    if not (reply.startswith(head) and reply.endswith(tail)):
        return None
    try:
        call = json.loads(reply[len(head) : -len(tail)])
        expression = call["arguments"]["expression"] if call["name"] == TOOL_NAME else None
    except (ValueError, KeyError, TypeError):
        return None
    return expression if isinstance(expression, str) else None


def run_tool(name: str, arguments: str) -> str:
    """The tool message content of one call: the calculator's value, or `error: ...` (an unknown tool, arguments
    that are not a JSON object with a string `expression`, an expression the calculator refuses)."""
    if name != TOOL_NAME:
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments)
        expression = args["expression"]
        if not isinstance(expression, str):
            raise TypeError("expression is not a string")
        return calculate(expression)
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


async def agent(client: Any, prompt: str, episode: Any) -> tuple[float, dict[str, Any]]:
    """The built-in harness (`rollout.openai_agent: asyncrl.envs.chat_calc:agent`): up to MAX_MODEL_CALLS calls
    through the OpenAI client; every tool call is answered with a tool message; the first reply without tool calls
    is the answer, scored by exact match. A run out of calls scores 0, truncated. `info` counts the tool calls."""
    messages, calls = question(prompt), 0
    for _ in range(MAX_MODEL_CALLS):
        reply = await client.chat.completions.create(model=episode.model, messages=messages, tools=[CALCULATOR_TOOL])
        choice = reply.choices[0]
        message = choice.message.model_dump(exclude_none=True)
        messages.append(message)
        if not choice.message.tool_calls:
            reason = "length" if choice.finish_reason == "length" else "stop"
            reward = exact_match(choice.message.content or "", episode.prompt.ground_truth, finish_reason=reason)
            return reward, {"tool_calls": calls}
        for call in choice.message.tool_calls:
            content = run_tool(call.function.name, call.function.arguments)
            messages.append(tool_message(content, call.id))
            calls += 1
    return 0.0, {"truncated": True, "tool_calls": calls}
