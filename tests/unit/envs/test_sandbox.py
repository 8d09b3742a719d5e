"""The sandbox contains hostile programs and reports them as tool errors while the worker goes on.

Every test runs real subprocess sandboxes (bwrap where installed). Where this machine cannot enforce a check,
the test asserts that the capability record says so instead of passing silently. Each test uses its own uid
(when root) so that "no process of the run is left" can be checked by scanning /proc for that uid.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.envs.tools.isolation import UIDS_PER_SANDBOX, detect_capabilities, lease_uid_block
from asyncrl.envs.tools.processes import RewardItem
from asyncrl.envs.tools.sandbox import Sandbox, SandboxLimits
from asyncrl.envs.tools.base import ToolCall, ToolInfraError
from asyncrl.envs.tools.pool import ToolWorker
from asyncrl.envs.tools.python import run_python

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2, memory_bytes=512 << 20, processes=16, file_bytes=1 << 20, output_bytes=200)
CAPS = detect_capabilities()


def block(k: int) -> int:
    """The first uid of test k's sandbox: each test's uids are its own (`UIDS_PER_SANDBOX` from there)."""
    return 201_000 + UIDS_PER_SANDBOX * k


def _processes_of(uid: int) -> list[int]:
    """Host pids whose real uid is one of the sandbox's block from `uid` (a sandboxed run's leftovers)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if uid <= int(uid_line.split()[1]) < uid + UIDS_PER_SANDBOX:
            found.append(int(status.parent.name))
    return found


def _all_gone(uid: int, grace_s: float = 2.0) -> bool:
    """No process of `uid` is left after `grace_s` (the kernel tears a killed PID namespace down asynchronously)."""
    deadline = time.monotonic() + grace_s
    while _processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _processes_of(uid) == []


def _run(source: str, uid: int, limits: SandboxLimits = LIMITS):
    """Run `source`, then `print(6 * 7)` in the same sandbox (the worker goes on); both tool results."""

    async def both():
        sandbox = Sandbox(limits, uid)
        try:
            return await run_python(sandbox, source, limits.wall_s), await run_python(sandbox, "print(6 * 7)", limits.wall_s)
        finally:
            await sandbox.close()

    bad, good = asyncio.run(both())
    assert (good.ok, good.output) == (True, "42\n")
    return bad


def test_capability_record_matches_the_machine():
    if CAPS.method == "bwrap":
        assert CAPS.network_isolated and CAPS.pid_namespace and CAPS.host_hidden and CAPS.private_tmp
        assert CAPS.uid_dropped == (os.geteuid() == 0)
    else:
        assert not CAPS.network_isolated and not CAPS.pid_namespace and "bwrap" in CAPS.detail
    assert str(CAPS).startswith(f"sandbox: {CAPS.method} (")


def test_a_program_runs_and_prints():
    result = _run("import sys\nprint(sum(range(10)))\nprint('oops', file=sys.stderr)", uid=block(1))
    assert (result.ok, result.error, result.output) == (True, None, "45\noops\n")


def test_infinite_loop_is_stopped_by_a_limit():
    result = _run("while True:\n    pass", uid=block(2), limits=SandboxLimits(wall_s=3.0, cpu_s=1))
    assert not result.ok and result.error in ("cpu_time", "timeout")
    assert result.seconds < 3.0 + 1.0


def test_fork_bomb_is_contained_and_leaves_no_process():
    if not CAPS.nproc_enforced:
        assert os.geteuid() == 0 and not CAPS.uid_dropped  # root without a uid to drop to: RLIMIT_NPROC cannot hold
        return
    bomb = "import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(60)\n"
    result = _run(bomb, uid=block(3))
    assert (result.ok, result.error) == (False, "error")
    assert "BlockingIOError" in result.output or "Resource temporarily unavailable" in result.output
    if CAPS.uid_dropped:
        assert _all_gone(block(3))  # the sleeping children died with the run


