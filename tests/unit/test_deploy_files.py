"""deploy/ stays consistent with the code: YAML parses, referenced configs exist and validate,
pool sizes match the KubeRay worker groups, the dashboard queries only metrics the system exports."""

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from asyncrl.cli import _parser, _split_overrides, placement
from asyncrl.config import RECIPES, load_config
from asyncrl.telemetry.metrics import RunMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "asyncrl.json"

RANGE_FUNCTIONS = ("rate", "irate", "increase")
"""PromQL functions that assume a monotonic series: counters and histogram buckets/sums/counts only."""
GAUGE_FUNCTIONS = ("delta", "deriv", "predict_linear")
"""PromQL functions meant for gauges (on a counter, `rate` is right)."""


def _exported() -> dict[str, str]:
    """Metric name -> type, read from the exporter's own registry (a rename in the code reaches this test)."""
    kinds = {}
    for metric in RunMetrics().registry.collect():
        kinds[metric.name + ("_total" if metric.type == "counter" else "")] = metric.type
    return kinds


METRICS = _exported()
METRICS_PORT = 9400


def _series() -> dict[str, tuple[str, str]]:
    """Series name a query can select -> (metric, type): a histogram is only its _bucket, _sum and _count."""
    out = {}
    for name, kind in METRICS.items():
        for series in [f"{name}_bucket", f"{name}_sum", f"{name}_count"] if kind == "histogram" else [name]:
            out[series] = (name, kind)
    return out


def _series_names() -> set[str]:
    return set(_series())


def _enclosing_calls(expr: str, pos: int) -> list[str]:
    """Functions whose parentheses enclose `expr[pos]`, innermost first (aggregations included, `by (...)`
    groupings and bare parentheses as "")."""
    calls, depth = [], 0
    for i in range(pos - 1, -1, -1):
        if expr[i] == ")":
            depth += 1
        elif expr[i] == "(":
            if depth:
                depth -= 1
                continue
            name = re.search(r"([a-z_]+)\s*$", expr[:i])
            calls.append(name.group(1) if name else "")
    return calls


def _uses(dashboard: dict):
    """(panel title, expr, series, calls enclosing it) for every asyncrl series every query names."""
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            for match in re.finditer(r"\basyncrl_[a-z0-9_]+", target["expr"]):
                yield panel["title"], target["expr"], match.group(0), _enclosing_calls(target["expr"], match.start())


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _text_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


def _rayjob() -> dict:
    return yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())


def _load_command(command: str):
    """Parse `asyncrl run CONFIG overrides...` as the CLI would and load its config (relative to the repo)."""
    argv = shlex.split(command)
    assert argv[0] == "asyncrl", command
    args = _parser().parse_args(argv[1:])
    path, overrides = _split_overrides(args)
    return load_config(ROOT / path if path else None, overrides)


def _gpus(container: dict) -> float:
    limits = container.get("resources", {}).get("limits", {})
    return float(limits.get("nvidia.com/gpu", 0))


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows nest their panels
    return out


# --------------------------------------------------------------------------------------------------
# YAML and referenced configs


def test_deploy_folder_has_the_expected_files():
    for rel in [
        "ray/cluster.yaml",
        "kuberay/rayjob.yaml",
        "Dockerfile",
        "prometheus/prometheus.yml",
        "grafana/dashboards/asyncrl.json",
        "grafana/provisioning/datasources/prometheus.yml",
        "grafana/provisioning/dashboards/asyncrl.yml",
        "README.md",
    ]:
        assert (DEPLOY / rel).is_file(), rel


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs), path


def test_every_referenced_config_exists():
    pattern = re.compile(r"\bconfigs/([A-Za-z0-9_.-]+\.ya?ml)\b")
    referenced = {}
    for path in _text_files():
        for name in pattern.findall(path.read_text()):
            referenced.setdefault(name, path.relative_to(DEPLOY))
    assert referenced, "deploy files reference no config"
    missing = {name: str(where) for name, where in referenced.items() if not (RECIPES / name).is_file()}
    assert not missing, f"deploy files reference configs that do not exist in configs/: {missing}"


# --------------------------------------------------------------------------------------------------
# KubeRay RayJob


def test_rayjob_runs_asyncrl_and_shuts_down():
    job = _rayjob()
    assert job["apiVersion"] == "ray.io/v1"
    assert job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["entrypoint"].startswith("asyncrl run ")
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"rollout", "learner"}
    for group in groups.values():
        (container,) = group["template"]["spec"]["containers"]
        assert _gpus(container) > 0, group["groupName"]
        assert container["resources"]["requests"] == container["resources"]["limits"]


