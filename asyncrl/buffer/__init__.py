"""The staleness-bounded replay queue between the rollout pool and the learner.

`core.ReplayQueueCore` holds all the logic (deterministic, no Ray); `actor.ReplayQueue` is the async Ray
actor around it; `filters` and `storage` (Arrow / Parquet) are its parts.
"""

from asyncrl.buffer.actor import ReplayQueue, start_replay_queue
from asyncrl.buffer.core import ConservationError, ReplayQueueCore

__all__ = ["ConservationError", "ReplayQueue", "ReplayQueueCore", "start_replay_queue"]