def test_a_run_gets_its_whole_process_limit_while_other_processes_of_the_sandbox_live():
    """RLIMIT_NPROC counts per uid: with a reward process kept and the next spare started, a program may still
    hold `processes` processes (itself and its children); were all three under one uid it could not."""
    if not CAPS.uid_dropped:
        pytest.skip("each run gets its own uid only when we are root (the capability record says uid_dropped)")
    children = LIMITS.processes - 2  # with the program itself: one below the limit, two above it under one uid
    program = (f"import os, time\npids = []\nfor _ in range({children}):\n    pid = os.fork()\n    if pid == 0:\n"
               "        time.sleep(1)\n        os._exit(0)\n    pids.append(pid)\nfor pid in pids:\n    os.waitpid(pid, 0)\nprint('forked', len(pids))")  # fmt: skip

    async def kept_reward_then_program():
        sandbox = Sandbox(LIMITS, block(21))
        try:
            kept = await sandbox.run_rewards("sandbox_rewards:half", [RewardItem("7", "7", "stop", {}, 5.0)])
            return kept, await run_python(sandbox, program, 10.0), len(sandbox._leased)
        finally:
            await sandbox.close()

    kept, result, live = asyncio.run(kept_reward_then_program())
    assert kept[0].value == 0.5 and live == 3  # the kept reward process, the reward's spare and the program's
    assert (result.ok, result.output) == (True, f"forked {children}\n"), result.output


def test_a_cancelled_program_is_killed_and_its_uid_freed():
    async def cancelled():
        sandbox = Sandbox(LIMITS, block(22))
        try:
            call = asyncio.ensure_future(run_python(sandbox, "import time\nprint('started', flush=True)\ntime.sleep(30)", 40.0))
            await asyncio.sleep(1.5)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            return set(sandbox._leased)
        finally:
            await sandbox.close()

    leased = asyncio.run(cancelled())
    assert block(22) not in leased and len(leased) == 1  # only the spare's
    if CAPS.uid_dropped:
        assert _all_gone(block(22))  # the sleeping program did not outlive its call


def test_uids_are_leased_round_robin_one_per_live_process_and_run_out_with_a_clear_error():
    sandbox = Sandbox(LIMITS, 300_000)
    assert [sandbox._lease_uid() for _ in range(3)] == [300_000, 300_001, 300_002]
    sandbox._leased.discard(300_000)  # its process ended
    assert sandbox._lease_uid() == 300_003  # a freed uid is reused as late as possible
    assert [sandbox._lease_uid() for _ in range(UIDS_PER_SANDBOX - 4)][-1] == 300_000 + UIDS_PER_SANDBOX - 1
    assert sandbox._lease_uid() == 300_000  # the only free one
    with pytest.raises(ToolInfraError, match=f"all {UIDS_PER_SANDBOX} uids from 300000 are held"):
        sandbox._lease_uid()


HOLDER = "import sys, time\nfrom pathlib import Path\nfrom asyncrl.envs.tools.isolation import lease_uid_block\nprint(lease_uid_block(310_000, Path(sys.argv[1]))[0], flush=True)\ntime.sleep(60)"


@pytest.mark.skipif(os.geteuid() != 0, reason="uids are leased only as root (there is no uid drop otherwise)")
def test_a_uid_block_is_leased_once_per_machine_skips_live_uids_and_is_freed_when_its_holder_is_killed(tmp_path):
    locks, base, size = tmp_path / "locks", 310_000, UIDS_PER_SANDBOX
    first, first_lock = lease_uid_block(base, locks)
    second, _ = lease_uid_block(base, locks)
    assert (first, second) == (base, base + size)  # the first block is held
    os.close(first_lock)  # its worker ended, but a process it left behind still runs under one of its uids
    squatter = subprocess.Popen(["setpriv", f"--reuid={base + 5}", f"--regid={base + 5}", "--clear-groups", "sleep", "30"])
    try:
        deadline = time.monotonic() + 5
        while not _processes_of(base + 5) and time.monotonic() < deadline:  # the squatter runs under its uid
            time.sleep(0.05)
        assert lease_uid_block(base, locks)[0] == base + 2 * size
    finally:
        squatter.kill()
        squatter.wait()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(locks)], stdout=subprocess.PIPE, text=True)
    assert int(holder.stdout.readline()) == base  # free again once the squatter is gone; another process holds it
    assert lease_uid_block(base, locks)[0] == base + 3 * size
    holder.kill()
    holder.wait()
    assert lease_uid_block(base, locks)[0] == base  # SIGKILL released the holder's lock


@pytest.mark.skipif(os.geteuid() != 0, reason="uids are leased only as root (there is no uid drop otherwise)")
def test_a_lock_folder_others_can_write_is_refused_naming_it(tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o777)
    locks.chmod(0o777)
    with pytest.raises(ToolInfraError, match=f"sandbox_uids: {locks} must be a directory owned by root and writable only by it"):
        lease_uid_block(310_000, locks)


