"""The tool-worker pool on real Ray with real sandboxes: calls through `ToolClient` from another actor (as a
rollout worker makes them), a tool worker SIGKILLed mid-call (the call fails promptly with `ToolInfraError`,
its sandboxed processes, the kept reward process included, die with it, the pool replaces the worker within
10 s, the next call succeeds), and the counts by tool and reason.

Tests run in file order on one module-scoped Ray session and pool of two workers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import ray

from asyncrl.config import ToolsConfig
from asyncrl.envs.tools.base import RewardError, ToolCall, ToolInfraError
from asyncrl.envs.tools.pool import ToolClient, ToolPool
from asyncrl.testing import SHORT_CONTEXT
from tests.unit.envs.test_sandbox import _all_gone, _processes_of

pytestmark = pytest.mark.integration

# Ray workers import this module (the `Caller` actor's class) and the user rewards of `sandbox_rewards`.
_ROOT = Path(__file__).resolve().parents[2]
_WORKER_PATH = (str(Path(__file__).parent), str(_ROOT / "tests/unit/envs"), str(_ROOT), os.environ.get("PYTHONPATH"))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in _WORKER_PATH if p)


class Caller:
    """Stands in for a rollout worker: holds a `ToolClient` (pickled into it, like `WorkerSpec.tools`)."""

    def __init__(self, client: ToolClient) -> None:
        self.client = client

    async def call(self, name: str, arguments: str, timeout_s: float = 5.0):
        began = time.monotonic()
        try:
            result = await self.client.call(ToolCall(name, arguments), timeout_s)
        except ToolInfraError as e:
            return ("infra", e.reason, time.monotonic() - began)
        return ("result", result, time.monotonic() - began)

    async def reward(self, reward: str, response: str, ground_truth: str):
        try:
            return await self.client.reward(reward, response, ground_truth, finish_reason="stop", extra_info={}, timeout_s=5.0)
        except RewardError as e:
            return f"reward_error: {e}"


@pytest.fixture(scope="module")
def pool(ray_cluster):
    tools = ToolsConfig(
        num_workers=2, num_cpus_per_worker=0.5, call_timeout_s=5.0, heartbeat_timeout_s=3.0, max_restarts_per_worker=1
    )
    pool = ToolPool(tools)
    pool.start()
    yield pool
    pool.shutdown()


def _caller(client: ToolClient):
    return ray.remote(Caller).options(num_cpus=0).remote(client)


def test_calls_through_the_client_from_another_actor(pool):
    caller = _caller(pool.client())
    kind, result, _ = ray.get(caller.call.remote("calculator", "12 * (3 + 4)"))
    assert (kind, result.ok, result.output) == ("result", True, "84")
    kind, result, _ = ray.get(caller.call.remote("python", "print(sum(i * i for i in range(4)))"))
    assert (kind, result.ok, result.output) == ("result", True, "14\n")
    kind, result, _ = ray.get(caller.call.remote("python", "import time\ntime.sleep(30)", 1.0))
    assert (kind, result.ok, result.error) == ("result", False, "timeout")
    assert ray.get(caller.reward.remote("sandbox_rewards:half", "7", "7")) == 0.5
    assert ray.get(caller.reward.remote("sandbox_rewards:wordy", "7", "7")).startswith("reward_error: returned str")
    assert pool.capabilities is not None and pool.capabilities.method in ("bwrap", "rlimits")


def test_counts_by_tool_and_reason(pool):
    before = pool.summary()
    caller = _caller(pool.client())
    calls = [("calculator", "1 + 1"), ("calculator", "2 ** 100"), ("python", "print(1)"), ("python", "raise ValueError('no')"), ("python", "bytearray(4 << 30)")]
    ray.get([caller.call.remote(name, arguments) for name, arguments in calls])
    after = pool.summary()
    added = {tool: after["calls"].get(tool, 0) - before["calls"].get(tool, 0) for tool in after["calls"]}
    assert added == {"calculator": 2, "python": 3, "reward": 0}
    errors = {tool: {r: n - before["errors"].get(tool, {}).get(r, 0) for r, n in reasons.items()} for tool, reasons in after["errors"].items()}
    assert errors["calculator"]["error"] == 1  # 2 ** 100 is longer than 60 digits
    assert (errors["python"]["error"], errors["python"]["memory"]) == (1, 1)


def test_worker_killed_mid_call_fails_the_call_and_is_replaced(pool):
    victim = pool.names[0]
    client = ToolClient((victim,), pool.client().namespace)  # every call of this caller goes to the victim
    caller = _caller(client)
    pid = ray.get(ray.get_actor(victim).pid.remote())
    assert ray.get(caller.reward.remote("sandbox_rewards:half", "7", "7")) == 0.5  # the victim keeps a reward process
    in_flight = caller.call.remote("python", "import time\ntime.sleep(20)\nprint('done')", 15.0)
    time.sleep(1.5)  # the program is running in the victim's sandbox
    uid = ray.get(ray.get_actor(victim).sandbox_uid.remote())  # the first of its leased block of uids
    assert not pool.capabilities.uid_dropped or len(_processes_of(uid)) >= 2  # the program and the kept reward process
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    kind, reason, seconds = ray.get(in_flight, timeout=30)
    assert (kind, reason) == ("infra", "tool_worker_died")
    assert seconds < 12.0  # promptly (the kill came 1.5 s in), not at the call's 15 s timeout
    if pool.capabilities.uid_dropped:  # the program, the kept reward process and the spare died with the worker
        assert _all_gone(uid)
    events = []
    while not events and time.monotonic() - killed_at < 10.0:
        events = [e for e in pool.poll() if e.worker == victim]
        time.sleep(0.2)
    assert [e.kind for e in events] == ["died"], "the dead worker was not noticed within 10 s"
    assert pool.summary()["workers_replaced"] == 1
    time.sleep(1.1)  # the caller's cached handle expires (HANDLE_TTL_S) and the name resolves to the replacement
    kind, result, _ = ray.get(caller.call.remote("python", "print('alive')"), timeout=60)
    assert (kind, result.output) == ("result", "alive\n")


def test_a_hung_worker_is_replaced_after_the_heartbeat_timeout(pool):
    victim = pool.names[1]
    assert pool.poll() == []  # it answered at start: the 3 s heartbeat timeout applies (not the start grace)
    os.kill(ray.get(ray.get_actor(victim).pid.remote()), signal.SIGSTOP)
    stopped_at = time.monotonic()
    events = []
    while not events and time.monotonic() - stopped_at < 10.0:
        events = [e for e in pool.poll() if e.worker == victim]
        time.sleep(0.2)
    assert [e.kind for e in events] == ["hung"] and time.monotonic() - stopped_at >= 3.0
    client = ToolClient((victim,), pool.client().namespace)
    result = asyncio.run(client.call(ToolCall("calculator", "6 * 7"), 5.0))
    assert result.output == "42"  # the replacement answers under the same name

def test_a_run_with_a_user_reward_scores_every_trajectory_in_the_tool_pool(pool, tiny_model_dir, tmp_path):
    """The controller starts its own pool for a `module:function` reward, hands its client to the engines,
    and reports the pool's counts in the summary."""
    from asyncrl.config import load_config
    from asyncrl.controller.loop import Controller

    overrides = {
        "output_dir": str(tmp_path / "run"), "model.path": str(tiny_model_dir), "rollout.samples_per_prompt": 2,
        "rollout.max_tokens": 4, "rollout.max_model_len": SHORT_CONTEXT, "buffer.filter_zero_variance": False, "algorithm.preset": "grpo", "learner.prompts_per_step": 2,
        "learner.max_steps": 2, "data.eval_prompts": 4, "eval.every_steps": 0, "telemetry.progress": False,
        "checkpoint.export_hf": False, "env.reward": "sandbox_rewards:half", "tools.num_workers": 1, "learner.compile": False,
    }  # fmt: skip
    controller = Controller(load_config(None, [f"{k}={v}" for k, v in overrides.items()]), tiny_model_dir)
    try:
        controller.start()
        summary = controller.run()
        counters = controller.fleet.queue.check_conservation()  # raises unless dispatched = trained + ... + in flight
    finally:
        controller.shutdown()
    tools = summary["tools"]
    assert tools["errors"] == {} and tools["sandbox"]["method"] == pool.capabilities.method
    assert tools["calls"]["reward"] >= summary["samples_trained"] == 8  # 2 steps x 2 prompts x 2 samples
    assert {k: v for k, v in counters.items() if k.startswith("failed:") and v} == {}


