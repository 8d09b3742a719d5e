"""Builders of small, valid records for tests and benchmarks, in the spirit of `torch.testing`.

Each builder returns a record that holds its invariant (a trajectory's per-token arrays share one length;
a request id is `<group_id>/<sample_index>/<attempt>`), with defaults small enough to check by hand, so a
test names only the fields it is about. Nothing here imports torch, Ray or vLLM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.types import FinishReason, Group, Prompt, Request, Trajectory

PerToken = float | Sequence[float] | np.ndarray
"""One value for every token, or one value per token."""


def make_prompt(
    prompt_id: str = "p0", prompt_ids: Sequence[int] = (1, 2, 3), ground_truth: str = "0", **fields: Any
) -> Prompt:
    """A prompt whose token ids need no tokenizer; `fields` are the other `Prompt` fields (`extra_info`, ...)."""
    return Prompt(prompt_id=prompt_id, prompt_ids=[int(t) for t in prompt_ids], ground_truth=ground_truth, **fields)


def make_request(
    prompt: Prompt | None = None,
    *,
    group_id: str | None = None,
    sample_index: int = 0,
    group_size: int = 1,
    attempt: int = 0,
) -> Request:
    """Sample `sample_index` of the group of `prompt` (default: a group named after the prompt), with the
    request id the replay queue would give it."""
    prompt = prompt or make_prompt()
    group_id = prompt.prompt_id if group_id is None else group_id
    return Request(f"{group_id}/{sample_index}/{attempt}", group_id, sample_index, group_size, prompt, attempt)


def make_trajectory(
    response_ids: int | Sequence[int] | np.ndarray = 3,
    *,
    prompt_ids: Sequence[int] | np.ndarray = (1, 2, 3),
    group_id: str = "g0",
    prompt_id: str | None = None,
    sample_index: int = 0,
    rollout_logprobs: PerToken = -1.0,
    loss_mask: int | Sequence[int] | np.ndarray = 1,
    versions: int | Sequence[int] | np.ndarray = 0,
    finish_reason: FinishReason = "stop",
    dispatch_version: int | None = None,
    **fields: Any,
) -> Trajectory:
    """A trajectory with `response_ids` (a length: tokens 0, 1, ..., or the tokens themselves).

    Per-token fields take one value for all tokens or one per token. `prompt_id` defaults to `group_id` and
    `dispatch_version` to the oldest token's version (the engine's version when the request started).
    `fields` are the remaining `Trajectory` fields (`reward`, `failure`, `worker`, `attempt`, ...).
    """
    response = np.asarray(np.arange(response_ids) if np.ndim(response_ids) == 0 else response_ids, dtype=np.int32)
    token_versions = _per_token(versions, len(response), np.int32)
    if dispatch_version is None:
        dispatch_version = int(token_versions.min()) if len(token_versions) else 0
    return Trajectory(
        prompt_id=group_id if prompt_id is None else prompt_id,
        group_id=group_id,
        sample_index=sample_index,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        response_ids=response,
        rollout_logprobs=_per_token(rollout_logprobs, len(response), np.float32),
        loss_mask=_per_token(loss_mask, len(response), np.int8),
        versions=token_versions,
        finish_reason=finish_reason,
        dispatch_version=dispatch_version,
        **fields,
    )


def make_answer(request: Request, response_ids: int | Sequence[int] | np.ndarray = 3, **fields: Any) -> Trajectory:
    """The trajectory a rollout worker hands back for `request`: its ids, prompt, ground truth and attempt
    (each can be overridden in `fields`, which also takes every `make_trajectory` argument)."""
    prompt = request.prompt
    identity = dict(
        group_id=request.group_id, prompt_id=prompt.prompt_id, sample_index=request.sample_index,
        prompt_ids=prompt.prompt_ids, ground_truth=prompt.ground_truth, attempt=request.attempt,
    )  # fmt: skip
    return make_trajectory(response_ids, **{**identity, **fields})


def make_group(rewards: Sequence[float] = (1.0, 0.0), *, group_id: str = "g0", **fields: Any) -> Group:
    """One group: member i has `sample_index` i and reward `rewards[i]`; `fields` go to every member's
    `make_trajectory`."""
    members = [
        make_trajectory(group_id=group_id, sample_index=i, reward=float(r), **fields) for i, r in enumerate(rewards)
    ]
    return Group(group_id, members)


def random_groups(
    num_groups: int = 4, group_size: int = 3, seed: int = 0, vocab: int = 16, shared_prompts: bool = False
) -> list[Group]:
    """Random sequences a tiny model can score: prompts of 1-5 and responses of 1-7 tokens from ids 3..vocab-1,
    about 20% of response tokens masked out (as tool output would be), some truncated, and rewards with
    variance (member 0 continuous, the others 0/1). With `shared_prompts` a group's members have its first
    member's prompt (as an engine's group does)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        members: list[Trajectory] = []
        for i in range(group_size):
            prompt_len, response_len = int(rng.integers(1, 6)), int(rng.integers(1, 8))
            if not (shared_prompts and members):
                prompt = rng.integers(3, vocab, prompt_len)
            members.append(
                make_trajectory(
                    rng.integers(3, vocab, response_len),
                    prompt_ids=prompt,
                    group_id=f"g{g}",
                    prompt_id=f"p{g}",
                    sample_index=i,
                    rollout_logprobs=-rng.random(response_len) * 3,
                    loss_mask=rng.random(response_len) > 0.2,
                    finish_reason="stop" if rng.random() < 0.7 else "length",
                    reward=float(rng.integers(0, 2)) if i else float(rng.random()),
                )
            )
        groups.append(Group(f"g{g}", members))
    return groups