def test_rayjob_entrypoint_is_a_valid_config_whose_pools_fill_the_worker_groups():
    spec = _rayjob()["spec"]
    cfg = _load_command(spec["entrypoint"])
    assert cfg.telemetry.prometheus_port == METRICS_PORT
    plan = placement(cfg)
    groups = {g["groupName"]: g for g in spec["rayClusterSpec"]["workerGroupSpecs"]}

    def group_gpus(name):
        group = groups[name]
        (container,) = group["template"]["spec"]["containers"]
        return group["replicas"] * _gpus(container)

    rollout_gpus = cfg.rollout.num_workers * cfg.rollout.num_gpus_per_worker
    learner_gpus = cfg.learner.num_ranks * cfg.learner.num_gpus_per_rank
    assert rollout_gpus == group_gpus("rollout")
    assert learner_gpus == group_gpus("learner")
    assert plan["total"]["GPU"] == rollout_gpus + learner_gpus
    assert plan["learner_pool"]["backend"] == "nccl"
    head = spec["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"].get("num-gpus") == "0", "GPU actors must land on the worker groups"
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert METRICS_PORT in ports


def test_ray_versions_agree_across_image_launcher_and_rayjob():
    docker = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=rayproject/ray:([0-9.]+)-py311-gpu$", docker, re.M)
    assert base, "Dockerfile base image is not a rayproject/ray py311 GPU image"
    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    assert cluster["docker"]["image"] == f"rayproject/ray:{base.group(1)}-py311-gpu"
    assert _rayjob()["spec"]["rayClusterSpec"]["rayVersion"] == base.group(1)


# --------------------------------------------------------------------------------------------------
# Ray cluster launcher and Dockerfile


def test_cluster_launcher_has_gpu_node_types_and_installs_the_gpu_extra():
    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    assert len(types) >= 3  # head + rollout + learner
    assert any("[gpu]" in cmd for cmd in cluster["setup_commands"])
    assert cluster["max_workers"] >= sum(t.get("max_workers", 0) for t in types.values())
    assert any("--metrics-export-port" in cmd for cmd in cluster["head_start_ray_commands"])
    text = (DEPLOY / "ray" / "cluster.yaml").read_text()
    assert "ray job submit --working-dir . -- asyncrl run configs/scalerl.yaml" in text
    assert "RAY_ADDRESS" in text


def test_cluster_launcher_submit_command_is_a_valid_config():
    text = (DEPLOY / "ray" / "cluster.yaml").read_text()
    lines = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    joined = " ".join(lines).replace("\\ ", " ")
    match = re.search(r"ray job submit --working-dir \. -- (asyncrl run [^#]*?telemetry\.prometheus_port=\d+)", joined)
    assert match, "no `ray job submit ... asyncrl run ...` example in cluster.yaml"
    cfg = _load_command(match.group(1))
    assert cfg.rollout.num_workers == 8 and cfg.learner.num_ranks == 8
    assert cfg.telemetry.prometheus_port == METRICS_PORT


def test_dockerfile_installs_the_gpu_extra_as_a_plain_package_with_asyncrl_entrypoint():
    docker = (DEPLOY / "Dockerfile").read_text()
    install = re.search(r'pip install [^\n]*"?\.\[gpu\]"?[^\n]*', docker)
    assert install and " -e " not in install.group(0)  # recipes are package data: no source tree needed
    assert "asyncrl check scalerl" in install.group(0)
    assert re.search(r'^ENTRYPOINT \["asyncrl"\]$', docker, re.M)
    for copied in re.findall(r"^COPY (?:--\S+ )*(\S+) ", docker, re.M):
        assert (ROOT / copied).exists(), f"Dockerfile copies {copied}, which does not exist"
    pinned = re.search(r"^ARG VLLM_VERSION=(\S+)$", docker, re.M).group(1)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'gpu = ["vllm=={pinned}"]' in pyproject, "Dockerfile's vLLM differs from the gpu extra"


# --------------------------------------------------------------------------------------------------
# Prometheus and Grafana


def test_prometheus_scrapes_asyncrl_port_and_ray_discovery():
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    targets = [t for sc in jobs["asyncrl"]["static_configs"] for t in sc["targets"]]
    assert targets and all(t.rsplit(":", 1)[1] == str(METRICS_PORT) for t in targets)
    files = [f for sd in jobs["ray"]["file_sd_configs"] for f in sd["files"]]
    assert "/tmp/ray/prom_metrics_service_discovery.json" in files


