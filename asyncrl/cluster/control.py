"""The control API of a running job: a named Ray actor that the controller reads between steps.

`asyncrl scale JOB rollout=N learner=M` reaches it from anywhere the Jobs API reaches: it submits a tiny Ray
job that runs `python -m asyncrl.cluster.control JOB rollout=N learner=M` on the cluster, which sets the wanted
pool sizes on the job's control actor. The controller polls the actor every `POLL_S`. It grows or shrinks the
rollout pool between steps (new engines load the current weights before they serve; a removed engine's
requests are re-dispatched), and re-forms the learner pool at the next step boundary (checkpoint, new ranks,
re-sharded restore: `Controller._resize_learner`).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from asyncrl.cluster.calls import named_get

NAMESPACE = "asyncrl"
POLL_S = 2.0
"""How often the controller reads the wanted sizes."""
JOB_ENV = "ASYNCRL_JOB_ID"
"""Set by `asyncrl submit` in the job's environment: the job id names the control actor."""


def actor_name(job_id: str) -> str:
    return f"control:{job_id}"


POOLS = ("rollout", "learner")
"""The pools `scale` resizes."""


@dataclass(frozen=True)
class Wanted:
    """The pool sizes asked for (None = as configured) and the wall time of each request."""

    rollout: int | None = None
    learner: int | None = None
    rollout_at: float | None = None
    learner_at: float | None = None


class Control:
    """Wanted pool sizes of one job; set by `scale`, read by the controller."""

    def __init__(self) -> None:
        self._wanted = Wanted()

    def set_size(self, pool: str, size: int) -> int:
        """Ask for `size` workers (rollout engines) or ranks (learner) in `pool`; -> `size`."""
        if pool not in POOLS:
            raise ValueError(f"cannot scale pool {pool!r}: the pools are {', '.join(POOLS)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{pool} pool size must be an integer >= 1 (got {size!r})")
        at: dict[str, Any] = {pool: size, f"{pool}_at": time.time()}
        self._wanted = replace(self._wanted, **at)
        return size

    def wanted(self) -> Wanted:
        return self._wanted


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

    def poll(self) -> Wanted | None:
        """The wanted sizes, or None between polls."""
        if time.monotonic() - self.last_poll < POLL_S:
            return None
        self.last_poll = time.monotonic()
        return named_get(self.handle.wanted.remote(), 30, "the job's control actor: wanted")

    def set_size(self, pool: str, size: int) -> int:
        """What `asyncrl scale` does, from the controller's process (the dashboard's scale control)."""
        return named_get(self.handle.set_size.remote(pool, size), 30, "the job's control actor: set_size")


class LocalControl:
    """The control of a run that is not a Ray job (`asyncrl run` here): the dashboard sets the wanted size in
    the controller's own process, and the controller reads it the same way as a job's control actor."""

    def __init__(self) -> None:
        self._control = Control()
        self._lock = threading.Lock()  # set from the dashboard's HTTP thread, read by the loop

    def set_size(self, pool: str, size: int) -> int:
        with self._lock:
            return self._control.set_size(pool, size)

    def poll(self) -> Wanted:
        with self._lock:
            return self._control.wanted()


def _scale_from_inside(job_id: str, sizes: dict[str, int]) -> None:
    """Runs on the cluster (as a tiny Ray job): set the wanted sizes on the job's control actor."""
    import ray

    ray.init(namespace=NAMESPACE, log_to_driver=False)
    try:
        control = ray.get_actor(actor_name(job_id), namespace=NAMESPACE)
    except ValueError:
        raise SystemExit(
            f"job {job_id} has no control actor (is it running, and was it started by `asyncrl submit`?)"
        ) from None
    for pool, size in sizes.items():
        got = named_get(control.set_size.remote(pool, size), 30, f"control actor of job {job_id}: set_size")
        print(f"{job_id}: {pool} pool -> {got} {UNITS[pool]}")


UNITS = {"rollout": "workers", "learner": "ranks"}


def parse_sizes(items: list[str]) -> dict[str, int]:
    """`rollout=3 learner=2` -> {"rollout": 3, "learner": 2}."""
    sizes = {}
    for item in items:
        pool, _, value = item.partition("=")
        if pool not in POOLS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"cannot scale {item!r}: use rollout=N and/or learner=N (N >= 1)")
        sizes[pool] = int(value)
    return sizes


def sizes_argument(sizes: dict[str, int]) -> str:
    """The inverse of `parse_sizes`: the arguments of the scale job's command line."""
    return " ".join(f"{pool}={size}" for pool, size in sizes.items())


if __name__ == "__main__":
    _scale_from_inside(sys.argv[1], parse_sizes(sys.argv[2:]))
