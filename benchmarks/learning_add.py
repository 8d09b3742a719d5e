"""W1 `add`: held-out accuracy against wall-clock and trained samples for sync, streaming and sao, the
peer baseline (TRL's GRPOTrainer, benchmarks/peer_trl.py) and a plain on-policy loop
(benchmarks/plain_grpo.py, lr 2e-4) on the same workload.

All three modes, the peer and the plain loop start from the same cached warm-start checkpoint, one after the other, so
the ratios compare like with like on a noisy shared machine. asyncrl's wall-clock starts at the first
rollout; time to target is reported with and without the held-out evaluations (the peer's clock excludes
its evaluations, so the ratio to the peer uses asyncrl's clock without them too). For every run it
reports accuracy at equal trained samples, time to 0.5 and to 0.7 held-out accuracy and seconds per
256 trained samples (the per-step cost; the plain loop's is the floor without Ray, vLLM or a queue).

The fair clock. The peer's clock stops while it evaluates, and nothing of its training happens meanwhile. The
like of that in asyncrl is `eval.blocking=true` (e.g. `--variant stopclock:eval.blocking=true`): the loop waits
for each evaluation and the queue starts no rollout group meanwhile (groups already started finish), so
`wall_s_excl_eval` leaves out exactly the time in which neither side trains or starts generating for training.
The shipped non-blocking evaluation (the default) runs beside training: its clock without evaluations still
carries the evaluations' share of the engines (500 greedy requests each), which the peer's clock does not.
Trained samples/s is reported counted two ways (`sample_rates`): as the peer counts them (every sample that
entered an update: asyncrl's trained samples plus those its zero-variance filter consumed, which TRL trains
with a zero advantage), and only the samples of groups with a non-zero advantage (asyncrl's trained samples;
the peer's times the share of its groups whose rewards differ). Point 6 of issue #48 asks for the first
>= the peer's and time to 0.5 <= 0.7x the peer's.
After the runs it times the learner alone (`learner_alone`: streaming's optimizer step on the batches that run
trained, in this process with no engine running, with one and with two torch threads), the ceiling of any
asynchronous mode whose learner has that many threads, next to the peer's whole step; and sync's own recipe on
the same batches with two threads (the sync limit's learner). Then W1's limit model
(`limits.w1_limit`: the engine alone, counting the groups the zero-variance filter discards as its work, the
learner alone, both at once) on the batches streaming trained (its sync limit too) and on those sao trained (its
critic included), with each mode's trained samples/s as a fraction of its limit and each limit over the peer's
trained samples/s.
The peer runs in a subprocess when `trl` is installed (`pip install -e .[bench]`). Writes
benchmarks/results/learning_add.json (and a PNG plot when matplotlib is installed).

    python benchmarks/learning_add.py [--quick] [--steps N] [--target 0.5] [--mini-batches 4] [--modes sync,streaming,sao]
                                      [--mb-set learner.lr=5e-5] [--variant NAME:KEY=VALUE,...] [--no-baselines] [--out PATH]

`--mini-batches N` (N > 1) also runs every mode with `learner.mini_batches=N` as `<mode>_mbN`, so the
JSON and the plot hold both curves (accuracy per trained sample with one and with N updates per batch).
`--modes` picks a subset of the modes and `--no-baselines` leaves out the peer and the plain loop, e.g. the
mini-batch comparison alone: `--modes streaming --mini-batches 4 --no-baselines`. `--variant NAME:KEY=VALUE,...`
(repeatable) also runs streaming's recipe with those overrides as `streaming_NAME`, in the same session, e.g. a setting
against the shipped one: `--variant nice0:learner.cpu_nice=0`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

STEP_SAMPLES = 256  # 32 prompts x 8 samples
LEARNER_ALONE_STEPS = 12
"""Optimizer steps `learner_alone` times per thread count (after one warm-up step)."""
MILESTONES = (0.5, 0.7)
MODES = {"sync": "sync.yaml", "streaming": "default.yaml", "sao": "sao.yaml"}
BF16_OVERRIDES = ["model.dtype=bfloat16"]
"""`--bf16`: bf16 decoder layers in the learner (fp32 masters and head) and bf16 engines."""


def time_to_target(evals: list[dict], target: float, clock: str = "wall_s") -> float | None:
    """`clock` of the first evaluation at or above `target`: `wall_s`, or `wall_s_excl_eval` (the time
    spent evaluating left out, as the peer's clock does)."""
    for e in evals:
        if e["accuracy"] >= target:
            return e[clock]
    return None


def accuracy_at(evals: list[dict], samples: int) -> float | None:
    """Accuracy of the last evaluation taken with at most `samples` trained samples."""
    done = [e["accuracy"] for e in evals if e["samples_trained"] <= samples]
    return done[-1] if done else None


def run_figures(evals: list[dict], clock: str) -> dict:
    """Time to each milestone and seconds per 256 trained samples on `clock` (`wall_s_excl_eval` for
    asyncrl, `wall_s` for the peer and the plain loop, whose clocks leave evaluations out)."""
    last = evals[-1]
    return {
        **{f"time_to_{m}_s": time_to_target(evals, m, clock) for m in MILESTONES},
        "s_per_256_samples": round(last[clock] * STEP_SAMPLES / last["samples_trained"], 3) if last["samples_trained"] else None,
    }


def sample_rates(r: dict) -> dict:
    """Trained samples/s on the run's clock without evaluations, counted two ways: `as_trl_counts`, every sample
    that entered an update or the group filter (TRL trains and counts the groups whose rewards are all equal; asyncrl's
    zero-variance filter consumes them: its trained samples x `consumed_per_trained`), and `nonzero_advantage`, only
    the samples of groups whose rewards differ (asyncrl's trained samples; TRL's x its `informative_fraction`). None
    where the run does not say (the plain loop's share of all-equal groups)."""
    rate = STEP_SAMPLES / r["s_per_256_samples"] if r.get("s_per_256_samples") else None
    if rate is None:
        return {"as_trl_counts": None, "nonzero_advantage": None}
    if "consumed_per_trained" in r:  # asyncrl: the filter consumes the all-equal groups, the learner the rest
        consumed = r["consumed_per_trained"]
        return {"as_trl_counts": rate * consumed if consumed else None, "nonzero_advantage": rate}
    informative = r.get("informative_fraction")  # the peer's; the plain loop trains every group and does not say
    return {"as_trl_counts": rate, "nonzero_advantage": rate * informative if informative else None}


def print_rates(results: dict, target: float) -> None:
    """Each run's trained samples/s both ways (`sample_rates`) and its time to `target`, each over the peer's."""
    if "trl" not in results:
        return
    peer, peer_t = results["trl"]["sample_rates"], results["trl"]["time_to_target_excl_eval_s"]

    def over(value: float | None, base: float | None) -> str:
        return f"{value / base:>6.2f}" if value and base else f"{'-':>6}"

    def rate(value: float | None) -> str:
        return f"{value:>6.0f}" if value else f"{'-':>6}"

    print(f"\n{'run':<22} {'s/256':>6} {'all/s':>6} {'÷trl':>6} {'adv/s':>6} {'÷trl':>6} {'t(' + str(target) + ') ÷trl':>12}")
    for name, r in results.items():
        rates = r["sample_rates"]
        print(f"{name:<22} {r['s_per_256_samples'] or 0:>6.3f} {rate(rates['as_trl_counts'])} {over(rates['as_trl_counts'], peer['as_trl_counts'])} "
              f"{rate(rates['nonzero_advantage'])} {over(rates['nonzero_advantage'], peer['nonzero_advantage'])} "
              f"{over(r['time_to_target_excl_eval_s'], peer_t):>12}")  # fmt: skip
    print("(all/s: trained samples/s as TRL counts them, every sample that entered an update or the group filter; adv/s: "
          "those of groups with a non-zero advantage; clocks without evaluations; goal: all/s ÷ trl >= 1, t ÷ trl <= 0.7)")


def print_figures(results: dict) -> None:
    """One row per run: accuracy at the sample counts every run reached, milestones, seconds per step."""
    reach = min(r["evals"][-1]["samples_trained"] for r in results.values())
    points = [reach * k // 4 for k in (1, 2, 4)]
    print(f"\n{'run':<10} " + " ".join(f"{'acc@' + str(p):>10}" for p in points) + f" {'t(0.5) s':>9} {'t(0.7) s':>9} {'s/256':>7}")
    for name, r in results.items():
        accs = " ".join(f"{a:>10.3f}" if (a := accuracy_at(r["evals"], p)) is not None else f"{'-':>10}" for p in points)
        times = " ".join(f"{t:>9.0f}" if (t := r[f"time_to_{m}_s"]) is not None else f"{'-':>9}" for m in MILESTONES)
        print(f"{name:<10} {accs} {times} {r['s_per_256_samples'] or 0:>7.2f}")
    print("(times: training clocks without evaluations; acc@N: last evaluation at or before N trained samples)")


def plain_run(steps: int, every: int, target: float) -> dict:
    """benchmarks/plain_grpo.py from the default config's warm start, in this process."""
    import torch
    from plain_grpo import train  # benchmarks/ is on sys.path when a script there runs

    from asyncrl.config import RECIPES, load_config
    from asyncrl.envs.model_dir import ensure_model

    torch.set_num_threads(2)
    evals = train(ensure_model(load_config(RECIPES / "default.yaml")), steps, every, log=lambda line: None)
    return {
        "start_accuracy": evals[0]["accuracy"],
        "final_accuracy": evals[-1]["accuracy"],
        "wall_clock_s": evals[-1]["wall_s"],
        "samples_trained": evals[-1]["samples_trained"],
        "time_to_target_s": time_to_target(evals, target),
        "time_to_target_excl_eval_s": time_to_target(evals, target),  # its clock excludes evaluations
        "evals": evals,
    }


def trained_batches(run_dir: Path, cfg, batches: int) -> list[list]:
    """The first `batches` whole batches (`prompts_per_step` groups of `samples_per_prompt`) the run in `run_dir`
    trained, from its trajectory log's `trained` rows."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from asyncrl.buffer.storage import trajectories_from_arrow
    from asyncrl.types import Group

    table = pq.read_table(next(run_dir.glob("trajectories*.parquet")))
    by_group: dict[str, list] = {}
    for t in trajectories_from_arrow(table.filter(pc.equal(table["fate"], "trained"))):
        by_group.setdefault(t.group_id, []).append(t)
    groups = [Group(g, members) for g, members in by_group.items() if len(members) == cfg.rollout.samples_per_prompt]
    per_batch = cfg.learner.prompts_per_step
    return [groups[i : i + per_batch] for i in range(0, len(groups) - per_batch + 1, per_batch)][:batches]


def learner_alone(batches: list[list], cfg, threads: Sequence[int] = (1, 2)) -> dict:
    """Seconds of each optimizer step of `cfg`'s recipe on `batches`, on a plain fp32 module in this process
    with nothing else running (`limits.rank_trainer`), per torch thread count; batch 0 is the warm-up. Also the
    median of the others per 256 samples."""
    from limits import rank_trainer

    from asyncrl.envs.model_dir import ensure_model

    model_dir, step_s = ensure_model(cfg), {}
    for n in threads:
        train, step_s[str(n)] = rank_trainer(cfg, model_dir, threads=n), []
        for b, batch in enumerate(batches):
            began = time.perf_counter()
            train(batch, b)
            step_s[str(n)].append(time.perf_counter() - began)
    per_batch = sum(len(g.trajectories) for g in batches[0])
    return {
        "s_per_256_samples": {n: statistics.median(s[1:]) * STEP_SAMPLES / per_batch for n, s in step_s.items()},
        "steps": len(batches) - 1,
        "threads_in_runs": int(cfg.learner.num_cpus_per_rank),
        "step_s": step_s,
    }


def alone_and_limit(out: Path, results: dict, together_s: float | None = None) -> tuple[dict, dict]:
    """The learner alone (`learner_alone`) on the batches the streaming run in `out` trained, and W1's limit model
    (`limits.w1_limit`) of streaming (its sync limit too) and of sao (critic included) on their own runs' batches,
    with each mode's samples/s against its limit and each limit against the peer's samples/s. Empty when the
    streaming run trained fewer than two batches."""
    from asyncrl.config import RECIPES, load_config

    cfg = load_config(RECIPES / MODES["streaming"])
    batches = trained_batches(out / "streaming", cfg, LEARNER_ALONE_STEPS + 1)
    if len(batches) < 2:
        return {}, {}
    alone = learner_alone(batches, cfg)
    # The sync limit trains sync's own recipe (GRPO's PPO surrogate) on 2 threads, on the same batches.
    sync = learner_alone(batches, load_config(RECIPES / MODES["sync"]), threads=(2,))
    alone["sync_recipe_s_per_256_samples"] = sync["s_per_256_samples"]
    step_s = {"1": alone.pop("step_s")["1"], "2": sync["step_s"]["2"]}
    limit = {"streaming": mode_limit(out / "streaming", cfg, batches, step_s, together_s)}
    sao = load_config(RECIPES / MODES["sao"])
    if "sao" in results and len(sao_batches := trained_batches(out / "sao", sao, LEARNER_ALONE_STEPS + 1)) >= 2:
        limit["sao"] = mode_limit(out / "sao", sao, sao_batches, learner_alone(sao_batches, sao, threads=(1,))["step_s"], together_s)
    limit["runs"] = limit_fractions(limit, results)
    return alone, limit


def mode_limit(run_dir: Path, cfg, batches: list[list], step_s: dict[str, list[float]], together_s: float | None) -> dict:
    """`limits.w1_limit` of the run in `run_dir`, with the samples it generated per sample it trained."""
    from limits import W1_TOGETHER_S, w1_limit

    from asyncrl.envs.model_dir import ensure_model

    counters = json.loads((run_dir / "summary.json").read_text())["counters"]
    filtered = sum(v for k, v in counters.items() if k.startswith("filtered:"))
    return w1_limit(cfg, ensure_model(cfg), batches, step_s, (counters["trained"] + filtered) / counters["trained"], together_s or W1_TOGETHER_S)


def limit_fractions(limit: dict, results: dict) -> dict:
    """Each run's trained samples/s (per 256 samples over its training clock) as a fraction of its mode's
    limit (sync: the streaming model's sync limit), and each limit over the peer's samples/s; with the peer's
    `informative_fraction`, also over the peer's samples/s that had a non-zero advantage (`*_informative`)."""
    trl = results.get("trl") or {}
    peer = STEP_SAMPLES / trl["s_per_256_samples"] if trl.get("s_per_256_samples") else None
    bounds = {"sync": ("streaming", "sync_limit_samples_per_s"), "streaming": ("streaming", "limit_samples_per_s"), "sao": ("sao", "limit_samples_per_s")}
    rows = {} if peer is None else {"trl": {"samples_per_s": peer}}
    informative = peer * trl["informative_fraction"] if peer and trl.get("informative_fraction") else None
    if informative:
        rows["trl"]["informative_samples_per_s"] = informative
    for mode, (model, key) in bounds.items():
        if (results.get(mode) or {}).get("s_per_256_samples") and model in limit:
            rate, bound = STEP_SAMPLES / results[mode]["s_per_256_samples"], limit[model][key]
            rows[mode] = {"samples_per_s": rate, "limit_samples_per_s": bound, "fraction_of_limit": rate / bound,
                          **({"limit_over_peer": bound / peer, "over_peer": rate / peer} if peer else {}),
                          **({"limit_over_peer_informative": bound / informative, "over_peer_informative": rate / informative}
                             if informative else {})}  # fmt: skip
    return rows


def print_limit(limit: dict) -> None:
    """Each limit model's pieces, then each run against its limit and the limit against the peer."""
    for mode in ("streaming", "sao"):
        if m := limit.get(mode):
            sync = f", sync limit {m['sync_limit_samples_per_s']:.0f}" if "sync_limit_samples_per_s" in m else ""
            print(f"W1 {mode} limit: engine {m['engine_samples_per_s']:.0f}, learner {m['learner_samples_per_s']['1']:.0f} trained samples/s "
                  f"alone (1 thread; {m['generated_per_trained']:.2f} generated per trained); together c = {m['concurrency_capacity']:.2f}; "
                  f"limit {m['limit_samples_per_s']:.0f} ({m['bound_by']}-bound){sync}")
    for mode, r in limit["runs"].items():
        if mode != "trl":
            peer = f", limit / trl {r['limit_over_peer']:.2f}, run / trl {r['over_peer']:.2f}" if "limit_over_peer" in r else ""
            if "over_peer_informative" in r:
                peer += f" (trl's samples with a non-zero advantage: {r['limit_over_peer_informative']:.2f}, {r['over_peer_informative']:.2f})"
            print(f"  {mode}: {r['samples_per_s']:.0f} samples/s = {r['fraction_of_limit']:.2f} of its limit{peer}")


def runs(mini_batches: int, modes: Sequence[str] = tuple(MODES), mb_overrides: Sequence[str] = (),
         variants: Sequence[tuple[str, list[str]]] = ()) -> list[tuple[str, str, list[str]]]:
    """(run name, recipe file, extra overrides): each of `modes` as shipped, then with `mini_batches`
    updates per rollout batch (and `mb_overrides`, e.g. a smaller learning rate) when that is more than 1, then
    streaming's recipe once per `variants` entry (name, overrides: `--variant`)."""
    shipped = [(mode, MODES[mode], []) for mode in modes]
    extra = [(f"streaming_{name}", MODES["streaming"], list(overrides)) for name, overrides in variants]
    if mini_batches <= 1:
        return shipped + extra
    return shipped + [(f"{mode}_mb{mini_batches}", file, [f"learner.mini_batches={mini_batches}", *mb_overrides]) for mode, file, _ in shipped] + extra


def main() -> None:
    args = _parse()
    result_json = common.output_path("learning_add", args)
    if args.replot:
        plot(json.loads(result_json.read_text())["modes"], result_json.with_suffix(".png"))
        return
    common.set_runtime_env()
    load_start = common.load_average()
    steps, every = (3, 1) if args.quick else (args.steps, 5)
    out = Path(tempfile.mkdtemp(prefix="learning_add-"))
    planned = [(mode, file, [*extra, *BF16_OVERRIDES]) if args.bf16 else (mode, file, extra) for mode, file, extra in runs(args.mini_batches, args.modes, args.mb_set, args.variant)]
    results = asyncrl_runs(out, steps, every, args.target, planned)
    if args.baselines and importlib.util.find_spec("trl") is None:
        print("peer baseline (TRL GRPOTrainer): trl is not installed (pip install -e .[bench])")
    elif args.baselines:
        results["trl"] = trl_run(out, steps, every, args.target, args.bf16)
    if args.baselines and not args.bf16:
        results["plain"] = plain_run(steps, every, args.target)
    for mode, r in results.items():
        r.update(run_figures(r["evals"], "wall_s" if mode in ("trl", "plain") else "wall_s_excl_eval"))
        r["sample_rates"] = sample_rates(r)
    print_table(results, steps, args.target)
    print_figures(results)
    print_rates(results, args.target)
    command = " ".join(["python", "benchmarks/learning_add.py", *sys.argv[1:]])
    # `machine`: the load average at the start and once the runs ended (before the limit model).
    record = {"machine": common.machine(load_start), "command": command, "steps": steps, "target": args.target, "modes": results}
    common.write_json(result_json, record)  # the runs' figures kept should the limit model below fail
    # The learner-alone and limit figures train fp32 modules (`limits.rank_trainer`): not measured for a bf16 run.
    alone, limit = alone_and_limit(out, results, 5.0 if args.quick else None) if "streaming" in results and not args.bf16 else ({}, {})
    if limit:
        print_limit(limit)
    if alone:
        print("learner alone, s per 256 samples: " + ", ".join(f"{t} thread(s) {s:.3f}" for t, s in alone["s_per_256_samples"].items()))
    common.write_json(result_json, {**record, **({"learner_alone": alone} if alone else {}), **({"limit": limit} if limit else {})})
    plot(results, result_json.with_suffix(".png"))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "learning_add", "smoke run: a few steps per mode")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (200: the headline in RESULTS.md)")
    parser.add_argument("--target", type=float, default=0.5, help="held-out accuracy whose wall-clock is reported")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from the existing JSON")
    parser.add_argument("--mini-batches", type=int, default=1, help="N > 1: also run each mode with learner.mini_batches=N")
    parser.add_argument("--mb-set", action="append", default=[], metavar="KEY=VALUE", help="config override for the _mbN runs only (repeatable)")
    parser.add_argument("--variant", type=_variant, action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                        help="also run streaming's recipe with these overrides, as streaming_NAME (repeatable; side by side with the rest)")
    parser.add_argument("--modes", type=_modes, default=tuple(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--no-baselines", dest="baselines", action="store_false", help="leave out the TRL peer and the plain loop")
    parser.add_argument("--bf16", action="store_true", help="asyncrl's modes with model.dtype=bfloat16 and TRL with bf16=True (both with "
                        "eager attention); no plain loop, learner-alone or limit figures (they train fp32)")
    return parser.parse_args()


def _variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition(":")
    pairs = [o.strip() for o in overrides.split(",") if o.strip()]
    if not name.isidentifier() or not pairs or any("=" not in o for o in pairs):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE], e.g. nice:learner.cpu_nice=10")
    return name, pairs


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode {unknown or text!r}; valid: {', '.join(MODES)}")
    return modes


def asyncrl_runs(out: Path, steps: int, every: int, target: float, planned: list[tuple[str, str, list[str]]]) -> dict[str, dict]:
    """The planned runs (`runs()`) from the shipped recipes, in one Ray session."""
    import ray

    from asyncrl.config import RECIPES, load_config
    from asyncrl.controller.run import run

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    results = {}
    for mode, file, extra in planned:
        cfg = load_config(RECIPES / file, [f"output_dir={out / mode}", f"learner.max_steps={steps}", f"eval.every_steps={every}", *extra])
        summary = run(cfg)
        results[mode] = {
            "start_accuracy": summary["start_accuracy"],
            "final_accuracy": summary["final_accuracy"],
            "wall_clock_s": summary["wall_clock_s"],
            "samples_trained": summary["samples_trained"],
            "time_to_target_s": time_to_target(summary["evals"], target),
            "time_to_target_excl_eval_s": time_to_target(summary["evals"], target, "wall_s_excl_eval"),
            "consumed_per_trained": consumed_per_trained(logged_fates(out / mode)),
            "staleness_histogram": summary["staleness_histogram"],
            "mismatch_k3_mean": summary["mismatch_k3_mean"],
            "parity_max_abs_diff_mean": summary["parity_max_abs_diff_mean"],
            "evals": summary["evals"],
        }
    ray.shutdown()
    return results


def consumed_per_trained(fates: Sequence[tuple[str, str]]) -> float | None:
    """Samples the learner or the group filters consumed per trained sample, from the trajectory log's (group id,
    fate) rows: what TRL, which trains every group, would count as trained for each sample asyncrl trained. Groups
    are numbered in the order they started (`<prompt>#<n>`): only those started up to the last trained one count,
    not the ones the engines generated ahead of the learner and the filter consumed after its last step."""
    started = [(int(group.rpartition("#")[2]), fate) for group, fate in fates]
    trained = [n for n, fate in started if fate == "trained"]
    if not trained:
        return None
    consumed = sum(1 for n, fate in started if n <= max(trained) and (fate == "trained" or fate.startswith("filtered:")))
    return consumed / len(trained)


def logged_fates(run_dir: Path) -> list[tuple[str, str]]:
    """(group id, fate) of every sample in the trajectory log of the run in `run_dir`."""
    import pyarrow.parquet as pq

    table = pq.read_table(next(run_dir.glob("trajectories*.parquet")), columns=["group_id", "fate"])
    return list(zip(table["group_id"].to_pylist(), table["fate"].to_pylist(), strict=True))


def trl_run(out: Path, steps: int, every: int, target: float, bf16: bool = False) -> dict:
    """The TRL GRPOTrainer peer (benchmarks/peer_trl.py) on the same warm start and prompt stream."""
    peer_json = out / "peer_trl.json"
    cmd = [sys.executable, str(Path(__file__).parent / "peer_trl.py"), "--steps", str(steps), "--eval-every", str(every), *(["--bf16"] if bf16 else [])]
    subprocess.run([*cmd, "--target", str(target), "--out", str(peer_json)], check=True)
    peer = json.loads(peer_json.read_text())
    result = {k: peer[k] for k in ("start_accuracy", "final_accuracy", "wall_clock_s", "samples_trained", "time_to_target_s", "evals")}
    result["time_to_target_excl_eval_s"] = peer["time_to_target_s"]  # its clock excludes evaluations
    result["settings"] = peer["settings"]
    result["informative_fraction"] = informative_fraction(peer["steps"])
    return result


def informative_fraction(steps: list[dict]) -> float | None:
    """The share of the peer's trained samples whose advantage is not zero: TRL trains every group, and a group
    whose rewards are all equal (`frac_reward_zero_std`, logged every step) has zero advantage and, with no KL
    term, adds nothing to the gradient. asyncrl's group modes filter those groups out before the learner, so
    only this share of TRL's samples compares with what asyncrl counts as trained."""
    logged = [s["frac_reward_zero_std"] for s in steps if s.get("frac_reward_zero_std") is not None]
    return 1.0 - sum(logged) / len(logged) if logged else None


def print_table(results: dict, steps: int, target: float) -> None:
    base_name = "sync" if "sync" in results else next(iter(results))
    base = results[base_name]
    base_rate = (base["final_accuracy"] - base["start_accuracy"]) / base["wall_clock_s"]
    print(f"\nW1 add, {steps} steps per mode, target accuracy {target}")
    print(f"{'mode':<10} {'start':>6} {'final':>6} {'gain':>6} {'wall s':>7} {'samples':>8} {'t(target) s':>11} {'acc/s vs ' + base_name:>16}")
    for mode, r in results.items():
        gain = r["final_accuracy"] - r["start_accuracy"]
        ratio = f"{gain / r['wall_clock_s'] / base_rate:.2f}x" if base_rate > 0 else "-"
        ttt = f"{r['time_to_target_s']:.0f}" if r["time_to_target_s"] is not None else "-"
        print(f"{mode:<10} {r['start_accuracy']:>6.3f} {r['final_accuracy']:>6.3f} {gain:>+6.3f} {r['wall_clock_s']:>7.0f} {r['samples_trained']:>8d} {ttt:>11} {ratio:>16}")
    if "trl" in results and results["trl"]["time_to_target_s"]:
        peer = results["trl"]["time_to_target_s"]
        ratios = ", ".join(
            f"{m} {r['time_to_target_excl_eval_s'] / peer:.2f}" for m, r in results.items() if m != "trl" and r["time_to_target_excl_eval_s"]
        )
        print(f"time to {target} without evaluations, / trl (goal <= 0.7): {ratios}")


def plot(results: dict, path: Path) -> None:
    """Held-out accuracy against wall-clock and against trained samples, one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, r in results.items():
        axes[0].plot([e["wall_s"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], marker="o", label=mode)
        axes[1].plot([e["samples_trained"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], marker="o", label=mode)
    axes[0].set_xlabel("wall-clock s")
    axes[1].set_xlabel("trained samples")
    for ax in axes:
        ax.set_ylabel("held-out accuracy")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
