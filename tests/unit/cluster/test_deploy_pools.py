"""deploy/ pins each pool to its own worker group: the custom resource a pool asks for (`rollout.resources`,
`learner.resources` in the submitted command) is the one its group's nodes carry, in the amount the pool
needs; every node mounts the shared storage that `storage.uri` points into."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from asyncrl.cli import _parser, _split_overrides
from asyncrl.config import Config, load_config

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"


def _config(command: str) -> Config:
    args = _parser().parse_args(shlex.split(command)[1:])
    path, overrides = _split_overrides(args)
    return load_config(ROOT / path if path else None, overrides)


def _needs(cfg: Config) -> dict[str, float]:
    """Custom resource -> what the pool pinned to it asks for in all ({"rollout_node": 8.0, ...})."""
    pools = ((cfg.rollout.num_workers, cfg.rollout.resources), (cfg.learner.num_ranks, cfg.learner.resources))
    return {name: count * amount for count, resources in pools for name, amount in resources.items()}


def _kuberay_resources(start_params: dict) -> dict[str, float]:
    """KubeRay's rayStartParams.resources is a quoted JSON string: '"{\\"rollout_node\\": 4}"'."""
    text = start_params.get("resources")
    return json.loads(json.loads(text)) if text else {}


def test_rayjob_pins_each_pool_to_its_worker_group_and_mounts_shared_storage():
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    cfg = _config(job["spec"]["entrypoint"])
    assert set(cfg.rollout.resources) == {"rollout_node"} and set(cfg.learner.resources) == {"learner_node"}
    cluster = job["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    for pool, resource in (("rollout", "rollout_node"), ("learner", "learner_node")):
        group = groups[pool]
        per_pod = _kuberay_resources(group["rayStartParams"])
        assert set(per_pod) == {resource}, pool  # only this pool's resource: the other pool cannot land here
        assert group["replicas"] * per_pod[resource] == _needs(cfg)[resource], pool
    assert "resources" not in cluster["headGroupSpec"]["rayStartParams"]  # no pool lands on the head
    pods = [cluster["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in groups.values())]
    for pod in pods:
        mounts = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert claims == {"asyncrl-shared"} and any(cfg.storage.uri.startswith(m + "/") for m in mounts)


def test_cluster_launcher_node_types_carry_the_resources_the_submit_example_pins():
    text = (DEPLOY / "ray" / "cluster.yaml").read_text()
    launcher = yaml.safe_load(text)
    comments = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")).replace("\\ ", " ")
    commands = re.findall(r"(asyncrl (?:submit|run) configs/scalerl\.yaml [^#]*?telemetry\.prometheus_port=\d+)", comments)
    assert len(commands) == 2
    for command in commands:
        cfg = _config(command.replace("asyncrl submit", "asyncrl run"))
        types = launcher["available_node_types"]
        for resource, need in _needs(cfg).items():
            hosts = [t for t in types.values() if resource in t["resources"]]
            assert len(hosts) == 1 and hosts[0]["resources"][resource] * hosts[0]["max_workers"] >= need, resource
        assert cfg.storage.uri.startswith("/mnt/shared/")
    assert any("/mnt/shared:/mnt/shared" in option for option in launcher["docker"]["run_options"])
    assert any("/mnt/shared" in command for command in launcher["initialization_commands"])