SHORT_CONTEXT = 64
"""`rollout.max_model_len` for test runs on W1 prompts (at most 8 tokens, plus `rollout.max_tokens` <= 8). Each
engine's warm-up decodes up to this length: 2.3 s against 6.7 s at the default 512 (tiny model, 16 requests)."""

TINY_RUN = [
    "model.preset=tiny-0.3m",
    "model.warm_start_examples=0",
    "buffer.filter_zero_variance=false",
    "eval.every_steps=0",
    "data.eval_prompts=8",
    "learner.prompts_per_step=4",
    "rollout.samples_per_prompt=2",
    "rollout.max_requests_in_flight=16",
    f"rollout.max_model_len={SHORT_CONTEXT}",
    "learner.compile=false",
]
"""Overrides for a short real run on the random tiny model (4 groups of 2 per step, all trained: a random
model earns no reward, so zero-variance filtering would discard every group). Eager learner: compiling took
7-12 s of a 3-step run's 33-47 s; tests/integration/test_controller.py's runs keep the recipe's
compiled layers, on one rank and two."""


def free_port() -> int:
    """A TCP port nobody listens on right now (for a test's own Ray head or service)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_node_ports() -> list[str]:
    """`ray start` flags giving a node's agents and managers ports of their own: Ray's defaults (52365, ...)
    collide when several raylets run on one machine (a test's two nodes, other tests' clusters)."""
    names = (
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
        "node-manager-port",
        "object-manager-port",
    )
    return [f"--{name}={free_port()}" for name in names]


def processes_with_env(marker: str) -> list[int]:
    """Pids of processes whose environment contains `marker`. Every descendant inherits its environment,
    while command lines are renamed (Ray's `ray::DashboardAgent`), so this finds a whole process tree."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and int(proc.name) != os.getpid()
                and marker.encode() in (proc / "environ").read_bytes()
            ):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def kill_processes_with_env(marker: str, grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, every process of `processes_with_env(marker)`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_with_env(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(grace_s)


S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "test-key-id",
    "AWS_SECRET_ACCESS_KEY": "test-secret-never-written",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""Credentials a local S3 test server accepts (any do); processes reaching it need them in their environment."""


class S3Server:
    """A real S3-compatible server on 127.0.0.1 (moto's standalone server, test extra `moto[server]`) in a process
    of its own: `pause` stops it (SIGSTOP: connections hang, as with a server that stopped answering) without
    losing its in-memory objects, `resume` continues it (SIGCONT)."""

    def __init__(self, bucket: str = "asyncrl-test", start_timeout_s: float = 60.0):
        import subprocess
        import sys
        import urllib.request

        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.bucket = bucket
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                request = urllib.request.Request(f"{self.endpoint_url}/{bucket}", method="PUT")
                urllib.request.urlopen(request, timeout=5).close()  # creates the bucket
                return
            except OSError as e:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the S3 test server on port {self.port} did not start: {e}") from e
                time.sleep(0.2)

    def uri(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed
            self.process.kill()
            self.process.wait()


def _per_token(value: Any, length: int, dtype: type) -> np.ndarray:
    """`value` repeated `length` times when it is a scalar, else the per-token values as `dtype`."""
    if np.ndim(value) == 0:
        return np.full(length, value, dtype=dtype)
    return np.asarray(value, dtype=dtype)
