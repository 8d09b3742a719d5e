"""Hand-written fakes for the rollout worker: an engine without vLLM and a replay queue without Ray."""

from __future__ import annotations

import asyncio
from collections import Counter, deque

from asyncrl.testing import make_answer, make_prompt, make_request
from asyncrl.types import Exchange, Request, Trajectory


class _Remote:
    """Mimics a Ray actor method: `handle.method.remote(...)` returns an awaitable (of a plain method or of an
    async one, such as the real `ReplayQueue`'s)."""

    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        async def call():
            result = self._fn(*args, **kwargs)
            return await result if asyncio.iscoroutine(result) else result

        return call()


class InProcessHandle:
    """Stands in for the Ray actor handle of `target` without Ray: `handle.method.remote(...)` is an awaitable.
    `calls` counts the methods looked up, one per call made through the handle."""

    def __init__(self, target) -> None:
        self._target = target
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> _Remote:
        self.calls[name] += 1
        return _Remote(getattr(self._target, name))


class FakeQueue:
    """The replay queue API the worker uses, with conservation accounting.

    `in_flight[(group_id, sample_index)] = (worker, request)`; a put clears it; `requeue_worker` moves a
    worker's unfinished requests back to `pending` with the next attempt number. Its methods are plain, so
    the same fake serves in-process (through `InProcessHandle`) and as a Ray actor (`ray.remote(FakeQueue)`).
    """

    def __init__(self, requests: list[Request] = ()) -> None:
        self.pending: deque[Request] = deque(requests)
        self.in_flight: dict[tuple[str, int], tuple[str, Request]] = {}
        self.finished: list[Trajectory] = []
        self.finished_attempts: list[int] = []
        """The attempt of the request each of `finished` answered, as the queue recorded it."""
        self.put_calls = 0
        self.late = 0
        self.dispatched = 0

    def add(self, requests: list[Request]) -> None:
        self.pending.extend(requests)

    def acquire(self, worker: str, max_requests: int) -> list[Request]:
        out = []
        while self.pending and len(out) < max_requests:
            request = self.pending.popleft()
            self.in_flight[(request.group_id, request.sample_index)] = (worker, request)
            out.append(request)
        self.dispatched += len(out)
        return out

    def put(self, trajectories: list[Trajectory]) -> None:
        self.put_calls += 1
        for t in trajectories:
            owner = self.in_flight.get((t.group_id, t.sample_index))
            if owner is None or owner[0] != t.worker:
                self.late += 1
                continue
            del self.in_flight[(t.group_id, t.sample_index)]
            self.finished.append(t)
            self.finished_attempts.append(owner[1].attempt)

    def put_and_acquire(self, trajectories: list[Trajectory], worker: str, max_requests: int, timeout_s: float = 0.0) -> Exchange:
        """`put` (counted in `put_calls` only when it carries trajectories), then `acquire`; answers at once
        (`timeout_s` is the real queue's wait for work)."""
        finished = len(self.finished)
        if trajectories:
            self.put(trajectories)
        return Exchange(len(self.finished) - finished, self.acquire(worker, max_requests))

    def requeue_worker(self, worker: str) -> int:
        keys = [k for k, (w, _) in self.in_flight.items() if w == worker]
        for key in keys:
            _, request = self.in_flight.pop(key)
            self.pending.append(Request(**{**request.__dict__, "attempt": request.attempt + 1}))
        return len(keys)

    def snapshot(self) -> dict:
        """Counts a test polls through an actor handle (the fields themselves are not reachable there)."""
        return {
            "pending": len(self.pending),
            "in_flight": dict(Counter(w for w, _ in self.in_flight.values())),
            "finished": len(self.finished),
            "late": self.late,
            "dispatched": self.dispatched,
        }

    def take_finished(self) -> list[tuple[Trajectory, int]]:
        """(trajectory, attempt it answered) of every finished one since the last call."""
        out = list(zip(self.finished, self.finished_attempts))
        self.finished, self.finished_attempts = [], []
        return out


def make_requests(n: int, ground_truth: str = "7", prefix: str = "g") -> list[Request]:
    """`n` single-sample groups `<prefix>i` of prompts `pi`."""
    return [make_request(make_prompt(f"p{i}", [1, 4, 5], ground_truth), group_id=f"{prefix}{i}") for i in range(n)]


class FakeEngine:
    """Answers every request with `response` after `delay_s`; records the peak number of concurrent requests."""

    def __init__(self, name: str, response: str = "7", delay_s: float = 0.01) -> None:
        self.name = name
        self.response = response
        self.delay_s = delay_s
        self.started = False
        self.version = 0
        self.weight_load = "in_place"
        self.num_requests_done = 0
        self.num_tokens_generated = 0
        self.num_vllm_requests = 0
        self.running = 0
        self.peak_running = 0

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    async def generate(self, request: Request, sampling) -> Trajectory:
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.running -= 1
        n = len(self.response) + 1
        self.num_requests_done += 1
        self.num_vllm_requests += 1
        self.num_tokens_generated += n
        return make_answer(request, n, rollout_logprobs=0.0, versions=self.version, worker=self.name, response_text=self.response)
