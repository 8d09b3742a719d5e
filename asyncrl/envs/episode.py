"""`EpisodeBuilder`: one multi-turn episode assembled token by token into one `Trajectory`.

Token-exact across turns: the next turn's prompt is `context_ids` — the original prompt, then exactly the
tokens the engine sampled and the observation tokens appended since, never a conversation re-rendered through a
chat template and re-tokenized (that drift changes the tokens the learner scores from the ones the engine
sampled). Model tokens carry their rollout log-prob, `loss_mask` 1 and the policy version that produced them;
observation tokens carry log-prob 0, `loss_mask` 0 and the version of the model token before them (so they
never lower the trajectory's `min_version`, which is what staleness is measured on).
"""

from __future__ import annotations

from collections.abc import Sequence
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