def test_a_worker_past_its_restart_budget_is_quarantined_and_calls_go_to_the_other(pool):
    """Runs last: the first worker was replaced once already (its budget, `max_restarts_per_worker=1`)."""
    victim, other = pool.names
    assert pool.summary()["workers_replaced"] == 2 and pool.healthy == 2
    os.kill(ray.get(ray.get_actor(victim).pid.remote()), signal.SIGKILL)
    killed_at, events = time.monotonic(), []
    while not events and time.monotonic() - killed_at < 10.0:
        events = [e for e in pool.poll() if e.worker == victim]
        time.sleep(0.2)
    assert [e.kind for e in events] == ["died", "quarantined"]
    assert str(events[1]) == f"tool worker {victim} quarantined, not replaced: its restart budget is spent (1 restarts)"
    assert pool.healthy == 1 and pool.summary()["quarantined"] == {victim: "its restart budget is spent (1 restarts)"}
    caller = _caller(pool.client())
    answers = ray.get([caller.call.remote("calculator", f"{i} + 1") for i in range(4)], timeout=60)
    assert [(kind, result.output) for kind, result, _ in answers] == [("result", str(i + 1)) for i in range(4)]
    assert pool.poll() == [] and pool.healthy == 1  # the quarantined name stays unanswered and unreplaced
