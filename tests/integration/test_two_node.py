"""A two-node Ray cluster on this machine: `ray start --head` plus a second raylet (`ray start --address`)
whose processes have another HOME, so their `~/.cache` is not the driver's. Each node carries the custom
resource of one pool (`learner_node` on the head, `rollout_node` on node 2), as deploy/ sets them up.

`asyncrl submit` runs a short W1 job whose rollout pool is pinned to node 2: the engine there loads the
preset through the object store (unpacked into node 2's own cache), the run's files land in `storage.uri` on a
real S3-compatible server (`s3_server`; the nodes share no folder, their credentials come from the environment
`ray start` ran in), and `status`/`logs` read the job back through the Jobs API. Teardown kills the processes this module
started, found by an environment marker (never `ray stop`: it would kill every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncrl.remote import Store, join
from asyncrl.testing import TINY_RUN, free_port, kill_processes_with_env, ray_node_ports

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


def _ray_start(args: list[str], env: dict) -> None:
    done = subprocess.run([str(BIN / "ray"), "start", "--node-ip-address=127.0.0.1", "--disable-usage-stats", *ray_node_ports(), *args],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@dataclass(frozen=True)
class Cluster:
    jobs: str
    """The Jobs API (dashboard) address: submit, status, logs."""
    gcs: str
    """The cluster address a driver connects to: `check --address`."""
    env: dict
    home_head: Path
    home_node2: Path


@pytest.fixture(scope="module")
def cluster(s3_server, tmp_path_factory):  # the S3 server's credentials are in the environment the nodes start in
    root = tmp_path_factory.mktemp("two-node")
    homes = {name: root / name for name in ("home-head", "home-node2")}
    for home in homes.values():
        home.mkdir()
    temp = Path("/tmp") / f"ray-2n-{os.getpid()}"  # short: Ray's socket paths have a length limit
    base = {k: v for k, v in os.environ.items() if k != "ASYNCRL_CACHE"}  # the cache follows each node's HOME
    env = dict(base, PATH=f"{BIN}:{os.environ['PATH']}", ASYNCRL_TEST_CLUSTER=str(temp))
    dashboard_port, gcs_port = free_port(), free_port()
    try:
        _ray_start([
            "--head", f"--port={gcs_port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}", "--num-cpus=2", '--resources={"learner_node": 1}', f"--temp-dir={temp}",
        ], dict(env, HOME=str(homes["home-head"])))
        _ray_start([f"--address=127.0.0.1:{gcs_port}", "--num-cpus=1", '--resources={"rollout_node": 1}'],
                   dict(env, HOME=str(homes["home-node2"])))
        jobs = f"http://127.0.0.1:{dashboard_port}"
        # A loaded machine may take a while to bring the dashboard up after `ray start` returns.
        _wait_for(lambda: _cli(["status", "--address", jobs], env, timeout_s=60).returncode == 0, 300, "the Jobs API")
        yield Cluster(jobs, f"127.0.0.1:{gcs_port}", dict(env, HOME=str(homes["home-head"])), *homes.values())
    finally:
        kill_processes_with_env(f"ASYNCRL_TEST_CLUSTER={temp}")
        shutil.rmtree(temp, ignore_errors=True)


def _cli(args: list[str], env: dict, timeout_s: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "asyncrl"), *args], env=env, capture_output=True, text=True, timeout=timeout_s)


def test_a_job_pinned_to_node_2_loads_the_shipped_model_there_and_reads_back_through_the_jobs_api(cluster, s3_server):
    address, env, home_head, home_node2 = cluster.jobs, cluster.env, cluster.home_head, cluster.home_node2
    store, run = Store(s3_server.endpoint_url), s3_server.uri("two-node-runs", "two-node")
    overrides = [
        "output_dir=two-node", f"storage.uri={s3_server.uri('two-node-runs')}", f"storage.endpoint_url={s3_server.endpoint_url}",
        "storage.sync_every_s=1", "learner.max_steps=3", *TINY_RUN,
        "rollout.resources={rollout_node: 1}", "learner.resources={learner_node: 1}", "cluster.placement_timeout_s=120",
    ]
    check = _cli(["check", *overrides, "--address", cluster.gcs], env)  # the placement fits and node 2 can read the store
    began = time.monotonic()
    job = subprocess.Popen([str(BIN / "asyncrl"), "submit", *overrides, "--address", address, "--working-dir", "", "--job-id", "two-node"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = join(run, "metrics.jsonl")
    first_step_s = _wait_for(lambda: job.poll() is not None or (store.exists(metrics) and store.read_text(metrics).strip()), 900, "the first step")
    out, err = job.communicate(timeout=900)
    assert job.returncode == 0, out[-3000:] + err[-3000:]
    print(f"two-node: submit -> first step {first_step_s - began:.1f}s; submit -> done {time.monotonic() - began:.1f}s")

    summary = json.loads(store.read_text(join(run, "summary.json")))
    assert summary["steps"] == 3 and store.exists(join(run, "final_model", "config.json"))
    assert store.listdir(join(run, "checkpoints")) == ["step-000003"] and store.exists(join(run, "trajectories.parquet"))
    assert store.exists(join(run, "checkpoints", "step-000003", "learner", ".metadata"))
    shipped = [p for p in (home_node2 / ".cache" / "asyncrl" / "shipped").glob("tiny-0.3m-*") if p.is_dir()]
    assert len(shipped) == 1 and (shipped[0] / "config.json").is_file()  # node 2 unpacked the driver's preset ...
    assert not (home_node2 / ".cache" / "asyncrl" / "models").exists()  # ... and never built one itself
    assert list((home_head / ".cache" / "asyncrl" / "models").glob("tiny-0.3m-*"))  # the driver built it on the head
    assert not (home_head / ".cache" / "asyncrl" / "shipped").exists()  # the learner, beside the driver, read it in place
    assert check.returncode == 0, check.stderr  # ... and every node reached the S3 server

    status = _cli(["status", "two-node", "--address", address], env)
    assert status.returncode == 0 and status.stdout.startswith("two-node  SUCCEEDED"), status.stdout + status.stderr
    logs = _cli(["logs", "two-node", "--address", address], env)
    assert logs.returncode == 0 and '"final_version": 3' in logs.stdout


def test_check_names_the_pool_whose_resource_the_cluster_lacks_and_the_nodes_that_cannot_reach_the_storage(cluster):
    nobody = f"http://127.0.0.1:{free_port()}"  # no S3 server listens there
    done = _cli(["check", "rollout.resources={gpu_node: 1}", "storage.uri=s3://asyncrl-test/x", f"storage.endpoint_url={nobody}",
                 "storage.request_timeout_s=2", "--address", cluster.gcs], cluster.env, timeout_s=300)
    assert done.returncode == 2 and "rollout_pool: one unit needs 1 gpu_node" in done.stderr, done.stderr
    assert "storage.uri: s3://asyncrl-test/x/runs/default is not writable on node(s) " in done.stderr, done.stderr


def _wait_for(predicate, timeout_s: float, what: str) -> float:
    """Poll until `predicate` holds -> the monotonic time it did."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.5)
    return time.monotonic()