def test_a_4_gib_allocation_fails_as_memory():
    result = _run("block = bytearray(4 << 30)\nprint('allocated')", uid=block(4))
    assert (result.ok, result.error) == (False, "memory")
    assert "allocated" not in result.output


def test_writing_outside_its_directory_fails(tmp_path):
    target = tmp_path / "escaped.txt"
    program = f"import os\nopen(os.path.join(os.environ['TMPDIR'], 'mine.txt'), 'w').write('ok')\nopen({str(target)!r}, 'w').write('x')"
    result = _run(program, uid=block(5))
    if CAPS.host_hidden or CAPS.uid_dropped:
        assert (result.ok, result.error) == (False, "error")
        assert any(e in result.output for e in ("FileNotFoundError", "PermissionError", "OSError"))
        assert not target.exists()
    else:
        assert target.exists() and result.ok  # no isolation here, and the record says so


def test_loopback_listener_outside_is_unreachable():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('CONNECTED')"
    try:
        result = _run(program, uid=block(6))
    finally:
        listener.close()
    if CAPS.network_isolated:
        assert (result.ok, result.error) == (False, "error")
        assert "CONNECTED" not in result.output and "ConnectionRefusedError" in result.output
    else:
        assert result.output.startswith("CONNECTED")  # the record says there is no network namespace


def test_another_sandbox_temp_dir_is_unreadable():
    writer = "import os, time\npath = os.path.join(os.environ['TMPDIR'], 'secret')\nopen(path, 'w').write('s3cret')\nprint(path)\ntime.sleep(3)"
    reader = (
        "import glob, os, time\ntime.sleep(1)\n"
        "paths = ['/tmp/secret', *glob.glob('/tmp/asyncrl-sandbox-*/secret'), *glob.glob('/proc/[0-9]*/root/tmp/secret')]\n"
        "seen = []\nfor p in paths:\n    try:\n        seen.append(open(p).read())\n    except OSError:\n        pass\nprint('seen', seen)"
    )

    async def together():
        first, second = Sandbox(LIMITS, block(7)), Sandbox(LIMITS, block(8))
        try:
            return await asyncio.gather(run_python(first, writer, 5.0), run_python(second, reader, 5.0))
        finally:
            await first.close()
            await second.close()

    wrote, read = asyncio.run(together())
    assert wrote.ok and wrote.output.strip().endswith("secret")
    if CAPS.private_tmp:
        assert (read.ok, read.output) == (True, "seen []\n")
    else:
        assert "s3cret" in read.output


def test_output_is_truncated_to_the_configured_size():
    result = _run("print('x' * 10_000)", uid=block(9))
    assert result.ok
    assert result.output.startswith("x" * 200 + "\n[output truncated: 9801 bytes not shown]")  # 10_001 printed, 200 kept


def test_a_user_reward_runs_sandboxed_and_its_prints_are_not_its_value():
    worker = ToolWorker("tool-test", LIMITS, block(10))

    async def rewards():
        try:
            return [await worker.reward("sandbox_rewards:half", r, "12", "stop", {}, 5.0) for r in ("12", "13")]
        finally:
            await worker.shutdown()

    same, other = asyncio.run(rewards())
    assert (same.value, same.error, other.value) == (0.5, None, 0.0)


def test_a_reward_that_returns_text_fails_naming_it():
    worker = ToolWorker("tool-test", LIMITS, block(11))

    async def reward():
        try:
            return await worker.reward("sandbox_rewards:wordy", "1", "1", "stop", {}, 5.0)
        finally:
            await worker.shutdown()

    outcome = asyncio.run(reward())
    assert outcome.value is None and "'one'" in outcome.error
    assert worker.tally.errors == {"reward": {"bad_value": 1}}


def _rewards(uid: int, reward: str, responses: list[str], timeout_s: float = 5.0, timeouts: dict[str, float] | None = None) -> list:
    sandbox = Sandbox(LIMITS, uid)
    items = [RewardItem(r, "7", "stop", {}, (timeouts or {}).get(r, timeout_s)) for r in responses]

    async def run():
        try:
            return await sandbox.run_rewards(reward, items)
        finally:
            await sandbox.close()

    return asyncio.run(run())


