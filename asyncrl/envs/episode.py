"""`EpisodeBuilder`: one multi-turn episode assembled token by token into one `Trajectory`.

Token-exact across turns: the next turn's prompt is `context_ids` — the original prompt, then exactly the
tokens the engine sampled and the observation tokens appended since, never a conversation re-rendered through a
chat template and re-tokenized (that drift changes the tokens the learner scores from the ones the engine
sampled). Model tokens carry their rollout log-prob, `loss_mask` 1 and the policy version that produced them;
observation tokens carry log-prob 0, `loss_mask` 0 and the version of the model token before them (so they
never lower the trajectory's `min_version`, which is what staleness is measured on).

`ChatTurns`: how the model's chat template writes an observation between two model turns (close the model's
turn, an observation message, open the next model turn), so an episode on a chat model stays in its chat format
while every sampled token stays as sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np

from asyncrl.types import Trajectory


class EpisodeBuilder:
    def __init__(self, prompt_ids: Sequence[int], dispatch_version: int = 0):
        self.prompt_ids = list(prompt_ids)
        self.dispatch_version = dispatch_version
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.versions: list[int] = []
        self.turn_starts: list[int] = []

    @property
    def context_ids(self) -> list[int]:
        """The next turn's prompt: the prompt plus every token appended so far, exactly."""
        return self.prompt_ids + self.ids

    @property
    def num_turns(self) -> int:
        return len(self.turn_starts)

    @property
    def oldest_model_version(self) -> int | None:
        """The oldest policy version among the model tokens so far (None before the first model turn): the
        next turn's request carries it, so the stale abort judges the whole episode (`Request.context_min_version`)."""
        model = [v for v, m in zip(self.versions, self.mask, strict=True) if m]
        return min(model) if model else None

    def add_model_turn(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(
                "model turn arrays differ in length "
                f"(ids {len(ids)}, logprobs {len(logprobs)}, versions {len(versions)})"
            )
        self.turn_starts.append(len(self.ids))
        self.ids += [int(t) for t in ids]
        self.logprobs += [float(x) for x in logprobs]
        self.mask += [1] * len(ids)
        self.versions += [int(v) for v in versions]

    def add_observation(self, ids: Sequence[int]) -> None:
        version = self.versions[-1] if self.versions else self.dispatch_version
        self.ids += [int(t) for t in ids]
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.versions += [version] * len(ids)

    def build(self, **fields: Any) -> Trajectory:
        """The trajectory; `fields` are the remaining `Trajectory` fields (ids, finish_reason, reward, ...)."""
        return Trajectory(
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(self.ids, dtype=np.int32),
            rollout_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            loss_mask=np.asarray(self.mask, dtype=np.int8),
            versions=np.asarray(self.versions, dtype=np.int32),
            turn_starts=list(self.turn_starts) or [0],
            dispatch_version=self.dispatch_version,
            **fields,
        )


class ChatTurns:
    """The text an observation adds to an episode in the chat template's format, found by rendering probe
    conversations (`[user, assistant]` and `[user, assistant, <role>]` with the generation prompt) and taking what
    the second adds. ChatML, role `user`: `<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n`
    (the leading end-of-turn token is left out when the model sampled it: the turn ended at its eos). A template
    that only concatenates contents (the char tokenizer's) or no template at all adds the text as it is.

    `tokenizer`: a tokenizer, or a model folder to load one from (with `AutoTokenizer`, as vLLM does) on first use.
    """

    PROBE = ("\x01U\x01", "\x01A\x01", "\x01O\x01")  # user, assistant and observation contents no template writes

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self._source = tokenizer
        self._template = chat_template
        self._frames: dict[str, tuple[str, str, str]] = {}

    @classmethod
    def for_model(cls, model_dir: str) -> ChatTurns | None:
        """The model folder's chat turns, or None when the folder has no chat template (observations are then
        appended as they are); the tokenizer loads on first use."""
        from asyncrl.models.templates import has_chat_template

        return cls(str(model_dir)) if has_chat_template(model_dir) else None

    @cached_property
    def tokenizer(self) -> Any:
        if not isinstance(self._source, str):
            return self._source
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self._source)

    def observation_text(self, text: str, role: str = "user", last_sampled: int | None = None) -> str:
        """`text` as the message of `role` after a model turn whose last sampled token is `last_sampled`: when that
        is the eos (the template's end-of-turn token) the returned text does not repeat it."""
        if not text:
            return ""
        close, before, after = self._frame(role)
        eos = self.tokenizer.eos_token or ""
        if last_sampled is not None and last_sampled == self.tokenizer.eos_token_id and close.startswith(eos):
            close = close[len(eos) :]
        return close + before + text + after

    def check(self) -> None:
        """Raise ValueError now, naming the problem, if the template cannot write observations between turns."""
        self._frame("user")
        self._frame("tool")

    def _frame(self, role: str) -> tuple[str, str, str]:
        """A `tool` message falls back to a `user` one when the template cannot write it."""
        if role not in self._frames:
            try:
                self._frames[role] = self._probe(role)
            except ValueError:
                if role == "user":
                    raise
                self._frames[role] = self._frame("user")
        return self._frames[role]

    def _probe(self, role: str) -> tuple[str, str, str]:
        """(close of the model turn, text before the observation, text after it)."""
        if not (self._template or getattr(self.tokenizer, "chat_template", None)):
            return "", "", ""
        user, assistant, observation = self.PROBE
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        message = {"role": role, "content": observation}
        if role == "tool":
            message["tool_call_id"] = "call_0"
        try:
            closed = self._render(messages, generation_prompt=False)
            full = self._render([*messages, message], generation_prompt=True)
        except Exception as e:  # jinja's TemplateError, or what the template raises itself
            raise ValueError(
                f"the chat template cannot render a {role!r} message after an assistant turn: {type(e).__name__}: {e}"
            ) from e
        if not full.startswith(closed) or assistant not in closed or observation not in full[len(closed) :]:
            raise ValueError(
                f"the chat template does not write a {role!r} message after an assistant turn as an extension of "
                f"the conversation so far (rendered {closed!r}, then {full!r}); multi-turn episodes need one that does"
            )
        before, after = full[len(closed) :].split(observation, 1)
        return closed[closed.rindex(assistant) + len(assistant) :], before, after

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self._template, add_generation_prompt=generation_prompt, tokenize=False
        )