def test_a_pool_reserves_on_the_node_with_its_resource_and_a_shortage_names_the_pool(cluster):
    import ray

    from asyncrl.cluster.placement import PlacementError, bundle, release, reserve

    ray.init(address=cluster.gcs, log_to_driver=False)
    try:
        group = reserve("tools", [bundle(0.5, 0, {"rollout_node": 1})], timeout_s=60)
        (node,) = set(ray.util.placement_group_table(group)["bundles_to_node_id"].values())
        assert ray.available_resources().get("rollout_node", 0) == 0  # held for this pool until released
        release(group)
        assert [n["Resources"].get("rollout_node") for n in ray.nodes() if n["NodeID"] == node] == [1.0]
        with pytest.raises(PlacementError) as error:
            reserve("tools", [bundle(1, 0, {"gpu_node": 1})] * 2, "SPREAD", timeout_s=2)
        assert str(error.value).startswith("tools pool: 2 bundles of {CPU: 1, gpu_node: 1} not placeable within 2 s; needs CPU 2, gpu_node 2")
        assert str(error.value).endswith("gpu_node 0 free of 0 (no node has enough gpu_node)")
        _a_rollout_pool_that_cannot_be_placed_fails_naming_its_shortage()
    finally:
        ray.shutdown()


def _a_rollout_pool_that_cannot_be_placed_fails_naming_its_shortage() -> None:
    from asyncrl.config import RolloutConfig
    from asyncrl.rollout.pool import RolloutPool, WorkerStartError

    pool = RolloutPool("unused", RolloutConfig(resources={"gpu_node": 1}), placement_timeout_s=2)
    with pytest.raises(WorkerStartError) as error:
        pool.start()  # the engine never starts: its actor has nowhere to run
    assert "rollout pool: 1 bundles of {CPU: 1, gpu_node: 1} not placeable within 2 s" in str(error.value)
    assert not pool.joining and not pool._groups  # the reservation was given back
