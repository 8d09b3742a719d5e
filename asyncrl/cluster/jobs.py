"""Jobs on a Ray cluster through Ray's Jobs API (`ray.job_submission.JobSubmissionClient`).

`asyncrl submit` resolves and validates the config on the submitting machine, then submits `asyncrl run`
with that resolved config (carried in the job's environment, so the job runs exactly what was checked, and
`asyncrl status` can show it). Token authentication is Ray's own: with `RAY_AUTH_MODE=token` and the cluster's
token in the environment, the client sends it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from dataclasses import dataclass

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
CONFIG_ENV = "ASYNCRL_JOB_CONFIG"
"""The job's environment variable holding the resolved config (YAML) that `asyncrl run --config-env` reads."""
EXCLUDES = [".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".hypothesis"]
"""Never uploaded with the working directory."""
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
AGENT_WAIT_S = 180.0
STOP_GRACE_S = 300
"""Seconds `asyncrl stop` (SIGTERM) leaves a job to checkpoint and summarise before Ray kills it."""
"""How long a submission waits for a freshly started head's job agent."""


def address(explicit: str | None) -> str:
    """`--address`, else `RAY_ADDRESS`, else the local dashboard."""
    return explicit or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS


def client(explicit_address: str | None):
    from ray.job_submission import JobSubmissionClient

    url = address(explicit_address)
    try:
        return JobSubmissionClient(url)
    except Exception as e:  # Ray raises ConnectionError or RuntimeError depending on what is missing
        raise ConnectionError(
            f"cannot reach the Ray Jobs API at {url}: {e}. "
            "Start the head with `ray start --head --dashboard-host 127.0.0.1`"
            " (needs ray[default]) or pass --address / set RAY_ADDRESS."
        ) from None


@dataclass(frozen=True)
class Submitted:
    job_id: str
    address: str


def submit(config_yaml: str, *, explicit_address: str | None, working_dir: str | None, job_id: str | None) -> Submitted:
    """Submit `asyncrl run` with `config_yaml` (already resolved and validated) as a Ray job. The job id
    (generated when not given) also names the job's control actor (`asyncrl scale`)."""
    from asyncrl.cluster.control import JOB_ENV

    job_id = job_id or f"asyncrl-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    # Ray's `stop` sends SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s by default): give the run
    # time to finish its step, checkpoint and write its summary.
    env_vars = {CONFIG_ENV: config_yaml, JOB_ENV: job_id, "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_S)}
    runtime_env: dict = {"env_vars": env_vars}
    if working_dir:
        runtime_env.update(working_dir=working_dir, excludes=EXCLUDES)
    job = _submit_job(
        client(explicit_address),
        entrypoint=f"asyncrl run --config-env {CONFIG_ENV}",
        runtime_env=runtime_env,
        submission_id=job_id,
        metadata={"tool": "asyncrl"},
    )
    return Submitted(job, address(explicit_address))


def _submit_job(jobs, **job) -> str:
    """`submit_job`, waiting up to `AGENT_WAIT_S` for a head that has just started: it answers 500 until its
    job agent registers."""
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return jobs.submit_job(**job)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def status_lines(explicit_address: str | None, job_id: str | None) -> list[str]:
    """One line per asyncrl job (newest last), or the details of one."""
    jobs = client(explicit_address)
    if job_id is not None:
        info = jobs.get_job_info(job_id)
        return [
            f"{info.submission_id}  {info.status.value}  {info.message or ''}".rstrip(),
            f"entrypoint: {info.entrypoint}",
        ]
    listed = sorted(jobs.list_jobs(), key=lambda j: j.start_time or 0)
    return [
        f"{j.submission_id}  {j.status.value}  {j.entrypoint}"
        for j in listed
        if (j.metadata or {}).get("tool") == "asyncrl"
    ]


def logs(explicit_address: str | None, job_id: str, follow: bool) -> None:
    jobs = client(explicit_address)
    if not follow:
        sys.stdout.write(jobs.get_job_logs(job_id))
        return

    async def tail() -> None:
        async for chunk in jobs.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    asyncio.run(tail())


def wait(explicit_address: str | None, job_id: str, timeout_s: float | None = None, poll_s: float = 2.0) -> str:
    """Block until the job ends; returns its final status (raises TimeoutError naming the job)."""
    jobs = client(explicit_address)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = jobs.get_job_status(job_id).value
        if status in TERMINAL:
            return status
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {status} after {timeout_s}s")
        time.sleep(poll_s)


def stop(explicit_address: str | None, job_id: str) -> bool:
    return bool(client(explicit_address).stop_job(job_id))


def scale(explicit_address: str | None, job_id: str, sizes: dict[str, int], timeout_s: float = 120.0) -> str:
    """Ask a running job to resize its pools (`rollout`, `learner`): a tiny Ray job sets the wanted sizes on
    the job's control actor (through the Jobs API, so it works wherever `submit` does); -> what it printed."""
    from asyncrl.cluster.control import sizes_argument

    jobs = client(explicit_address)
    helper = _submit_job(
        jobs,
        entrypoint=f"python -m asyncrl.cluster.control {job_id} {sizes_argument(sizes)}",
        metadata={"tool": "asyncrl-scale"},
    )
    status = wait(explicit_address, helper, timeout_s=timeout_s, poll_s=0.5)
    text = jobs.get_job_logs(helper)
    if status != "SUCCEEDED":
        raise RuntimeError(f"scaling {job_id} failed ({status}): {text.strip()[-2000:]}")
    lines = [line for line in text.strip().splitlines() if line.startswith(f"{job_id}: ")]
    return "\n".join(lines) if lines else f"{job_id}: scale requested"
