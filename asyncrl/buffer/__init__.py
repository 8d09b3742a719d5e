"""The staleness-bounded replay queue between the rollout pool and the learner.

`core.ReplayQueueCore` holds all the logic (deterministic, no Ray) and keeps its books in `ledger.Ledger`;
`actor.ReplayQueue` is the async Ray actor around it; `client.QueueClient` is the driver's typed handle on
that actor (`client.start_replay_queue` starts both); `filters`, `starvation` and `storage` (Arrow / Parquet)
are its parts.
"""

from asyncrl.buffer.actor import ReplayQueue
from asyncrl.buffer.client import QueueCallTimeout, QueueClient, QueueTimeouts, start_replay_queue
from asyncrl.buffer.core import ReplayQueueCore
from asyncrl.buffer.ledger import ConservationError
from asyncrl.buffer.starvation import Starvation, StarvedError

__all__ = [
    "ConservationError",
    "QueueCallTimeout",
    "QueueClient",
    "QueueTimeouts",
    "ReplayQueue",
    "ReplayQueueCore",
    "Starvation",
    "StarvedError",
    "start_replay_queue",
]
