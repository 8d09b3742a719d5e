"""`asyncrl` command line: run | check.

Thin entry point: nothing heavy (torch, Ray, vLLM) is imported before a subcommand needs it, so
`asyncrl --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous actor-learner RL for LLMs: vLLM rollouts, staleness-bounded replay, FSDP2 learner.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job (no CONFIG = the embedded default, configs/default.yaml)")
    run.add_argument("config", nargs="?", help="YAML recipe: a file, or a shipped recipe by name (default, sync, sao, scalerl, grpo, dapo)")
    run.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. learner.max_steps=20")
    check = sub.add_parser("check", help="validate a config and print it with the planned placement; starts nothing")
    check.add_argument("config", nargs="?", help="YAML recipe: a file or a shipped recipe name")
    check.add_argument("overrides", nargs="*", help="section.key=value overrides")
    check.add_argument("--address", help="Ray cluster whose resources the placement must fit (default: RAY_ADDRESS, else this machine)")
    return parser


def _split_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    # `asyncrl run learner.max_steps=3` has no CONFIG: the first positional is an override.
    if args.config is not None and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def placement(cfg) -> dict:
    """The resources each pool asks Ray for; what `check` prints before anything starts."""
    rollout = {
        "workers": cfg.rollout.num_workers,
        "per_worker": {"CPU": cfg.rollout.num_cpus_per_worker, "GPU": cfg.rollout.num_gpus_per_worker},
        "engine": "vLLM AsyncLLM" + (" (CPU build)" if cfg.rollout.num_gpus_per_worker == 0 else ""),
        "samples_per_prompt": cfg.rollout.samples_per_prompt,
    }
    learner = {
        "ranks": cfg.learner.num_ranks,
        "per_rank": {"CPU": cfg.learner.num_cpus_per_rank, "GPU": cfg.learner.num_gpus_per_rank},
        "sharding": "FSDP2 fully_shard",
        "backend": cfg.learner.backend if cfg.learner.backend != "auto" else ("nccl" if cfg.learner.num_gpus_per_rank else "gloo"),
        "critic": cfg.learner.critic,
    }
    total = {
        "CPU": cfg.rollout.num_workers * cfg.rollout.num_cpus_per_worker + cfg.learner.num_ranks * cfg.learner.num_cpus_per_rank,
        "GPU": cfg.rollout.num_workers * cfg.rollout.num_gpus_per_worker + cfg.learner.num_ranks * cfg.learner.num_gpus_per_rank,
    }
    return {"mode": cfg.mode, "algorithm": cfg.algorithm.resolved_names(), "rollout_pool": rollout, "learner_pool": learner, "total": total}


def _preflight(cfg, address: str | None) -> int:
    """Model, data, reward, checkpoint and placement checks; every problem on stderr, exit 2 if any."""
    from asyncrl.controller.preflight import cluster_resources, local_resources, preflight

    problems = preflight(cfg, cluster_resources(address) if address else local_resources())
    for problem in problems:
        print(f"asyncrl check: {problem}", file=sys.stderr)
    return 2 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from asyncrl.config import ConfigError, load_config

    path, overrides = _split_overrides(args)
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"asyncrl: {e}", file=sys.stderr)
        return 2
    if args.command == "check":
        import yaml

        print(yaml.safe_dump(cfg.dump(), sort_keys=False), end="")
        print("# planned placement")
        print(json.dumps(placement(cfg), indent=2))
        return _preflight(cfg, args.address or os.environ.get("RAY_ADDRESS"))
    from asyncrl.controller import run

    summary = run(cfg)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
