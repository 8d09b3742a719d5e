"""Hand-written fakes for the replay-queue tests: a settable clock, prompts, and a rollout answer."""

from __future__ import annotations

import numpy as np

from asyncrl.config import BufferConfig
from asyncrl.types import Prompt, Request, Trajectory


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_config(**overrides) -> BufferConfig:
    """Filters off and no Parquet log unless a test turns them on."""
    base = dict(filter_zero_variance=False, filter_overlong=False, pass_rate_curriculum=False, log_parquet=False)
    base.update(overrides)
    return BufferConfig(**base)


def make_prompts(n: int, prefix: str = "p") -> list[Prompt]:
    return [Prompt(prompt_id=f"{prefix}{k}", prompt_ids=[1, 2, 3 + k % 5], ground_truth=str(k)) for k in range(n)]


def answer(
    request: Request,
    *,
    reward: float = 0.0,
    version: int | list[int] = 0,
    finish_reason: str = "stop",
    failure: str | None = None,
    worker: str = "w0",
    length: int = 3,
    attempt: int | None = -1,
) -> Trajectory:
    """The trajectory a rollout worker would put for `request`; `version` per token or one for all;
    `attempt` -1 = the request's own attempt."""
    versions = np.asarray(version if isinstance(version, list) else [version] * length, dtype=np.int32)
    length = len(versions)
    return Trajectory(
        prompt_id=request.prompt.prompt_id,
        group_id=request.group_id,
        sample_index=request.sample_index,
        prompt_ids=np.asarray(request.prompt.prompt_ids, dtype=np.int32),
        response_ids=np.arange(length, dtype=np.int32),
        rollout_logprobs=np.full(length, -0.5, dtype=np.float32),
        loss_mask=np.ones(length, dtype=np.int8),
        versions=versions,
        finish_reason=finish_reason,
        ground_truth=request.prompt.ground_truth,
        reward=reward,
        failure=failure,
        worker=worker,
        attempt=request.attempt if attempt == -1 else attempt,
        dispatch_version=int(versions.min()) if length else 0,
    )
