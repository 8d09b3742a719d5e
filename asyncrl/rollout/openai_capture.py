"""Token-exact capture of agent-harness episodes served by the OpenAI-compatible endpoint.

An agent harness sends the whole conversation on every call. The endpoint renders it with the chat template, but it
never re-tokenizes what the model already sampled: when the rendered text extends the episode's context — the
previous call's rendered prompt followed by the text of the tokens the model sampled — the exact context tokens are
reused and only the new text after them is tokenized (an observation: `loss_mask` 0). The sampled text is tried
twice: with special tokens (a template that renders the end-of-turn token the model sampled, e.g. Qwen's
`<|im_end|>`), then as returned to the harness (a template that does not render the stop token or stop string:
the sampled tokens stay in the context, the engine saw them).

Drift policy: when the rendered conversation does not extend the context (the harness edited or dropped history, or
two calls of one episode overlapped), the episode's `drifts` counter goes up and a new segment starts whose prompt is
the whole rendered conversation, tokenized. The episode's trajectory is its last segment: every token in it is one the
engine saw, in order; the model tokens of earlier segments are not trained (`dropped_model_tokens`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.envs.episode import EpisodeBuilder
from asyncrl.types import Trajectory


class ChatRenderer:
    """The chat template and the tokenizer as the endpoint uses them: render to text, tokenize without adding
    special tokens (the template writes them), decode with or without special tokens."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template or tokenizer.chat_template

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict] | None = None,
        *,
        generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            chat_template=self.chat_template,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def decode(self, ids: Sequence[int] | np.ndarray, *, specials: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=not specials)


@dataclass(frozen=True)
class SampledTurn:
    """One call's rendered prompt and the two texts of what the model sampled: `full` (special tokens written out)
    and `visible` (the completion returned to the harness: special tokens skipped, cut before a stop string)."""

    prompt_text: str
    full: str
    visible: str

    def continuation(self, rendered: str) -> str | None:
        """The text `rendered` adds after this turn, or None when it does not extend it."""
        for sampled in (self.full, self.visible):
            head = self.prompt_text + sampled
            if rendered.startswith(head):
                return rendered[len(head) :]
        return None


@dataclass(frozen=True)
class PromptPlan:
    """What one call feeds the engine. `restart`: a new segment whose prompt is `prompt_ids`; otherwise
    `observation` is appended to the episode's context and `prompt_ids` is that context."""

    rendered: str
    prompt_ids: list[int]
    observation: list[int]
    restart: bool


@dataclass
class CapturedEpisode:
    """An episode's calls so far: the current segment's builder and the counters of the drift policy."""

    builder: EpisodeBuilder | None = None
    last: SampledTurn | None = None
    last_finish_reason: str = "stop"
    calls: int = 0
    drifts: int = 0
    dropped_model_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    """The visible text of each model turn of the current segment (the trajectory's `response_text`)."""

    def trajectory(self, **fields: Any) -> Trajectory:
        """The trajectory of the last segment; `fields` are the `Trajectory` fields the episode does not know
        (prompt_id, group_id, reward, ...). The finish reason defaults to the last call's."""
        if self.builder is None:
            raise ValueError("the episode made no model call")
        fields.setdefault("finish_reason", self.last_finish_reason)
        return self.builder.build(response_text="".join(self.texts), **fields)


class EpisodeCapture:
    """The open episodes of one endpoint, by episode id. `plan` a call, run it, then `record` it (a call that
    failed is never recorded, so a harness may retry it); `finish` closes the episode. `idle` lists the episodes
    whose last call was recorded more than a TTL ago on `clock` (seconds), `expire` drops one."""

    def __init__(self, renderer: ChatRenderer, clock: Callable[[], float] = time.monotonic) -> None:
        self.renderer = renderer
        self.episodes: dict[str, CapturedEpisode] = {}
        self.drifts = 0
        self.expired = 0
        self.clock = clock
        self._touched: dict[str, float] = {}

    def fork(self, episode_id: str, branch_id: str) -> None:
        """Open `branch_id` as a copy of `episode_id` as it is now (nothing, for an episode not yet open): the
        branch of one of a call's `n` choices, sharing the episode so far as its prefix."""
        if branch_id in self.episodes:
            raise ValueError(f"episode {branch_id!r} is open: finish it before a call branches into it")
        if episode_id in self.episodes:
            self.episodes[branch_id] = copy.deepcopy(self.episodes[episode_id])
            self._touched[branch_id] = self.clock()

    def idle(self, ttl_s: float) -> list[str]:
        now = self.clock()
        return [e for e, at in self._touched.items() if now - at > ttl_s]

    def expire(self, episode_id: str) -> None:
        if self.episodes.pop(episode_id, None) is not None:
            self.expired += 1
        self._touched.pop(episode_id, None)

    def plan(self, episode_id: str | None, rendered: str) -> PromptPlan:
        episode = self.episodes.get(episode_id) if episode_id is not None else None
        if episode is not None and episode.builder is not None and episode.last is not None:
            suffix = episode.last.continuation(rendered)
            if suffix is not None:
                observation = self.renderer.encode(suffix)
                return PromptPlan(rendered, episode.builder.context_ids + observation, observation, restart=False)
        return PromptPlan(rendered, self.renderer.encode(rendered), [], restart=True)

    def record(self, episode_id: str, plan: PromptPlan, completion: Trajectory, visible: str) -> CapturedEpisode:
        """Add one finished call (its engine trajectory and the text returned to the harness) to the episode."""
        episode = self.episodes.setdefault(episode_id, CapturedEpisode())
        if plan.restart:
            if episode.builder is not None:
                self._count_drift(episode, episode.builder)
            builder = EpisodeBuilder(plan.prompt_ids, completion.dispatch_version)
            episode.builder, episode.texts = builder, []
        elif episode.builder is None:
            raise ValueError(f"episode {episode_id!r} continues a call that was never recorded")
        else:
            builder = episode.builder
            builder.add_observation(plan.observation)
        # tolist: the builder takes sequences of Python numbers (it converts each element either way)
        builder.add_model_turn(
            completion.response_ids.tolist(), completion.rollout_logprobs.tolist(), completion.versions.tolist()
        )
        full = self.renderer.decode(completion.response_ids, specials=True)
        episode.last = SampledTurn(plan.rendered, full, visible)
        episode.last_finish_reason = completion.finish_reason
        episode.calls += 1
        episode.texts.append(visible)
        self._touched[episode_id] = self.clock()
        return episode

    def _count_drift(self, episode: CapturedEpisode, builder: EpisodeBuilder) -> None:
        episode.drifts += 1
        episode.dropped_model_tokens += sum(builder.mask)
        self.drifts += 1

    def finish(self, episode_id: str) -> CapturedEpisode:
        """Close the episode; KeyError names an episode id the endpoint never served."""
        self._touched.pop(episode_id, None)
        try:
            return self.episodes.pop(episode_id)
        except KeyError:
            raise KeyError(
                f"no open episode {episode_id!r} on this endpoint (never served, finished, or idle past its TTL)"
            ) from None
