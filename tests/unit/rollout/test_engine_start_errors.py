"""An engine that dies at start: its own error is read back from the output the engine core shares with the worker."""

from __future__ import annotations

import os
import sys

from asyncrl.rollout.vllm_compat.errors import mark_output, output_since, root_cause

# What vLLM 0.32's CPU build prints when the engine core cannot start a head size of 16 (abridged): the engine core's
# traceback with vLLM's logging prefix on every line, then the worker's EngineDeadError pointing "above".
ENGINE_CORE_LOG = """\
INFO 12-05 15:01:02 [core.py:93] Initializing a V1 LLM engine (v0.32.0) with config: model='/tmp/m'
ERROR 12-05 15:01:09 [core.py:708] EngineCore failed to start.
ERROR 12-05 15:01:09 [core.py:708] Traceback (most recent call last):
ERROR 12-05 15:01:09 [core.py:708]   File "vllm/v1/engine/core.py", line 699, in run_engine_core
ERROR 12-05 15:01:09 [core.py:708]     engine_core = EngineCoreProc(*args, **kwargs)
ERROR 12-05 15:01:09 [core.py:708] RuntimeError: Unsupported CPU attention configuration: head_dim=16
Process EngineCore_DP0:
Traceback (most recent call last):
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
"""


def test_the_engine_cores_error_is_picked_over_the_see_above_ones():
    assert root_cause(ENGINE_CORE_LOG) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16"


def test_text_without_an_exception_names_no_cause():
    assert root_cause("INFO starting\nWARNING slow\n") is None
    assert root_cause(ENGINE_CORE_LOG.splitlines()[-1]) is None  # only "see above": no cause to name


def test_only_what_was_written_since_the_mark_is_read(tmp_path):
    log = tmp_path / "worker.err"
    saved = os.dup(2)
    with open(log, "w") as f:
        f.write("ValueError: an old error, before the engine started\n")
        f.flush()
        os.dup2(f.fileno(), 2)
        try:
            marks = mark_output()
            sys.stderr.flush()
            os.write(2, ENGINE_CORE_LOG.encode())
            since = output_since(marks)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    assert 2 in marks and "old error" not in since
    assert root_cause(since) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16"


def test_a_failed_start_reports_the_workers_own_exception_not_rays_traceback():
    from ray.exceptions import RayTaskError

    from asyncrl.rollout.membership import start_failure
    from asyncrl.rollout.vllm_compat.errors import EngineStartError

    cause = EngineStartError("the engine's own error: RuntimeError: head_dim=16")
    traceback = "Traceback (most recent call last):\n" + '  File "worker.py", line 1, in ready\n' * 30
    wrapped = RayTaskError("RolloutWorker.ready", traceback, cause)
    assert "worker.py" in str(wrapped)  # what the report used to carry
    assert start_failure(wrapped) == "EngineStartError: the engine's own error: RuntimeError: head_dim=16"
    assert start_failure(TimeoutError("no answer")) == "TimeoutError: no answer"
