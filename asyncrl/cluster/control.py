"""The control API of a running job: a named Ray actor that the controller reads between steps.

`asyncrl scale JOB rollout=N` reaches it from anywhere the Jobs API reaches: it submits a tiny Ray job that
runs `python -m asyncrl.cluster.control JOB rollout=N` on the cluster, which sets the wanted pool size on
the job's control actor. The controller polls the actor every `POLL_S` and grows or shrinks the rollout pool
(new engines load the current weights before they serve; a removed engine's requests are re-dispatched).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from asyncrl.cluster.calls import named_get

NAMESPACE = "asyncrl"
POLL_S = 2.0
"""How often the controller reads the wanted sizes."""
JOB_ENV = "ASYNCRL_JOB_ID"
"""Set by `asyncrl submit` in the job's environment: the job id names the control actor."""


def actor_name(job_id: str) -> str:
    return f"control:{job_id}"


class Control:
    """Wanted pool sizes of one job (None = as configured); set by `scale`, read by the controller."""

    def __init__(self) -> None:
        self.rollout: int | None = None
        self.requested_at: float | None = None

    def set_rollout(self, workers: int) -> int:
        if workers < 1:
            raise ValueError(f"rollout pool size must be >= 1 (got {workers})")
        self.rollout, self.requested_at = workers, time.time()
        return workers

    def wanted(self) -> tuple[int | None, float | None]:
        return self.rollout, self.requested_at


@dataclass
class ControlClient:
    """The controller's side: creates the job's control actor and reads it at most every `POLL_S`."""

    handle: Any  # the Ray actor handle of `Control`: its remote methods are attributes made at run time
    last_poll: float = 0.0

    @classmethod
    def start(cls, job_id: str) -> ControlClient:
        import ray

        actor = ray.remote(Control).options(
            name=actor_name(job_id), namespace=NAMESPACE, num_cpus=0, get_if_exists=True
        )
        return cls(actor.remote())

    def wanted_rollout(self) -> tuple[int | None, float | None]:
        """(wanted rollout workers, wall time of the request), or (None, None) between polls."""
        if time.monotonic() - self.last_poll < POLL_S:
            return None, None
        self.last_poll = time.monotonic()
        return named_get(self.handle.wanted.remote(), 30, "the job's control actor: wanted")

    def set_rollout(self, workers: int) -> int:
        """What `asyncrl scale` does, from the controller's process (the dashboard's scale control)."""
        return named_get(self.handle.set_rollout.remote(workers), 30, "the job's control actor: set_rollout")


class LocalControl:
    """The control of a run that is not a Ray job (`asyncrl run` here): the dashboard sets the wanted size in
    the controller's own process, and the controller reads it the same way as a job's control actor."""

    def __init__(self) -> None:
        self._control = Control()
        self._lock = threading.Lock()  # set from the dashboard's HTTP thread, read by the loop

    def set_rollout(self, workers: int) -> int:
        with self._lock:
            return self._control.set_rollout(workers)

    def wanted_rollout(self) -> tuple[int | None, float | None]:
        with self._lock:
            return self._control.wanted()


def _scale_from_inside(job_id: str, rollout: int) -> None:
    """Runs on the cluster (as a tiny Ray job): set the wanted size on the job's control actor."""
    import ray

    ray.init(namespace=NAMESPACE, log_to_driver=False)
    try:
        control = ray.get_actor(actor_name(job_id), namespace=NAMESPACE)
    except ValueError:
        raise SystemExit(
            f"job {job_id} has no control actor (is it running, and was it started by `asyncrl submit`?)"
        ) from None
    workers = named_get(control.set_rollout.remote(rollout), 30, f"control actor of job {job_id}: set_rollout")
    print(f"{job_id}: rollout pool -> {workers} workers")


def parse_sizes(items: list[str]) -> dict[str, int]:
    """`rollout=3` -> {"rollout": 3}; only the rollout pool scales live (the learner via checkpoint + resume)."""
    sizes = {}
    for item in items:
        pool, _, value = item.partition("=")
        if pool != "rollout" or not value.isdigit():
            raise ValueError(
                f"cannot scale {item!r}: use rollout=N "
                "(the learner pool is resized by checkpoint and resume with learner.num_ranks)"
            )
        sizes[pool] = int(value)
    return sizes


if __name__ == "__main__":
    _scale_from_inside(sys.argv[1], parse_sizes(sys.argv[2:])["rollout"])
