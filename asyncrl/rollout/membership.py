"""How rollout workers enter and leave the pool: the record of a worker on its way into service, the events the
pool reports (deaths, hangs, joins, failed starts), and the heartbeat that finds a worker alive but hung."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from asyncrl.models.shipping import ShippedModel, materialise
from asyncrl.rollout.worker import RolloutWorker, WorkerSpec

HEARTBEAT_TURN_S = 1.0
"""A weight sync's wait checks for hung engines this often."""
SILENT_S = 5.0
"""A worker whose ping has gone unanswered this long is not waited for by the pool's counters call (`stats`)."""


class NodeLocalRolloutWorker(RolloutWorker):
    """A `RolloutWorker` whose engine loads the model from its own node: a shipped preset is unpacked into the
    node's cache first (its `spec.model_dir` is the driver's path, which another node may not have)."""

    def __init__(self, name: str, spec: WorkerSpec, queue: Any = None, *, model: ShippedModel | None = None) -> None:
        if model is not None:
            spec = dataclasses.replace(spec, model_dir=str(materialise(model)))
        super().__init__(name, spec, queue)


class WorkerStartError(RuntimeError):
    """A rollout worker's engine did not come up within `engine_start_timeout_s` (the message names it)."""


def start_failure(e: BaseException) -> str:
    """What a worker's failed start reports: the worker's own exception, not Ray's wrapper of it (whose text is
    the remote traceback, tens of lines for one cause)."""
    cause = getattr(e, "cause", None)
    if not isinstance(cause, BaseException):
        cause = e
    return f"{type(cause).__name__}: {cause}"


class WorkerDiedError(RuntimeError):
    """A rollout worker died and the pool does not replace dead workers (`rollout.replace_dead_workers`)."""


@dataclass
class Joining:
    """A started worker on its way into service: its placement group being placed (`placed`), engine starting
    (`ready`), then loading `version` (`sync`)."""

    handle: Any
    ready: Any
    began: float
    placed: Any = None
    engine_began: float = 0.0
    """When the placement group was placed: the engine's start timeout counts from here."""
    sync: Any = None
    version: int | None = None


@dataclass(frozen=True)
class PoolEvent:
    """Something that happened to a worker, reported by `poll` for the controller's log and metrics."""

    worker: str
    kind: str
    """`died` (its requests re-dispatched, `replacement` started), `hung` (alive but it missed a heartbeat: killed,
    then handled as `died`), `joined` (serves `version`, `seconds` after its start), `failed_to_start` (`detail`
    says why; a `replacement` when it was restarted) or `quarantined` (`worker` names the engine slot that is no
    longer restarted, `detail` why)."""
    requeued: int = 0
    replacement: str | None = None
    version: int | None = None
    seconds: float = 0.0
    detail: str = ""
    wall: float = dataclasses.field(default_factory=time.time)
    """`time.time()` when the pool saw it happen (a death or hang found during a weight sync's or an
    evaluation's wait is reported at the next `poll`)."""

    def __str__(self) -> str:
        if self.kind in ("died", "hung"):
            what = "died" if self.kind == "died" else f"hung ({self.detail}), killed"
            return f"rollout worker {self.worker} {what}: {self.requeued} requests re-dispatched" + (
                f", replaced by {self.replacement}" if self.replacement else ""
            )
        if self.kind == "joined":
            weights = "its initial weights" if self.version is None else f"version {self.version}"
            return f"rollout worker {self.worker} serves {weights} ({self.seconds:.1f}s after its start)"
        if self.kind == "quarantined":
            return f"rollout engine slot {self.worker} quarantined, not restarted again: {self.detail}"
        restarted = f"; restarted as {self.replacement}" if self.replacement else ""
        return f"rollout worker {self.worker} failed to start: {self.detail}{restarted}"


class Heartbeat:
    """Finds serving workers that are alive but hung, without waiting: each `missed` call pings every worker
    that has no ping outstanding (a cheap `version` call) and names those whose ping has gone unanswered for
    `timeout_s`. A dead worker is not its business: its ping fails at once, and its `run` call reports the death."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pings: dict[str, tuple[Any, float]] = {}
        """Worker name -> (its outstanding ping, when it was sent)."""

    def missed(self, workers: dict[str, Any]) -> list[str]:
        """The workers of `workers` (name -> actor handle) whose ping is older than `timeout_s` and unanswered."""
        now = time.monotonic()
        self._pings = {name: ping for name, ping in self._pings.items() if name in workers}
        refs = [ref for ref, _ in self._pings.values()]
        answered = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        hung = []
        for name, handle in workers.items():
            ping = self._pings.get(name)
            if ping is None or ping[0] in answered:
                self._pings[name] = (handle.version.remote(), now)
            elif now - ping[1] > self.timeout_s:
                hung.append(name)
                del self._pings[name]
        return hung

    def silent(self, name: str) -> bool:
        """Whether the worker has left its ping unanswered for more than `SILENT_S` (a live worker answers in
        milliseconds, even while it loads weights): calls that would wait for it can skip it."""
        ping = self._pings.get(name)
        if ping is None or time.monotonic() - ping[1] <= SILENT_S:
            return False
        return not ray.wait([ping[0]], timeout=0)[0]


def wait_in_turns(refs: list[Any], timeout_s: float, between: Callable[[list[Any]], list[Any]]) -> tuple[list, list]:
    """`ray.wait` for all of `refs` for at most `timeout_s`, in turns of `HEARTBEAT_TURN_S`: after each turn that
    leaves calls waiting, `between(waiting)` runs (the heartbeat's kill-and-replace, say) and returns the calls
    still worth waiting for. -> (finished, still waiting)."""
    done: list[Any] = []
    waiting, deadline = list(refs), time.monotonic() + timeout_s
    while waiting and (left := deadline - time.monotonic()) > 0:
        ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=min(left, HEARTBEAT_TURN_S))
        done += ready
        if waiting:
            waiting = between(waiting)
    return done, waiting


def died(ref: Any) -> bool:
    """Whether a finished call failed because its actor died."""
    try:
        ray.get(ref, timeout=0)
    except RayActorError:
        return True
    except Exception:
        return False
    return False


def wait_or_say(calls: dict[Any, str], what: str, timeout_s: float) -> None:
    """Wait for best-effort calls (object ref -> worker name); the run goes on without a late worker (it is
    killed or re-queued next), but the log says whose `what` did not answer."""
    _, late = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
    if late:
        print(
            f"[rollout pool] {what}: no answer within {timeout_s:.0f}s "
            f"from {', '.join(calls[r] for r in late)}; going on",
            flush=True,
        )