def test_each_reward_of_a_batch_keeps_its_own_limits_and_a_crash_fails_only_its_own_item():
    # LIMITS: 2 CPU seconds, 512 MiB. "sleep" hits its 1.5 s timer, "spin" (20 s of wall time, so that a loaded
    # machine still reaches the CPU limit first) its CPU timer, "hog" the address space limit; "crash" takes the
    # process down, so the items after it run in a fresh one.
    responses = ["7", "sleep", "7", "spin", "8", "hog", "7", "crash", "7", "8"]
    outcomes = _rewards(block(12), "sandbox_rewards:troubled", responses, timeout_s=1.5, timeouts={"spin": 20.0})
    assert [(o.value, o.reason) for o in outcomes] == [
        (1.0, None), (None, "timeout"), (1.0, None), (None, "cpu_time"), (0.0, None), (None, "memory"), (1.0, None),
        (None, "error"), (1.0, None), (0.0, None),
    ]  # fmt: skip
    assert 1.5 <= outcomes[1].seconds < 1.5 + 5.0 and 1.9 <= outcomes[3].seconds < 20.0
    if CAPS.uid_dropped:
        assert _all_gone(block(12))


def test_a_reward_that_swallows_its_timer_is_killed_at_its_timeout_and_the_rest_still_run():
    began = time.monotonic()
    outcomes = _rewards(block(14), "sandbox_rewards:troubled", ["stubborn", "7", "8"], timeout_s=1.0)
    assert [(o.value, o.reason) for o in outcomes] == [(None, "timeout"), (1.0, None), (0.0, None)]
    assert time.monotonic() - began < 1.0 + 10.0  # killed at its timeout + grace, not at the 60 s loop's end
    if CAPS.uid_dropped:
        assert _all_gone(block(14))


def test_a_reward_that_cannot_be_imported_fails_every_call_naming_the_module():
    outcomes = _rewards(block(15), "no_such_reward_module:score", ["7", "7"])
    assert [o.reason for o in outcomes] == ["import_error"] * 2 and "no_such_reward_module" in outcomes[0].detail


def test_a_reward_module_whose_import_hangs_fails_every_call_at_the_first_calls_timeout():
    began = time.monotonic()
    outcomes = _rewards(block(20), "sandbox_slow_import:score", ["7", "7", "7"], timeout_s=1.0)
    assert [o.reason for o in outcomes] == ["import_error"] * 3 and "took over 1.0s" in outcomes[0].detail
    assert time.monotonic() - began < 1.0 + 5.0  # once, not once per call


def test_a_reward_process_serves_batch_after_batch_until_a_call_takes_it_down():
    sandbox = Sandbox(LIMITS, block(17))

    async def batches():
        try:
            return [await sandbox.run_rewards("sandbox_rewards:counted", [RewardItem(r, "", "stop", {}, 5.0) for r in batch])
                    for batch in (["a", "b"], ["c"], ["crash", "d"], ["e"])]  # fmt: skip
        finally:
            await sandbox.close()

    values = [[(o.value, o.reason) for o in batch] for batch in asyncio.run(batches())]
    # The module was imported once for a, b, c; "crash" ended that process, so d and e ran in a fresh one.
    assert values == [[(1.0, None), (2.0, None)], [(3.0, None)], [(None, "error"), (1.0, None)], [(2.0, None)]]
    if CAPS.uid_dropped:
        assert _all_gone(block(17))


def test_a_reward_process_is_replaced_after_its_calls_and_one_call_each_isolates_every_call():
    async def batches(process_calls: int, uid: int):
        sandbox = Sandbox(LIMITS, uid, reward_process_calls=process_calls)
        try:
            return [[o.value for o in await sandbox.run_rewards("sandbox_rewards:counted", [RewardItem(r, "", "stop", {}, 5.0) for r in batch])]
                    for batch in (["a", "b"], ["c"], ["d"])]  # fmt: skip
        finally:
            await sandbox.close()

    assert asyncio.run(batches(2, block(18))) == [[1.0, 2.0], [1.0], [2.0]]
    assert asyncio.run(batches(1, block(19)))[1:] == [[1.0], [1.0]]