def test_grafana_dashboard_queries_only_exported_metrics_and_all_of_them():
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    allowed = _series_names()
    used, ids = set(), []
    for panel in _panels(dashboard):
        ids.append(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "prometheus", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "prometheus", panel["title"]
            names = set(re.findall(r"\basyncrl_[a-z0-9_]+", target["expr"]))
            assert names, f"{panel['title']}: expr names no asyncrl metric: {target['expr']}"
            unknown = names - allowed
            assert not unknown, f"{panel['title']}: unknown metric(s) {sorted(unknown)} in {target['expr']}"
            used |= names
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    base = {n for n in METRICS if n in used or any(u.startswith(n + "_") and u in allowed for u in used)}
    assert base == set(METRICS), f"metrics without a panel: {sorted(set(METRICS) - base)}"


def _misuse(name: str, calls: list[str]) -> str | None:
    """Why a query's use of series `name` (inside `calls`, innermost first) does not fit its type, or None."""
    metric, kind = _series()[name]
    ranged = [c for c in calls if c in RANGE_FUNCTIONS]
    if ranged and kind not in ("counter", "histogram"):
        return f"{ranged[0]}() on {kind} {metric} (rate only on counters and histograms)"
    if any(c in GAUGE_FUNCTIONS for c in calls) and kind != "gauge":
        return f"a gauge function on {kind} {metric}"
    if kind == "histogram" and not ranged:
        return f"raw cumulative histogram series {name}; take rate() or increase() of it"
    if "histogram_quantile" in calls and not (kind == "histogram" and name.endswith("_bucket")):
        return f"histogram_quantile over {name}, not a histogram's buckets"
    return None


def test_grafana_functions_fit_the_exported_metric_types():
    uses = list(_uses(json.loads(DASHBOARD.read_text())))
    problems = [f"{title}: {expr}: {why}" for title, expr, name, calls in uses if (why := _misuse(name, calls))]
    assert not problems, "\n".join(problems)
    assert len(uses) >= len(METRICS)


def test_promql_checker_rejects_rate_of_a_gauge_and_a_quantile_of_a_non_bucket():
    """The check above can fail: it sees the functions around each series and the registry's types."""
    expr = "histogram_quantile(0.9, sum by (le) (rate(asyncrl_weight_sync_seconds_sum[5m]))) + rate(asyncrl_policy_version[1m])"
    first, second = (m.start() for m in re.finditer(r"asyncrl_", expr))
    assert _enclosing_calls(expr, first) == ["rate", "", "histogram_quantile"]
    assert "not a histogram's buckets" in _misuse("asyncrl_weight_sync_seconds_sum", _enclosing_calls(expr, first))
    assert "rate() on gauge asyncrl_policy_version" in _misuse("asyncrl_policy_version", _enclosing_calls(expr, second))
    assert "raw cumulative" in _misuse("asyncrl_weight_sync_seconds_bucket", ["sum"])
    assert "gauge function on counter" in _misuse("asyncrl_learner_step_total", ["deriv"])
    assert _misuse("asyncrl_learner_step_total", ["max"]) is None  # a counter's current value on a stat is fine


def test_grafana_histograms_are_queried_by_bucket_and_labels_by_name():
    exprs = [t["expr"] for p in _panels(json.loads(DASHBOARD.read_text())) for t in p.get("targets", [])]
    for name, kind in METRICS.items():
        if kind == "histogram":
            assert any(f"{name}_bucket" in e and "histogram_quantile" in e for e in exprs), name
    assert any("asyncrl_buffer_samples_total" in e and "by (state)" in e for e in exprs)
    assert any("asyncrl_correction_masked_fraction" in e for e in exprs)
    assert any(t.get("format") == "heatmap" for p in _panels(json.loads(DASHBOARD.read_text())) for t in p.get("targets", []))


def test_grafana_provisioning_points_at_the_dashboard_datasource():
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["apiVersion"] == 1
    assert [d["uid"] for d in ds["datasources"]] == ["prometheus"]
    assert ds["datasources"][0]["type"] == "prometheus"
    boards = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "asyncrl.yml").read_text())
    (provider,) = boards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    assert provider["options"]["path"] in (DEPLOY / "README.md").read_text(), "README's mount differs from the provisioned path"