@pytest.mark.parametrize("batch, runs", [(32, 2), (1, 8)])
def test_reward_calls_waiting_for_a_slot_share_one_process_and_each_gets_its_own_value(batch, runs):
    # One call slot: the first call runs alone, the seven that queued behind it run together (batch 32) or
    # each in its own process (batch 1).
    worker = ToolWorker("tool-test", LIMITS, block(16), calls=1, reward_batch=batch)
    responses = ["12", "13"] * 4

    async def rewards():
        try:
            return await asyncio.gather(*(worker.reward("sandbox_rewards:half", r, "12", "stop", {}, 5.0) for r in responses))
        finally:
            await worker.shutdown()

    outcomes = asyncio.run(rewards())
    assert [o.value for o in outcomes] == [0.5, 0.0] * 4 and worker.reward_runs == runs
    assert worker.tally.calls == {"reward": 8} and worker.tally.errors == {}


def test_worker_counts_calls_by_tool_and_reason():
    worker = ToolWorker("tool-test", SandboxLimits(wall_s=3.0, cpu_s=1), block(13))
    calls = [ToolCall("calculator", "2 + 3"), ToolCall("calculator", "1 / 0"), ToolCall("python", "raise SystemExit(2)"), ToolCall("python", "print(1)"), ToolCall("grep", "x")]

    async def all_calls():
        try:
            return [await worker.call(call, 3.0) for call in calls]
        finally:
            await worker.shutdown()

    results = asyncio.run(all_calls())
    assert [r.output for r in results[:2]] == ["5", "error: division by zero"]
    assert [r.error for r in results] == [None, "error", "error", None, "unknown_tool"]
    assert worker.tally.calls == {"calculator": 2, "python": 2, "grep": 1}
    assert worker.tally.errors == {"calculator": {"error": 1}, "python": {"error": 1}, "grep": {"unknown_tool": 1}}


def test_check_prints_the_capability_record(capsys):
    from asyncrl.cli import main

    assert main(["check"]) == 0
    assert f"# {CAPS}\n# planned placement\n" in capsys.readouterr().out


class _DeadToolWorker:
    """A `ToolExecutor` whose worker died: every reward raises the pool client's infrastructure error."""

    async def call(self, call, timeout_s):
        raise ToolInfraError("tool_worker_died", "tool-0")

    async def reward(self, reward, response, ground_truth, *, finish_reason, extra_info, timeout_s):
        raise ToolInfraError("tool_worker_died", "tool-0")


def test_a_dead_tool_worker_fails_the_trajectory_with_its_reason_not_a_zero_reward():
    from asyncrl.config import RolloutConfig
    from asyncrl.rollout.worker import RolloutWorker, WorkerSpec
    from tests.unit.rollout.fakes import FakeEngine, FakeQueue, InProcessHandle, make_requests

    queue = FakeQueue(make_requests(2))
    spec = WorkerSpec("unused", RolloutConfig(max_requests_in_flight=2), tools=_DeadToolWorker())
    worker = RolloutWorker("rollout-0", spec, InProcessHandle(queue), engine=FakeEngine("rollout-0"))

    async def serve():
        run = asyncio.ensure_future(worker.run())
        while len(queue.finished) < 2:
            await asyncio.sleep(0.01)
        await worker.stop(drain=True)
        await run

    asyncio.run(asyncio.wait_for(serve(), 10))
    assert [t.failure for t in queue.finished] == ["tool_worker_died: tool-0"] * 2


class _Unstartable(Sandbox):
    """A sandbox whose process exits before its interpreter is ready (bwrap refused, interpreter missing)."""

    def _command(self, uid, reward):
        return ["/bin/sh", "-c", "echo 'bwrap: no permission' >&2; exit 1"], None


def test_a_sandbox_that_cannot_start_is_an_infrastructure_failure():
    sandbox = _Unstartable(LIMITS, block(14))

    async def call():
        try:
            return await run_python(sandbox, "print(1)", 5.0)
        finally:
            await sandbox.close()

    with pytest.raises(ToolInfraError, match="sandbox_start_failed: exit 1: bwrap: no permission") as failure:
        asyncio.run(call())
    assert failure.value.reason == "sandbox_start_failed" and sandbox._leased == set()  # no uid held by a failed start


def test_an_infrastructure_error_keeps_its_reason_across_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(ToolInfraError("sandbox_start_failed", "exit 1")))
    assert (error.reason, str(error)) == ("sandbox_start_failed", "sandbox_start_failed: exit 1")
