"""benchmarks/RESULTS.md, generated: `python benchmarks/report.py > benchmarks/RESULTS.md`.

The document is `LAYOUT`, section by section. A section named after a result file renders
`results/<name>.json` with its formatter (one per benchmark, headline ratio first: ratios hold on a shared,
noisy machine; absolute times drift), then `notes/<name>.md`, the hand-written reading of that run (when and
how it ran, what it means); a note whose first line is `## ...` gives the section that title. A name with no
result file is `notes/<name>.md` alone: a whole hand-written section. Result files no section names are listed
at the end. `tests/unit/test_benchmark_report.py` fails when RESULTS.md is not this script's output, so a new
result or note lands with the regenerated document.

    python benchmarks/report.py                   # print RESULTS.md to stdout
    python benchmarks/report.py --results DIR     # every result file of another folder, no notes (smoke runs `*_quick.json` skipped)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NOTES = Path(__file__).resolve().parent / "notes"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def fx(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def fnum(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


# ---------------------------------------------------------------------------------------------------
# One formatter per benchmark.


def weight_sync(d: dict, title: str = "## W3 `sync` — weight publication (`benchmarks/weight_sync.py`)") -> list[str]:
    sizes = d["sizes"]
    worst = max(s["parity_after_max"] for s in sizes)
    best = [s for s in sizes if s.get("weight_load", "reload") == "in_place" and s.get("transport") == "shared_memory"] or sizes
    lines = [
        title,
        "",
        f"Learner step done → every engine serves v+1 (1 learner rank, 1 engine, fp32; object store: buckets of "
        f"{d['config']['bucket_bytes'] >> 20} MiB; shared memory: one /dev/shm segment the engine maps; collective: a "
        "gloo broadcast over the engine's own process group on 127.0.0.1, in buckets of the same size; engine load "
        "`in_place`: a copy into the model's parameters, `reload`: vLLM's reload and re-pack); median of the syncs. "
        "÷ memcpy: a plain copy of the same bytes (2 threads; 1 thread, as the learner rank and the engine each "
        "copy), measured in the same run, over the sync's time.",
        "",
        "**Headline:** " + "; ".join(f"{s['preset']} {s['total_s_median']:.2f} s at {s['memcpy_ratio']:.3f} of memcpy "
                                     f"({s.get('memcpy_1thread_ratio', 0):.3f} of a 1-thread memcpy)" for s in best)
        + f" (shared memory, in place); parity after every sync ≤ {worst:.1e}." + decode_speed(sizes) + lora_sync(sizes),
        "",
    ]
    lines += table(
        ["model", "load", "transport", "params", "MB moved", "export s", "load s", "total s", "MB/s", "÷ memcpy", "÷ 1-thread memcpy",
         "parity before", "parity after", "decode s"],
        [
            [
                s["preset"], s.get("weight_load", "reload"), s.get("transport", "object_store"), f"{s['parameters'] / 1e6:.1f}M",
                f"{s['bytes'] / 1e6:.1f}", fnum(s["export_s_median"], ".3f"), fnum(s["load_s_median"], ".3f"),
                fnum(s["total_s_median"], ".3f"), f"{s['bytes_per_s_median'] / 1e6:.0f}", fnum(s["memcpy_ratio"], ".4f"),
                fnum(s.get("memcpy_1thread_ratio"), ".4f"), f"{s['parity_before_max']:.1e}", f"{s['parity_after_max']:.1e}",
                fnum(s.get("decode_s"), ".3f"),
            ]
            for s in sizes
        ],
    )
    return lines


def lora_sync(sizes: list[dict]) -> str:
    """The adapter sync (`--lora-rank`, transport `lora_adapter`) next to the full syncs of the same size."""
    parts = []
    for a in (s for s in sizes if s.get("transport") == "lora_adapter"):
        full = [s for s in sizes if s["preset"] == a["preset"] and s.get("transport") != "lora_adapter"]
        against = ", ".join(f"{s['transport']} {s['bytes'] / 1e6:.0f} MB in {s['total_s_median']:.2f} s" for s in full)
        share = f" ({a['bytes'] / full[0]['bytes']:.1%} of the bytes)" if full else ""
        parts.append(f" LoRA rank {a['lora_rank']} at {a['preset']}: {a['bytes'] / 1e6:.1f} MB in "
                     f"{a['total_s_median']:.2f} s" + (f" against {against}{share}." if full else "."))  # fmt: skip
    return "".join(parts)


def decode_speed(sizes: list[dict]) -> str:
    """Greedy decode speed with in-place loads (unpacked kernels) over reloads (vLLM's packed ones), per size."""
    seconds = {(s["preset"], s.get("weight_load")): s.get("decode_s") for s in sizes if s.get("transport") != "lora_adapter"}
    ratios = [f"{p} {seconds[(p, 'reload')] / seconds[(p, 'in_place')]:.2f}x" for p in dict.fromkeys(s["preset"] for s in sizes)
              if seconds.get((p, "reload")) and seconds.get((p, "in_place"))]  # fmt: skip
    return f" Decode speed in place ÷ reload: {', '.join(ratios)}." if ratios else ""


def async_speedup(d: dict, title: str = "## W2 `tail` — async throughput under heavy-tailed lengths (`benchmarks/async_speedup.py`)") -> list[str]:
    c = d["config"]
    dist = c["length_distribution"]
    lines = [
        title,
        "",
        f"{c['model']}, {c['steps']} steps × {c['prompts_per_step']} prompts × G={c['samples_per_prompt']} per mode "
        f"(sao: G single-rollout copies of each prompt), η={c['max_staleness']}, stale policy {c.get('stale_policy', 'drop')}; per-prompt max_tokens log-normal "
        f"(median {dist['median']:g}, p99 {dist['p99']:g}, EOS ignored). Trained tokens = prompt + response tokens of "
        "trained samples (under `continue` they include the stale tokens masked out of the loss, counted in the last "
        "column); efficiency = trained tokens/s ÷ the same requests on one engine with no learner.",
        "",
        "**Headline:** " + "; ".join(_async_headline(d["modes"], d.get("ratios", {}))) + ".",
        "",
    ] + _async_rounds(d)
    return lines + table(
        ["mode", "recipe", "window s", "samples", "tokens", "mean resp len generated", "mean resp len trained", "tokens/s", "vs sync", "efficiency",
         "rollout idle", "learner idle", "staleness mean", "staleness max", "dropped stale", "of which aborted early", "stale tokens masked"],
        _async_rows(d["modes"], d.get("engine_alone") or {}),
    )


def _async_rounds(d: dict) -> list[str]:
    """With several rounds: each mode's tokens/s round by round, and the speedups within each round."""
    if d.get("rounds", 1) <= 1:
        return []
    per_mode: dict[str, list[str]] = {}
    for r in d["runs"]:
        per_mode.setdefault(r["mode"], []).append(f"{r['trained_tokens_per_s']:,.0f}")
    within = "; ".join(f"{key.replace('_over_', ' / ')} " + " / ".join(fx(x) for x in values) for key, values in d.get("round_ratios", {}).items())
    return [
        f"The modes ran in turn, {d['rounds']} rounds; each row below is the mode's median round. Trained tokens/s round by "
        "round: " + "; ".join(f"{mode} {' / '.join(values)}" for mode, values in per_mode.items())
        + (f". Within each round: {within}" if within else "") + ".",
        "",
    ]


def _async_headline(modes: list[dict], ratios: dict) -> list[str]:
    """Speedups over sync first (and, where stale tokens were masked, over the tokens left in the loss), then
    each mode's rollout efficiency."""
    head = []
    by_mode = {m["mode"]: m for m in modes}
    for mode in ("streaming", "sao"):
        if f"{mode}_over_sync" in ratios:
            samples = ratios.get(f"{mode}_over_sync_samples_per_s")
            m, masked = by_mode[mode], by_mode[mode].get("stale_tokens_masked", 0)
            net = (m["tokens_trained"] - masked) / m["tokens_trained"] * ratios[f"{mode}_over_sync"] if masked else None
            head.append(f"{mode} / sync {fx(ratios[f'{mode}_over_sync'])} trained tokens/s"
                        + (f" ({fx(net)} counting only the tokens left in the loss)" if net is not None else "")
                        + (f" ({fx(samples)} samples/s)" if samples is not None else ""))
    return head + [f"{m['mode']} rollout efficiency {fnum(m['rollout_efficiency'])}" for m in modes if m.get("rollout_efficiency") is not None]


def _async_rows(modes: list[dict], limit: dict) -> list[list[str]]:
    """One row per mode, and the engine-alone limit last when it was measured."""
    sync = next((m for m in modes if m["mode"] == "sync"), None)
    rows = [
        [
            m["mode"], m["recipe"], fnum(m["window_s"], ".1f"), str(m["samples_trained"]), str(m["tokens_trained"]),
            fnum(m.get("generated_mean_response_tokens"), ".1f"), fnum(m.get("mean_response_tokens"), ".1f"), fnum(m["trained_tokens_per_s"], ".0f"),
            fx(m["trained_tokens_per_s"] / sync["trained_tokens_per_s"]) if sync else "-",
            fnum(m.get("rollout_efficiency")), fnum(m.get("rollout_idle_fraction")), fnum(m.get("learner_idle_fraction")),
            fnum(m.get("staleness_mean")), str(m.get("staleness_max", "-")), str(m.get("dropped_stale", "-")),
            str(m.get("stale_aborts", "-")), str(m.get("stale_tokens_masked", "-")),
        ]
        for m in modes
    ]
    if limit:
        rows.append([
            "engine alone", "-", fnum(limit["seconds"], ".1f"), str(limit["requests"]), str(limit["tokens"]), "-",
            fnum(limit["response_tokens"] / limit["requests"], ".1f"), fnum(limit["tokens_per_s"], ".0f"), "-", "1.00",
            "-", "-", "-", "-", "-", "-", "-",
        ])
    return rows


def limits(d: dict) -> list[str]:
    m, fractions = d["model"], d["w2_fraction_of_limit"]
    goals = {"sync": 0.9, "streaming": 0.8, "sao": 0.8}
    lines = [
        "## Limit model — W2 against what this machine allows (`benchmarks/limits.py`)",
        "",
        "Each piece measured alone on W2's requests: engine E = all requests at once on one vLLM engine with 1 CPU "
        "(Ray task, as in a run); g_b = batch b generated alone (stragglers included); t_b = one optimizer step on "
        "batch b, plain module, 1 torch thread (no Ray, no FSDP). sync limit = Σn_b / Σ(g_b + t_b). Then both at "
        "full load at once: capacity c = E_together / E + L_together / L (1: they time-share one core; 2: each has "
        "a core of its own); streaming limit = min(E, L, c / (1/E + 1/L)), next to min(E, L) (each side at its "
        "alone rate) and the shared-core bound 1 / (1/E + 1/L); sao limit = the same with sao's learner rate (its "
        "critic's forward and backward included) and streaming's c. Tokens = prompt + response.",
        "",
        "W2 and this run are separate sessions on a shared machine: the load-normalised fraction divides by how much "
        "faster W2's own engine-alone run was than this one's (same requests), assuming the learner sped up alike. "
        "The learner rate is measured on the stream's first batches; under `stale_policy: drop` streaming and sao "
        "train another mix (long requests dropped stale: shorter, less padded rows), so their fractions can exceed 1.",
        "",
        f"This run: 1-min load average {d['machine']['load_average_1min_start']:.1f} → {d['machine']['load_average_1min_end']:.1f}.",
        "",
        "**Headline:** " + "; ".join(f"W2 {mode} {f['fraction_of_limit_load_normalised']:.2f} of its limit load-normalised "
                                     f"(goal ≥ {goals[mode]})" for mode, f in fractions.items())
        + f"; `Engine` at {m['engine_over_vllm']:.3f} of vLLM alone on the same requests (goal ≥ 0.95), client CPU "
        f"{m['client_cpu_ms_per_request']['engine']:.2f} ms per request (vLLM alone {m['client_cpu_ms_per_request']['vllm_alone']:.2f}).",
        "",
    ]
    together = m.get("together")
    lines += table(
        ["engine tok/s", "vLLM alone tok/s", "engine ÷ vLLM", "straggler factor", "learner tok/s (" + " / ".join(m["learner_tokens_per_s"]) + " recipe)",
         "together: engine / learner tok/s (capacity c)", "sync limit tok/s", "streaming limit tok/s", "sao limit tok/s", "min(E, L)", "shared-core bound tok/s"],
        [[f"{m['engine_tokens_per_s']:.0f}", f"{m['vllm_alone_tokens_per_s']:.0f}", f"{m['engine_over_vllm']:.3f}",
          f"{m['straggler_factor']:.2f}", " / ".join(f"{v:.0f}" for v in m["learner_tokens_per_s"].values()),
          f"{together['engine_tokens_per_s']:.0f} / {together['learner_tokens_per_s']:.0f} ({m['concurrency_capacity']:.2f})" if together else "-",
          f"{m['sync_limit_tokens_per_s']:.0f}", f"{m.get('streaming_limit_measured_tokens_per_s', m['streaming_limit_tokens_per_s']):.0f}",
          fnum(m.get("sao_limit_tokens_per_s"), ".0f"),
          f"{m['streaming_limit_tokens_per_s']:.0f} ({m['streaming_bound_by']}-bound)", f"{m['shared_core_bound_tokens_per_s']:.0f}"]],
    )
    lines += wait_limit_rows(m["wait"]) if "wait" in m else []
    lines += [""] + table(
        ["W2 mode", "trained tok/s", "held to", "fraction of limit (as measured)", "machine speed W2 ÷ here", "fraction load-normalised",
         "fraction of capacity limit", "fraction of min(E, L)", "goal"],
        [[mode, f"{f['trained_tokens_per_s']:.0f}", f.get("limit", "-"), f"{f['fraction_of_limit']:.2f}", f"{f['machine_speed_ratio']:.2f}",
          f"{f['fraction_of_limit_load_normalised']:.2f}", fnum(f.get("fraction_of_capacity_limit")),
          f"{f['fraction_of_min_e_l']:.2f}" if "fraction_of_min_e_l" in f else "-", f"≥ {goals[mode]}"] for mode, f in fractions.items()],
    )
    return lines


def wait_limit_rows(w: dict) -> list[str]:
    """The straggler bound of `stale_policy: wait` (`benchmarks/wait_bound.py`): decode steps and the replay."""
    replay = w["replay_streaming"]
    return ["", "Under `stale_policy: wait` the learner waits for a group's longest sample, whose pace is the engine's decode "
            "step. Decode step seconds with n sequences running, fitted a + b·n; the queue's admission and wait gate replayed on "
            "that engine and the measured learner rates (`benchmarks/wait_bound.py`); the same replay with η = 0 is sync, a check "
            "of the model against the sync limit measured batch by batch.", ""] + table(
        ["decode step (n: ms)", "a + b·n", "replayed streaming (wait) tok/s", "replay: learner waits", "wait limit tok/s",
         "wait limit ÷ sync limit", "replayed sync ÷ sync limit"],
        [[", ".join(f"{n}: {1000 * s:.2f}" for n, s in w["step_s"].items()),
          f"{1000 * w['step_cost']['fixed_s']:.2f} + {1000 * w['step_cost']['per_sequence_s']:.3f}·n ms",
          f"{replay['tokens_per_s']:.0f}", f"{replay['learner_wait_s']:.1f} of {replay['seconds']:.1f} s",
          f"{w['wait_limit_tokens_per_s']:.0f}", f"{w['wait_limit_over_sync_limit']:.2f}×", f"{w['replay_sync_over_sync_limit']:.2f}"]],
    )


def data_scale(d: dict) -> list[str]:
    ds, new, old = d["dataset"], d["stream"], d["whole_file"]
    growth = lambda r, key: r[key] - r["rss_before_mib"]  # noqa: E731
    lines = [
        "## Data at scale (`benchmarks/data_scale.py`)",
        "",
        f"**Headline:** {ds['rows']:,} rows in {ds['files']} files: first batch of 64 prompts in {new['first_batch_s']:.2f} s, "
        f"driver RSS +{growth(new, 'rss_after_first_batch_mib'):.0f} MiB then +{growth(new, 'rss_after_batches_mib'):.0f} MiB "
        f"after {new['batches']} batches; the whole-file loader: {old['first_batch_s']:.1f} s and "
        f"+{growth(old, 'rss_after_first_batch_mib'):.0f} MiB for {old['rows']:,} rows.",
        "",
    ]
    rows = [["stream", f"{new['rows']:,}", fnum(new["index_s"]), fnum(new["first_batch_s"]), f"{growth(new, 'rss_after_first_batch_mib'):.0f}",
             f"{growth(new, 'rss_after_batches_mib'):.0f}", fnum(new["prompts_per_s"], ".0f")],
            ["whole file", f"{old['rows']:,}", "-", fnum(old["first_batch_s"]), f"{growth(old, 'rss_after_first_batch_mib'):.0f}", "-", "-"]]  # fmt: skip
    return lines + table(["loader", "rows", "index s", "first batch s", "RSS + MiB, first batch", f"RSS + MiB, {new['batches']} batches", "prompts/s"], rows)
def eval_overlap(d: dict) -> list[str]:
    """`eval_overlap.py`: per run, the learner's idle fraction inside the mid-run evaluations, blocking against not."""
    a, rows = d["args"], d["rows"]

    def median(setting: str, key: str) -> float | None:
        values = sorted(r[key] for r in rows if r["setting"] == setting and r[key] is not None)
        return values[len(values) // 2] if values else None

    workload = (
        f"the embedded default (W1 `add`, add-1m warm start, eager learner), {a['steps']} steps, an evaluation every "
        "10 steps of its 500 held-out prompts (greedy)"
        if a.get("w1")
        else f"streaming, tiny-0.3m (random init), {a['steps']} steps, an evaluation every {a['eval_every']} steps of "
        f"{a['eval_prompts']} prompts x {a['eval_samples']} samples (temperature 1, {a['max_tokens']} tokens)"
    )
    lines = [
        f"## Held-out evaluation beside training{' on W1' if a.get('w1') else ''} (`benchmarks/eval_overlap.py`)",
        "",
        f"1 engine + 1 learner rank, {workload}; `eval.blocking: true` against `false`, alternating, {a['rounds']} "
        "round(s). Idle during evaluation: 1 - learner step time inside the mid-run evaluations' windows / their time.",
        "",
        f"**Headline:** learner idle during evaluation {fnum(median('blocking', 'learner_idle_during_eval'), '.2f')} "
        f"(blocking) -> {fnum(median('non_blocking', 'learner_idle_during_eval'), '.2f')} (beside training), medians.",
        "",
    ]
    return lines + table(
        ["setting", "round", "idle during eval", "idle overall", "loop waited for mid-run evals s", "mean eval s", "wall s",
         "steps/s", "publications held back", "straddled"],
        [[r["setting"], r["round"], fnum(r["learner_idle_during_eval"]), fnum(r["learner_idle_overall"]),
          fnum(r["mid_run_eval_wait_s"], ".2f"), fnum(r["eval_s_mean"], ".1f"), fnum(r["wall_s"], ".1f"), fnum(r["steps_per_s"]),
          r["publishes_deferred"], r["evals_straddled"]] for r in rows],
    )  # fmt: skip


def queue_throughput(d: dict) -> list[str]:
    c = d["config"]
    lines = [
        "## W4 `queue` — replay queue throughput (`benchmarks/queue_throughput.py`)",
        "",
        f"{c['producers']} producers, 1 consumer, G={c['samples_per_prompt']}, {c['batch_groups']} groups per consumer step "
        f"(a learner step; each is followed by a version push to every producer, the weight sync's stand-in), "
        f"η={c['max_staleness']}, staleness check on.",
        "",
        f"**Headline:** batched / unbatched puts {fx(d.get('batched_over_unbatched'), 1)}; "
        + "; ".join(f"put batch {r['put_batch']}, {_groups(r, c)} groups/step: {r['trajectories_per_s']:.0f} trajectories/s"
                    for r in d["runs"]) + ".",
        "",
    ]
    lines += table(
        ["put batch", "groups/step", "trajectories", "seconds", "trajectories/s", "queue CPU µs/traj", "queue capacity /CPU-s", "p50 ms",
         "p99 ms", "dropped stale", "max lag"],
        [
            [r["put_batch"], _groups(r, c), r["trajectories"], fnum(r["seconds"], ".2f"), fnum(r["trajectories_per_s"], ".0f"),
             fnum(r.get("queue_cpu_us_per_trajectory"), ".0f"), fnum(r.get("queue_capacity_per_cpu_s"), ".0f"),
             fnum(r["latency_p50_ms"]), fnum(r["latency_p99_ms"]), r["dropped_stale"], r["max_lag_versions"]]
            for r in d["runs"]
        ],
    )  # fmt: skip
    lines += _queue_cpu(d["runs"], c, d.get("machine", {}).get("cpus"))
    machine = d.get("machine", {})
    if "load_average_1min_start" in machine:
        # The producers, the consumer and Ray share the CPUs with the queue: wall-clock rates follow the load.
        lines += ["", f"1-minute load average at start / end: {machine['load_average_1min_start']:.1f} / "
                      f"{machine['load_average_1min_end']:.1f} on {machine.get('cpus', '?')} CPUs."]  # fmt: skip
    return lines


def _groups(run: dict, config: dict) -> int:
    """A W4 run's groups per consumer step (results from before it varied per run have it in the config only)."""
    return run.get("batch_groups", config["batch_groups"])


def _queue_cpu(runs: list[dict], config: dict, cpus: int | None) -> list[str]:
    """Where W4's CPU goes, per process role, and the wall rate those CPU seconds allow on the machine's cores
    (results from before the roles were measured have no such table)."""
    if not all("cpu_us_per_trajectory" in r for r in runs):
        return []
    roles = ["queue", "producers", "consumer", "driver", "ray_system", "total"]
    lines = ["", f"CPU µs per trajectory of every process of the benchmark (`ray_system`: GCS, raylet and Ray's other "
                 f"processes); wall limit = {cpus or '?'} cores ÷ total CPU seconds per trajectory.", ""]  # fmt: skip
    lines += table(
        ["put batch", "groups/step", *roles, "cores busy", "wall limit traj/s", "measured traj/s"],
        [[r["put_batch"], _groups(r, config), *(fnum(r["cpu_us_per_trajectory"][k], ".0f") for k in roles), fnum(r["cpu_cores_busy"], ".2f"),
          fnum(r["wall_limit_trajectories_per_s"], ".0f"), fnum(r["trajectories_per_s"], ".0f")] for r in runs],
    )  # fmt: skip
    return lines


def algo_throughput(d: dict) -> list[str]:
    rows = sorted(d["rows"], key=lambda r: r["vs_ppo"])
    lines = [
        "## Policy-loss throughput (`benchmarks/algo_throughput.py`)",
        "",
        f"Loss + backward on a {' × '.join(str(x) for x in d.get('shape', []))} batch ({d.get('device', 'cpu')}, "
        f"{d.get('statistic', '')}), relative to `{d.get('baseline', 'ppo')}`.",
        "",
        f"**Headline:** slowest {rows[0]['case']} {fx(rows[0]['vs_ppo'])}, fastest {rows[-1]['case']} {fx(rows[-1]['vs_ppo'])} of ppo.",
        "",
    ]
    lines += table(
        ["case", "ms", "M tokens/s", f"vs {d.get('baseline', 'ppo')}"],
        [[r["case"], fnum(r["ms"]), fnum(r["tokens_per_s"] / 1e6, ".1f"), fx(r["vs_ppo"])] for r in d["rows"]],
    )
    return lines


def _first_reaching(evals: list[dict], target: float, key: str) -> float | None:
    return next((e[key] for e in evals if e["accuracy"] >= target), None)


def learning_add(d: dict) -> list[str]:
    modes, target = d["modes"], d["target"]
    lines = [
        f"## W1 `add` — learning, {d['steps']} steps (`benchmarks/learning_add.py`)",
        "",
        f"{d['steps']} optimizer steps per run from the same warm start (held-out: 500 fixed prompts, greedy); "
        f"target accuracy {target}. `trl` is the peer baseline (TRL GRPOTrainer, `benchmarks/peer_trl.py`: "
        "same model, data, group size, learning rate; its wall-clock excludes its evaluations).",
        "",
    ]
    rows = []
    for mode, r in modes.items():
        hist = r.get("staleness_histogram")
        rows.append(
            [
                mode,
                fnum(r["start_accuracy"], ".3f"),
                fnum(r["final_accuracy"], ".3f"),
                fnum(r["final_accuracy"] - r["start_accuracy"], "+.3f"),
                fnum(r["wall_clock_s"], ".0f"),
                r["samples_trained"],
                fnum(r["time_to_target_s"], ".0f"),
                fnum(r.get("time_to_target_excl_eval_s"), ".0f"),
                _first_reaching(r["evals"], target, "samples_trained") or "-",
                _first_reaching(r["evals"], target, "step") or "-",
                max((int(k) for k in hist), default=0) if hist else "-",
                fnum(r.get("mismatch_k3_mean"), ".1e"),
                fnum(r.get("parity_max_abs_diff_mean"), ".1e"),
            ]
        )
    lines += table(
        ["run", "start acc", "final acc", "gain", "wall s", "samples", "t(target) s", "t(target) s without evals", "samples(target)", "steps(target)", "staleness max", "mismatch k3", "parity"],
        rows,
    )
    lines += ["", *_equal_samples_table(modes)]
    peer = modes.get("trl", {}).get("time_to_target_s")
    if peer:
        # Older results have no evaluation-free clock: their runs' own.
        clocks = {m: r.get("time_to_target_excl_eval_s", r.get("time_to_target_s")) for m, r in modes.items() if m != "trl"}
        ratios = ", ".join(f"{m} {fx(t / peer)}" for m, t in clocks.items() if t)
        lines += ["", f"Wall-clock to reach {target} (evaluations excluded on both sides), relative to the peer (goal <= 0.7x): "
                  f"{ratios or 'no asyncrl mode reached it'}."]
        lines += _steps_times_step_time(modes, target, clocks)
    return lines + _rates_table(modes, target) + _learner_alone_line(d) + _w1_limit_table(d)


def _rates_table(modes: dict, target: float) -> list[str]:
    """Trained samples/s counted both ways (`learning_add.sample_rates`) and time to `target`, each over the peer's."""
    peer = modes.get("trl", {})
    if "sample_rates" not in peer:
        return []

    def over(value: float | None, base: float | None) -> str:
        return fx(value / base) if value and base else "-"

    rows = [[mode, fnum(r.get("s_per_256_samples"), ".3f"), fnum(r["sample_rates"]["as_trl_counts"], ".0f"),
             over(r["sample_rates"]["as_trl_counts"], peer["sample_rates"]["as_trl_counts"]),
             fnum(r["sample_rates"]["nonzero_advantage"], ".0f"),
             over(r["sample_rates"]["nonzero_advantage"], peer["sample_rates"]["nonzero_advantage"]),
             over(r.get("time_to_target_excl_eval_s"), peer.get("time_to_target_excl_eval_s"))]
            for mode, r in modes.items()]  # fmt: skip
    header = ["run", "s per 256 trained", "trained samples/s as TRL counts", "÷ peer", "non-zero-advantage samples/s", "÷ peer", f"t({target}) ÷ peer"]
    return ["", "Trained samples/s on each run's clock without evaluations, counted as the peer counts them (every sample that "
                "entered an update or asyncrl's zero-variance filter) and with a non-zero advantage only (point 6's goal: the "
                "first >= 1x the peer, time to 0.5 <= 0.7x):", "", *table(header, rows)]


def _steps_times_step_time(modes: dict, target: float, clocks: dict) -> list[str]:
    """Each mode's wall-clock ratio to the peer, factored as (optimizer steps to the target) x (seconds per step)."""
    peer_steps = _first_reaching(modes["trl"]["evals"], target, "step")
    parts = []
    for mode, t in clocks.items():
        steps = _first_reaching(modes[mode]["evals"], target, "step")
        if t and steps and peer_steps:
            step_ratio = (t / steps) / (modes["trl"]["time_to_target_s"] / peer_steps)
            parts.append(f"{mode} {fx(steps / peer_steps)} the steps × {fx(step_ratio)} the seconds per step")
    if not parts:
        return []
    return ["", f"The same ratios factored as optimizer steps to {target} (evaluated every {_eval_interval(modes['trl']['evals'])} steps) "
                f"times seconds per step, each against the peer's {peer_steps} steps: {'; '.join(parts)}."]


def _eval_interval(evals: list[dict]) -> int | str:
    return evals[1]["step"] - evals[0]["step"] if len(evals) > 1 else "-"


def _learner_alone_line(d: dict) -> list[str]:
    """The learner's step alone (`learning_add.learner_alone`) next to the peer's whole step, the same session."""
    alone = d.get("learner_alone")
    if not alone:
        return []
    threads = ", ".join(f"{t} thread{'s' if t != '1' else ''} {s:.3f} s" for t, s in alone["s_per_256_samples"].items())
    peer = d["modes"].get("trl", {}).get("s_per_256_samples")
    peer_note = f"; the peer's whole step (generation and training, one process): {peer:.3f} s" if peer else ""
    sync = alone.get("sync_recipe_s_per_256_samples", {}).get("2")
    sync_note = f" Sync's own recipe (GRPO) on the same batches, 2 threads: {sync:.3f} s (the sync limit's learner)." if sync else ""
    return ["", f"The learner alone (streaming's optimizer step on the batches that run trained, nothing else running, median of "
                f"{alone['steps']} steps), per 256 samples: {threads}{peer_note}. The runs give the learner "
                f"{alone['threads_in_runs']} thread: no asynchronous mode can train faster than its learner alone.{sync_note}"]


def _w1_limit_table(d: dict) -> list[str]:
    """W1's limit model (`limits.w1_limit`, the same session) and each mode's trained samples/s against it."""
    limit = d.get("limit")
    if not limit:
        return []
    lines = [""]
    for mode in ("streaming", "sao"):
        if m := limit.get(mode):
            # The 2-thread figure is sync's recipe where the run timed it (older results: streaming's).
            recipe = {"2": ", sync's recipe"} if "sync_recipe_s_per_256_samples" in d.get("learner_alone", {}) else {}
            learner = ", ".join(f"{v:.0f} ({t} thread{'s' if t != '1' else ''}{recipe.get(t, '')})" for t, v in m["learner_samples_per_s"].items())
            sync = f"; sync limit {m['sync_limit_samples_per_s']:.0f} (each batch generated at once with the groups the filter discards, then trained on 2 threads)" if "sync_limit_samples_per_s" in m else ""
            lines.append(f"W1 limit model of {mode} (`limits.w1_limit`, on its run's batches): engine alone {m['engine_generated_samples_per_s']:.0f} "
                         f"generated samples/s = {m['engine_samples_per_s']:.0f} trained ({m['generated_per_trained']:.2f} generated per trained); "
                         f"learner alone {learner} trained samples/s; both at once c = {m['concurrency_capacity']:.2f}; limit min(E, L, c / (1/E + 1/L)) = "
                         f"{m['limit_samples_per_s']:.0f} ({m['bound_by']}-bound){sync}.")  # fmt: skip
    keys = ("limit_over_peer", "over_peer", "limit_over_peer_informative", "over_peer_informative")
    rows = [[mode, f"{r['samples_per_s']:.0f}", f"{r['limit_samples_per_s']:.0f}", f"{r['fraction_of_limit']:.2f}", *(fx(r.get(k)) for k in keys)]
            for mode, r in limit["runs"].items() if mode != "trl"]  # fmt: skip
    peer = limit["runs"].get("trl", {})
    if "informative_samples_per_s" in peer:
        lines += ["", f"The peer trains every group; {peer['informative_samples_per_s']:.0f} of its {peer['samples_per_s']:.0f} samples/s "
                      "had a non-zero advantage (its groups with all rewards equal left out, as asyncrl's filter leaves them out "
                      "before its learner): the `informative` columns divide by that."]
    header = ["mode", "trained samples/s", "its limit", "fraction of limit", "limit ÷ peer", "run ÷ peer", "limit ÷ peer informative", "run ÷ peer informative"]
    return [*lines, "", *table(header, rows)]


def _equal_samples_table(modes: dict) -> list[str]:
    """Accuracy at sample counts every run reached (the last evaluation at or before each), milestone times on
    each run's clock without evaluations, and seconds per 256 trained samples."""
    reach = min(r["evals"][-1]["samples_trained"] for r in modes.values())
    points = [reach * k // 4 for k in (1, 2, 4)]

    def acc_at(evals: list[dict], n: int) -> float | None:
        done = [e["accuracy"] for e in evals if e["samples_trained"] <= n]
        return done[-1] if done else None

    rows = [
        [mode, *(fnum(acc_at(r["evals"], n), ".3f") for n in points), fnum(r.get("time_to_0.5_s"), ".0f"),
         fnum(r.get("time_to_0.7_s"), ".0f"), fnum(r.get("s_per_256_samples"), ".2f")]
        for mode, r in modes.items()
    ]
    return table(["run", *(f"acc @ {n:,} samples" for n in points), "t(0.5) s", "t(0.7) s", "s per 256 samples"], rows)


def learning_add_mini_batches(d: dict) -> list[str]:
    """The W1 comparison of one against several updates per rollout batch (`--mini-batches N`)."""
    lines = learning_add(d)
    mb_set = " ".join(arg for arg in d.get("command", "").split() if "=" in arg)
    lines[0] = f"## W1 `add` — one vs several updates per rollout batch, {mb_set or 'the same settings'} (`benchmarks/learning_add.py --mini-batches`)"
    lines[2] = (f"`{d.get('command', 'learning_add.py --mini-batches N')}`: the same mode with one optimizer step per rollout batch "
                f"and with several (`_mbN`), {d['steps']} steps each from the same warm start; held-out accuracy per trained sample "
                "is what compares them (wall-clock moves with the machine's load).")
    means = ", ".join(f"{mode} {sum(e['accuracy'] for e in r['evals']) / len(r['evals']):.3f}" for mode, r in d["modes"].items())
    return lines + ["", f"Mean held-out accuracy over the evaluations (every 1,280 samples, the area under the per-sample curve): {means}."]


def profile(d: dict) -> list[str]:
    label = f" — {d['label']}" if d.get("label") else ""
    load = d.get("machine", {})
    load_note = f" 1-min load average {load['load_average_1min_start']:.1f} → {load['load_average_1min_end']:.1f}." if load else ""
    lines = [
        f"## Profile{label} — where the time goes (`benchmarks/profile_run.py`)",
        "",
        f"py-spy on every process of `asyncrl run {Path(d['config']).name} {' '.join(d['overrides'])}` for "
        f"{d['duration_s']:.0f} s of training; cores = CPU time / wall time while sampled (py-spy itself adds load).{load_note}",
        "",
    ]
    if "trained_samples_per_s" in d:
        lines += [f"The learner trained {d['trained_samples_per_s']:.0f} samples/s meanwhile; CPU ms per trained sample "
                  "compares profiles taken at different loads.", ""]
    if "machine_cores" in d:
        m = d["machine_cores"]
        lines += [f"The whole machine meanwhile: {m['busy_cores']:.2f} cores busy, {m['idle_cores']:.2f} idle, "
                  f"{m['steal_cores']:.2f} taken by the hypervisor.", ""]
    rows = []
    for role, r in d["processes"].items():
        top = "; ".join(f"{frame} {share:.0%}" for frame, share in r.get("self", [])[:3])
        threads = ", ".join(f"{name} {cores:.2f}" for name, cores in r.get("threads", [])[:3])
        rows.append([role, f"{r['cpu_cores']:.2f}", fnum(r.get("cpu_ms_per_trained_sample")), threads or "-", r["samples"], top or "-"])
    return lines + table(["process", "cores", "CPU ms / trained sample", "busiest threads (cores)", "samples", "largest self shares"], rows)


def staleness_w1(d: dict) -> list[str]:
    lines = ["## W1 `add` — the staleness bound `buffer.max_staleness` (η), streaming", "", f"{d['workload']}; `{d['command']}`.", ""]
    rows = []
    for name, r in sorted(d["runs"].items(), key=lambda kv: (kv[1]["max_staleness"], kv[1]["code"] != "main", kv[1]["finished_utc"])):
        at = dict((step, acc) for step, acc in r["heldout"])
        rows.append([name, r["code"], r["max_staleness"], r["finished_utc"], fnum(r["median_s_per_step"], ".3f"), fnum(r["learner_wait_s_mean"], ".3f"),
                     fnum(r["staleness_mean"]), f"{fnum(at.get(60), '.3f')} / {fnum(r['final'], '.3f')}", r["samples_to_0.5"] or "-", fnum(r["s_to_0.5_excl_eval"], ".1f")])
    return lines + table(["run", "code", "η", "ended (UTC)", "median s per step", "learner wait s (mean)", "staleness mean",
                          "held-out at step 60 / 120", "samples to 0.5", "s to 0.5 without evals"], rows)


def soak(d: dict) -> list[str]:
    m = d["machine"]
    lines = [
        "## Soak — a long run under real faults (`benchmarks/soak.py`)",
        "",
        f"`{d['command']}`: {d['wall_minutes']} min wall, {len(d['legs'])} resumed legs "
        f"({', '.join(leg['ending'] for leg in d['legs'])}), {d['steps']} steps, {d['trained_samples']} samples trained; "
        f"load average {m['load_average_1min_start']:.1f} at start, {m['load_average_1min_end']:.1f} at end on {m['cpus']} CPUs.",
        f"Samples lost: {d['prompts_lost']} (conservation counters), {d['lost_by_id']} (logs by id); "
        f"trained twice: {d['trained_twice']['by_id']} (logs by id; {d['ledger']['kept_verified']} kept samples read, "
        f"{d['ledger']['kept_unverifiable']} in logs a crash cut).",
        "",
    ]
    rows = []
    for kind, n in d["faults_by_kind"].items():
        of_kind = [f for f in d["faults"] if f["kind"] == kind]
        recovery = [f["recovery_s"] for f in of_kind if f.get("recovery_s") is not None]
        before = [f["samples_per_s_before"] for f in of_kind if f.get("samples_per_s_before") is not None]
        after = [f["samples_per_s_after"] for f in of_kind if f.get("samples_per_s_after") is not None]
        rows.append([kind, n["injected"], n["survived"], n["not_known"], _spread(recovery), _spread(before), _spread(after)])
    header = ["fault", "injected", "survived", "not known", "recovery s (min-max)", "samples/s 60 s before", "samples/s 60 s after"]
    legend = [
        "",
        "Recovery: engine — from the pool noticing the death to the replacement serving the latest weights; tool "
        "worker — from the injection to the next trained step; SIGTERM, driver and learner-rank kills — from the signal "
        "to the next leg's first step (a whole restart and resume). Not known: the leg, or the next one, ended before "
        "the outcome showed (the last leg's ending always). Samples/s: `-` where the window is not covered by steps.",
    ]
    return lines + table(header, rows) + legend


def agent_tool(d: dict) -> list[str]:
    m = d.get("machine", {})
    lines = ["## Agent tools and user rewards through the sandboxed pool (`benchmarks/agent_tool.py`)", "",
             f"{d['sandbox']} sandbox; 1-min load average {m.get('load_average_1min_start', 0):.1f} → {m.get('load_average_1min_end', 0):.1f}.", ""]  # fmt: skip
    lines += table(
        ["call", "p50 ms", "p99 ms"],
        [["calculator (warm)", d["calculator_p50_ms"], d["calculator_p99_ms"]], ["python (warm)", d["python_p50_ms"], d["python_p99_ms"]],
         ["sandbox start", "-", d["sandbox_start_p99_ms"]]],
    )  # fmt: skip
    lines += ["", "Back-to-back `python` calls/s by tool workers: "
              + ", ".join(f"{w}: {r}" for w, r in d["python_calls_per_s_by_workers"].items()) + "."]  # fmt: skip
    runs = d.get("reward_runs")
    if runs:
        c = d["config"]
        lines += ["", f"User reward `{d['reward']}` (imports sympy), {c['reward_calls_in_flight']} calls in flight on 2 workers; "
                  f"the default ÷ a fresh process per call: **{fx(d['reward_default_over_fresh_process'], 1)}**.", ""]  # fmt: skip
        lines += table(
            ["tools.reward_process_calls", "tools.reward_batch", "calls/s", "÷ fresh process", "p50 ms", "p99 ms", "calls"],
            [[r["reward_process_calls"], r["reward_batch"], r["calls_per_s"], fx(r["speedup"], 1), r["p50_ms"], r["p99_ms"], r["n"]] for r in runs],
        )
    return lines


def logprob_layout(d: dict) -> list[str]:
    c = d["config"]
    lines = ["## Engine client CPU per request by log-prob layout (`benchmarks/logprob_layout.py`)", "",
             f"In-process `Engine` ({c['model']}), {c['in_flight']} requests in flight, layouts alternating over {c['rounds']} rounds of "
             f"{c['requests_per_round']} requests (the first {c['warm_rounds']} not counted); medians of this process's CPU time.", ""]  # fmt: skip
    return lines + table(
        ["response tokens", "flat µs/request", "dict µs/request", "dict ÷ flat"],
        [[r["tokens"], r["flat_us_per_request"], r["dict_us_per_request"], fx(r["dict_over_flat"])] for r in d["runs"]],
    )


def client_floor(d: dict) -> list[str]:
    c, us, mean, cores, full = d["config"], d["us_per_sample"], d["mean_us_per_sample"], d["cores_at_rate"], d["full_collections"]
    heap = "frozen at start (`Engine.start`)" if d["freeze"] else "not frozen (`--no-freeze`: the code before)"
    lines = [f"## Rollout worker floor at W1 — engine client CPU per sample, heap {heap} (`benchmarks/client_floor.py`)", "",
             f"In-process, alternating rounds of {c['prompts']} prompts × G={c['group']} samples of {c['tokens']} tokens ({c['model']}, all at once, "
             f"the first {c['warm_rounds']} not counted): `Engine.generate` against raw vLLM (one n = G request per group, one final output, "
             "flat log-probs), this process's CPU time; cores at W1's trained rate.", ""]  # fmt: skip
    return lines + table(
        ["client", "median µs/sample", "mean µs/sample", f"cores at {c['rate']:.0f} samples/s (mean)", "full collections (s)"],
        [["Engine", f"{us['engine']:.0f}", f"{mean['engine']:.0f}", f"{cores['engine']:.3f}", f"{full['count']} ({full['seconds']:.2f})"],
         ["vLLM alone", f"{us['vllm']:.0f}", f"{mean['vllm']:.0f}", f"{cores['vllm']:.3f}", "(same process)"]],
    )


def engine_start(d: dict) -> list[str]:
    ratio = d["server_over_spawn"]
    lines = ["## Engine start-up in a rollout worker — the engine core forked from a preloaded server (`benchmarks/engine_start.py`)", "",
             f"An `Engine` on tiny-0.3m (context {d['max_model_len']}) started in a fresh Ray actor of {d['rollout_cpus']:g} CPU, {d['pairs']} pairs "
             "alternating: `server` forks vLLM's engine core from a server that imported it while the actor imported vLLM "
             "(`vllm_compat.start_engine_core_server`), `spawn` lets vLLM spawn it (a second import: the code before).", "",
             f"**Headline:** serving {fx(ratio['serving_s'])} the seconds after the actor's creation "
             f"({d['server']['serving_s']:.1f} against {d['spawn']['serving_s']:.1f} s, medians).", ""]  # fmt: skip
    rows = [[r["variant"], f"{r['serving_s']:.1f}", f"{r['engine_start_s']:.1f}"] for r in d["runs"]]
    return lines + table(["variant (in run order)", "actor created → serving s", "engine start s"], rows)


def model_scale(d: dict) -> list[str]:
    c, phases = d["config"], d["phases_s"]
    steps = d["steps"]
    flag = "".join(f" --{key.replace('_', '-')} {c.get(key, 0)}" for key, default in (("dtype", "float32"), ("mmap_threshold", 131072)) if c.get(key, 0) != default)
    lines = [f"## Scale — a Qwen2.5-0.5B-shaped model through a real run on the CPU (`benchmarks/model_scale.py{flag}`)", "",
             f"{c['parameters'] / 1e6:.1f}M parameters (hidden {c['shape']['hidden']}, {c['shape']['layers']} layers, {c['shape']['heads']} heads, "
             f"{c['shape']['kv_heads']} KV heads, intermediate {c['shape']['intermediate']}, tied embeddings, production BPE vocabulary of "
             f"{c['vocab_size']:,}), random init, {c['dtype']}, weights to the engine over `{c.get('transport', 'auto')}`, loaded `{c.get('weight_load', 'auto')}`; {c['steps']} steps of {c['prompts_per_step']} prompts × {c['samples_per_prompt']} "
             f"samples, {c['max_tokens']} new tokens; {c['learner_ranks']} FSDP2 learner ranks over gloo, {c['engines']} vLLM CPU engine, a weight "
             f"sync and a parity probe after every step. `{d['command']}`, {d['date']}.", "",
             f"**Headline:** load {d['load_s']:.0f} s (engine serving at {phases.get('engines ready', float('nan')):.0f} s, learner ready at "
             f"{phases.get('learner ready', float('nan')):.0f} s); step {_spread([round(s['step_s'], 1) for s in steps])} s; sync "
             f"{_spread([round(s['sync_s'], 2) for s in steps if s['sync_s'] is not None])} s for {steps[0]['sync_gb']:.2f} GB; parity after every "
             f"sync ≤ {max((s['parity'] for s in steps if s['parity'] is not None), default=float('nan')):.1e}; all processes' PSS peaked at "
             f"{d['total_pss_peak_gb']:.1f} GB." + (f" **The run died:** {d['error'].splitlines()[0][:300]}" if d.get("error") else ""), ""]  # fmt: skip
    lines += table(["step", "step s", "learner wait s", "sync s", "sync GB", "parity after", "samples", "tokens"],
                   [[s["step"], f"{s['step_s']:.1f}", f"{s['learner_wait_s']:.1f}", fnum(s["sync_s"], ".2f"), f"{s['sync_gb']:.2f}",
                     "-" if s["parity"] is None else f"{s['parity']:.1e}", s["samples"], s["tokens"]] for s in steps])  # fmt: skip
    lines += [""] + table(["process", "peak RSS GB (VmHWM)", "peak PSS GB"],
                          [[m["process"], f"{m['peak_rss_gb']:.2f}", f"{m['peak_pss_gb']:.2f}"] for m in d["memory"]]
                          + [["all processes, PSS summed", "-", f"{d['total_pss_peak_gb']:.2f}"]])  # fmt: skip
    return lines


def weight_sync_gpu(d: dict) -> list[str]:
    m = d["machine"]
    where = f"{m.get('gpu', m['device'])}, torch {m['torch']}" + (f", NCCL {m['nccl']}" if "nccl" in m else "")
    title = ("## W3 wire on a GPU — collective transport over NCCL, and the IPC limit (`benchmarks/weight_sync_gpu.py`)" if "gpu" in m
             else "## W3 wire on the CPU — gloo and shared memory (`benchmarks/weight_sync_gpu.py --device cpu`)")  # fmt: skip
    lines = [title, "",
             f"Two processes (learner rank 0 and an engine's worker, no Ray or vLLM) on {where}, {m['date']}; {d['versions']} syncs per row, "
             "the first (set-up) apart, the others' median. vs copy: one device copy of the same bytes ÷ the sync (a sync copies at least twice).", ""]  # fmt: skip
    rows = [[r["transport"], r["size"], r["dtype"], f"{r['bytes'] / 1e6:.1f}", fnum(r["first_total_s"], ".4f"), fnum(r["total_s"], ".4f"),
             f"{r['stage_s']:.4f} + {r['load_s']:.4f}", f"{r['bytes_per_s'] / 1e9:.2f}", fnum(r["vs_copy"], ".3f"), f"{r['parity']:.0e}"]
            for r in d["rows"] if "error" not in r]  # fmt: skip
    lines += table(["transport", "size", "dtype", "MB", "first sync s", "sync s", "stage + load s", "GB/s", "vs copy", "parity"], rows)
    for r in d["rows"]:
        if "error" in r:
            lines += ["", f"{r['transport']} ({r['size']}) did not run: {r['error']}"]
    return lines


def agent_learning(d: dict) -> list[str]:
    lines = ["## `calc` agent task — learning with a calculator tool (`benchmarks/agent_learning.py`)", "",
             f"{d['steps']} steps per recipe from the same warm start, one after the other in one Ray session; held-out: greedy "
             "episodes on 200 fixed problems; train s and episodes/s leave the evaluations out.", ""]  # fmt: skip
    lines += table(
        ["recipe", "success", "tool-call rate", "train s", "episodes", "episodes/s", "curve (train s, success)"],
        [[name, f"{r['start_success']:.3f} → {r['final_success']:.3f}", f"{r['start_tool_call_rate']:.3f} → {r['final_tool_call_rate']:.3f}",
          f"{r['train_wall_s_excl_eval']:.0f}", r["episodes_trained"], f"{r['episodes_per_s']:.1f}",
          ", ".join(f"({s:.0f}, {a:.3f})" for s, a, _ in r["curve"])] for name, r in d["recipes"].items()],
    )  # fmt: skip
    return lines


def agent_recipes(d: dict) -> list[str]:
    title = d.get("title", "Agent recipes — do they hold their gains?")
    lines = [f"## {title} (`benchmarks/agent_recipes.py`)", "",
             "Each recipe over twice its default steps, one `asyncrl run` per seed; held-out: greedy episodes on fixed problems. "
             f"drop: the most an evaluation falls below the best one before it; a recipe holds when every seed's drop is at most {d['tolerance']}."
             + (f" Overrides: `{' '.join(d['overrides'])}`." if d.get("overrides") else ""), ""]  # fmt: skip
    lines += table(
        ["recipe", "seed", "steps", "start", "best (step)", "final", "drop", "holds", "curve (step, success)"],
        [[name, s["seed"], r["steps"], f"{s['start']:.3f}", f"{s['best']:.3f} ({s['best_step']})", f"{s['final']:.3f}", f"{s['drop']:.3f}",
          "yes" if r["holds"] else "no", ", ".join(f"({step}, {a:.3f})" for step, a, _ in s["curve"])]
         for name, r in d["recipes"].items() for s in r["seeds"]],
    )  # fmt: skip
    return lines


def agent_framework(d: dict) -> list[str]:
    """`agent_recipes`' table for runs driven by an agent framework, with its own account of what was run, each
    run's gain over its start, the overrides a seed's run had of its own (a second `agent_recipes.py` call's seed
    added to the file) and the supervised start it built."""
    lines = agent_recipes(d)
    lines[2] = ("Each run driven by the OpenAI Agents SDK through the endpoint (`rollout.openai_agent: asyncrl.envs.agents_sdk:agent`); "
                "held-out: greedy SDK episodes on fixed problems; gain: best minus start (issue #53.2 asks ≥ 0.3); drop and holds as in the agent recipes' table."
                + (f" Overrides: `{' '.join(d['overrides'])}`." if d.get("overrides") else ""))  # fmt: skip
    rows = [[name, s["seed"], " ".join(f"`{o}`" for o in s.get("overrides", [])) or "—", f"{s['best'] - s['start']:+.3f}",
             *_built_start(s.get("warm_start"))] for name, r in d["recipes"].items() for s in r["seeds"]]  # fmt: skip
    return lines + [""] + table(["recipe", "seed", "run's own overrides", "gain", "start: steps", "seconds", "validation success (step, value)"], rows)


def _built_start(w: dict | None) -> list[str]:
    if not w:
        return ["given (`model.path`)", "—", "—"]
    curve = ", ".join(f"({step}, {v:.2f})" for step, v in w.get("validation_success", [])[-3:])  # the last checks
    return [str(w["steps"]), f"{w['train_seconds']:.0f}", curve or "—"]


def openai_endpoint(d: dict) -> list[str]:
    lines = ["## Agent endpoint — the OpenAI-compatible server over the engine (`benchmarks/openai_endpoint.py`)", "",
             f"{d['rounds']} chat calls through the real `openai` client, {d['calls_per_episode']} per episode, {d['max_tokens']} tokens each "
             f"(prompts up to {d['prompt_tokens_max']} tokens); each against the same request sent to the engine directly with the same seed "
             "(same tokens). Overhead: the endpoint's time outside the engine's own call.", ""]  # fmt: skip
    return lines + table(
        ["endpoint ms (median)", "engine direct ms (median)", "endpoint − direct ms (median)", "overhead ms (median)", "overhead ms (p90)", "token drift"],
        [[f"{d['endpoint_ms_median']:.1f}", f"{d['direct_ms_median']:.1f}", f"{d['endpoint_minus_direct_ms_median']:.1f}",
          f"{d['overhead_ms_median']:.1f}", f"{d['overhead_ms_p90']:.1f}", d["drift"]]],
    )  # fmt: skip


def fsdp_rank(d: dict) -> list[str]:
    steps, memory = d["step_time"], d["memory"]
    whole = memory[0]["ranks"][0]
    held_whole = whole["param_bytes"] + whole["optimizer_bytes"]
    sharded = [r for m in memory if m["num_ranks"] > 1 for r in m["ranks"]]
    held = ", ".join(f"{(r['param_bytes'] + r['optimizer_bytes']) / held_whole:.3f}" for r in sharded)
    rss = ", ".join(f"{r['rss_growth_bytes'] / whole['rss_growth_bytes']:.2f}" for r in sharded)
    ratios = ", ".join(f"{t['ratio']:.2f}× in {t['dtype']}" for t in steps)
    lines = [
        "## FSDP2 on the learner: one rank wrapped, and two ranks sharding (`benchmarks/fsdp_rank.py`)",
        "",
        f"**Headline:** one rank wrapped in FSDP2 (`learner.fsdp: always`) ÷ plain, median step: {ratios}; each of two "
        f"ranks holds {held} of one rank's fp32 parameters and AdamW moments ({rss} of its resident growth).",
        "",
    ]
    lines += table(
        ["dtype", "model", "batch (rows × tokens)", "plain s / step", "wrapped s / step", "wrapped ÷ plain"],
        [[t["dtype"], d["step_preset"], f"{t['rows']} × {t['tokens']}", fnum(t["plain_s"], ".3f"), fnum(t["wrapped_s"], ".3f"), fx(t["ratio"])]
         for t in steps],
    )  # fmt: skip
    lines += [""]
    lines += table(
        ["ranks", "`learner.fsdp`", "rank", "params + AdamW held, MB", "÷ one rank", "computed need, MB", "RSS growth, MB", "÷ one rank",
         "peak RSS, MB", "peak over the RSS before loading, MB", "÷ one rank"],
        [[m["num_ranks"], m["fsdp"], r["rank"], f"{(r['param_bytes'] + r['optimizer_bytes']) / 1e6:.1f}",
          f"{(r['param_bytes'] + r['optimizer_bytes']) / held_whole:.3f}", f"{m['need_bytes'] / 1e6:.1f}",
          f"{r['rss_growth_bytes'] / 1e6:.0f}", f"{r['rss_growth_bytes'] / whole['rss_growth_bytes']:.2f}", f"{r['peak_rss_bytes'] / 1e6:.0f}",
          f"{_peak_growth(r) / 1e6:.0f}", f"{_peak_growth(r) / _peak_growth(whole):.2f}"]
         for m in memory for r in m["ranks"]],
    )  # fmt: skip
    return lines


def activation_checkpointing(d: dict) -> list[str]:
    cases = d["cases"]
    headline = "; ".join(f"{c['batch']}: {fx(c['time_ratio'])} the step time, {c['activation_ratio']:.2f} of the peak "
                         "activations" for c in cases)  # fmt: skip
    lines = [
        "## Activation checkpointing on the learner (`benchmarks/activation_checkpointing.py`)",
        "",
        f"**Headline:** `learner.activation_checkpointing` ÷ without, {d['preset']}, one rank, one thread, fp32: {headline}.",
        "",
    ]
    mb = lambda n: f"{n / 1e6:.1f}"  # noqa: E731
    lines += table(
        ["batch", "rows × tokens", "plain s / step", "checkpointed s / step", "÷", "peak over (B × L)",
         "activations MB, plain", "checkpointed", "÷", "peak MB in all, plain", "checkpointed"],
        [[c["batch"], f"{c['rows']} × {c['tokens']}", fnum(c["plain_s"], ".3f"), fnum(c["checkpointed_s"], ".3f"),
          fx(c["time_ratio"]), " × ".join(map(str, c["peak_tokens"])), mb(c["plain_peak"]["activation"]),
          mb(c["checkpointed_peak"]["activation"]), f"{c['activation_ratio']:.2f}", mb(c["plain_peak"]["total"]),
          mb(c["checkpointed_peak"]["total"])] for c in cases],
    )  # fmt: skip
    return lines


def packing(d: dict) -> list[str]:
    heads = []
    for w in d["workloads"]:
        lay = w["layouts"]
        heads.append(f"{w['workload']}: packed {fx(lay['packed']['vs_padded'])}, shared prompts {fx(lay['shared']['vs_padded'])} "
                     f"(padding {lay['padded']['padding_frac']:.2f} → {lay['packed']['padding_frac']:.2f})")  # fmt: skip
    lines = [
        "## Sequence packing and shared group prompts on the learner (`benchmarks/packing.py`)",
        "",
        f"**Headline:** {d['preset']}, one rank, one thread, fp32, median step ÷ padded rows: {'; '.join(heads)}.",
        "",
    ]
    lines += table(
        ["workload", "layout", "micro-batches", "slots", "padding", "prompt recompute saved", "s / step", "s / 256 samples",
         "ms / 1k trained tokens", "÷ padded"],
        [[w["workload"], name, r["micro_batches"], r["slots"], f"{r['padding_frac']:.3f}", f"{r['recompute_saved_frac']:.3f}",
          fnum(r["step_s"], ".3f"), fnum(r["per_256_samples_s"], ".3f"), fnum(r["per_1k_tokens_s"] * 1000, ".1f"), fx(r["vs_padded"])]
         for w in d["workloads"] for name, r in w["layouts"].items()],
    )  # fmt: skip
    return lines


def activation_checkpointing_gpu(d: dict) -> list[str]:
    cases = d["cases"]
    lines = [
        "## Activation checkpointing on a GPU (`benchmarks/activation_checkpointing_gpu.py`)",
        "",
        f"{d['model']}, one rank wrapped in FSDP2 on {d['device']}, torch {d['torch']}, {d['date']}: {d['note']}.",
        "",
        f"**Headline:** peak memory of the pass {min(c['peak_ratio'] for c in cases):.2f}–"
        f"{max(c['peak_ratio'] for c in cases):.2f} of the plain one's, at {min(c['time_ratio'] for c in cases):.2f}–"
        f"{max(c['time_ratio'] for c in cases):.2f}× its time; the gradient differs as much as two plain passes do.",
        "",
    ]
    gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
    lines += table(
        ["dtype", "rows × length", "peak GB, plain", "checkpointed", "÷", "s, plain", "checkpointed", "÷",
         "max abs grad diff vs plain", "plain vs plain again", "max abs grad"],
        [[c["dtype"].removeprefix("torch."), f"{c['rows']} × {c['length']}", gb(c["plain_peak_over_base_bytes"]),
          gb(c["ckpt_peak_over_base_bytes"]), f"{c['peak_ratio']:.2f}", fnum(c["plain_s"], ".3f"),
          fnum(c["ckpt_s"], ".3f"), fx(c["time_ratio"]), f"{c['max_grad_diff']:.1e}",
          f"{c['max_grad_diff_plain_again']:.1e}", f"{c['max_grad']:.0f}"] for c in cases],
    )  # fmt: skip
    return lines


def _peak_growth(rank: dict) -> int:
    """A rank's peak resident memory above what it had before loading the model (`fsdp_rank.py`)."""
    return rank["peak_rss_bytes"] - (rank["rss_bytes"] - rank["rss_growth_bytes"])


def _spread(values: list[float]) -> str:
    return "-" if not values else f"{min(values):g}" if min(values) == max(values) else f"{min(values):g}-{max(values):g}"


def generic(name: str, d: dict) -> list[str]:
    scalars = {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool)) and v is not None}
    lines = [f"## {name}", ""]
    lines += table(["key", "value"], [[k, v] for k, v in scalars.items()])
    return lines


def moe_routing_replay(d: dict) -> list[str]:
    rows = d["rows"]
    flips = sum(r["figures"]["flipped_token_fraction"] > 0 for r in rows)
    worst = max(r["figures"]["with_replay"]["logprob_abs_diff_max"] for r in rows)
    return [
        "## MoE engine ↔ learner parity with and without routing replay (`benchmarks/moe_routing_replay.py`)",
        "",
        f"{d['model']}; {d['prompts']} prompts of {d['prompt_len']} random tokens, {d['tokens']} sampled tokens each "
        "(temperature 1), one in-process vLLM engine recording its routes per MoE layer, scored by the learner "
        "(`PolicyModel`) routing itself and replaying vLLM's routes. dlogp: |learner - rollout log-prob| over the "
        "sampled tokens (`mismatch_metrics`); flipped: tokens routed to another expert set in some layer; "
        "no flip / after flip: tokens with no flip at or before them in their row / the others.",
        "",
        f"**Headline:** {flips} of {len(rows)} configurations had a route flip; max |dlogp| with replay ≤ {worst:.1e}.",
        "",
        d["table"],
    ]


def weight_sync_delta(d: dict, title: str = "## W3 `delta` — full vs delta payloads, and the export without a gather (`benchmarks/weight_sync_delta.py`)") -> list[str]:
    lines = [title, ""]
    wire, steps, export = d.get("wire", []), d.get("steps", []), d.get("export", [])
    if wire:
        lines += [
            "Wire only (no Ray, no engine; one thread each side): a fraction of every tensor's elements moved by one "
            "unit in the last place; full = pack every tensor into safetensors buckets + unpack; delta = "
            "`DeltaEncoder.encode` + pack, unpack + `DeltaMirror.apply` (CRCs and digest check included).",
            "",
            "| preset | dtype | changed | delta bytes | ÷ full | sparse / changed tensors | learner s delta / full | engine s delta / full | seconds ÷ full |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['preset']} | {r['dtype']} | {r['fraction']:g} | {r['delta_bytes'] / 1e6:.1f} MB | {r['bytes_ratio']:.3f} | "
            f"{r['sparse_tensors']} / {r['changed_tensors']} of {r['tensors']} | {r['delta_learner_s']:.2f} / {r['full_learner_s']:.2f} | "
            f"{r['delta_engine_s']:.2f} / {r['full_engine_s']:.2f} | {r['seconds_ratio']:.2f} |"
            for r in wire
        ]  # fmt: skip
        lines.append("")
    if steps:
        lines += ["One AdamW step (weight decay 0) from the same weights: the fraction of elements whose bits changed in "
                  "the engines' dtype, and the delta's bytes over the full payload's.", "",
                  "| preset | lr | dtype | elements changed | delta ÷ full bytes |", "|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['preset']} | {r['lr']:g} | {r['dtype']} | {r['changed_fraction']:.4f} | {r['bytes_ratio']:.3f} |" for r in steps]
        lines.append("")
    if d.get("e2e"):
        lines += ["Through a vLLM engine (1 learner rank, 1 engine, fp32, in place, Ray's object store): `start` → the "
                  "engine serves the version; median of the syncs of each kind.", "",
                  "| preset | sync | seconds (median) | MB | parity after (max) |", "|---|---|---|---|---|"]  # fmt: skip
        for kind in dict.fromkeys(r["kind"] for r in d["e2e"]):
            rows = [r for r in d["e2e"] if r["kind"] == kind]
            secs = sorted(r["seconds"] for r in rows)
            lines.append(f"| {rows[0]['preset']} | {kind} | {secs[len(secs) // 2]:.3f} | {rows[0]['bytes'] / 1e6:.1f} | "
                         f"{max(r['parity_after'] for r in rows):.1e} |")  # fmt: skip
        lines.append("")
    if export:
        lines += ["`export_shared` on a 2-rank FSDP2 learner (gloo): the full state gathered on rank 0, which writes it, "
                  "against every rank writing its own dim-0 rows into the segment.", "",
                  "| preset | path | seconds (each export) | median |", "|---|---|---|---|"]  # fmt: skip
        for path in ("gather", "rows"):
            rows = [r for r in export if r["path"] == path]
            if rows:
                secs = sorted(r["seconds"] for r in rows)
                lines.append(f"| {rows[0]['preset']} | {path} | {', '.join(f'{x:.3f}' for x in (r['seconds'] for r in rows))} | {secs[len(secs) // 2]:.3f} |")
        lines.append("")
    return lines


def lora(d: dict) -> list[str]:
    """`lora.py`: W1 streaming with `learner.lora` next to full fine-tuning over the same steps, and each run's sync."""
    rows = [
        [mode, fnum(r["start_accuracy"], ".3f"), fnum(r["final_accuracy"], ".3f"), fnum(r["gain"], "+.3f"),
         fnum(r["wall_clock_s"], ".0f"), f"{r.get('bytes_per_sync', 0):,}", fnum(r.get("s_per_sync_mean"), ".3f")]
        for mode, r in d["runs"].items()
    ]  # fmt: skip
    return [
        f"## W1 `add` with LoRA next to full fine-tuning, {d['steps']} steps (`benchmarks/lora.py`)",
        "",
        f"The streaming recipe from the same warm start; `lora`: {', '.join(d['lora'])}, lr {d['lora_lr']} (full: the "
        "recipe's). Only the adapter travels at each sync (`AdapterSync`).",
        "",
        *table(["run", "held-out start", "final", "gain", "wall s", "bytes / sync", "s / sync"], rows),
    ]


FORMATTERS: dict[str, Callable[[dict], list[str]]] = {
    "weight_sync_delta": weight_sync_delta,
    "weight_sync_delta_e2e": lambda d: weight_sync_delta(d, "## W3 `delta` through a vLLM engine (`benchmarks/weight_sync_delta.py --presets w3-25m --parts e2e`)"),
    "weight_export_0.5b": lambda d: weight_sync_delta(d, "## W3 export without a gather at 0.36B parameters (`benchmarks/weight_sync_delta.py --presets qwen-0.5b --parts export`)"),
    "lora": lora,
    "weight_sync": weight_sync,
    "weight_sync_0.5b": lambda d: weight_sync(d, "## W3 `sync` at 0.36B parameters (`benchmarks/weight_sync.py --presets qwen-0.5b`)"),
    "weight_sync_gpu": weight_sync_gpu,
    "weight_sync_gpu_cpu": weight_sync_gpu,
    "weight_sync_lora": lambda d: weight_sync(d, "## W3 `sync` of a LoRA adapter next to the full sync (`benchmarks/weight_sync.py --lora-rank 16`)"),
    "weight_sync_collective": lambda d: weight_sync(d, "## W3 `sync` over the collective transport (`benchmarks/weight_sync.py --transports object_store collective shared_memory`)"),
    "async_speedup": async_speedup,
    "async_speedup_continue": lambda d: async_speedup(d, "## W2 `tail` under `stale_policy: continue` (`benchmarks/async_speedup.py --stale-policy continue`)"),
    "queue_throughput": queue_throughput,
    "data_scale": data_scale,
    "eval_overlap": eval_overlap,
    "eval_overlap_w1": eval_overlap,
    "algo_throughput": algo_throughput,
    "learning_add": learning_add,
    "learning_add_120": learning_add,
    "learning_add_packed": learning_add,
    "learning_add_w1speed": learning_add,
    "learning_add_w1final": learning_add,
    "learning_add_informative": learning_add,
    "learning_add_compile": learning_add,
    "learning_add_bf16": learning_add,
    "learning_add_ready_cap": learning_add,
    "learning_add_mb4": learning_add_mini_batches,
    "learning_add_mb4_same_lr": learning_add_mini_batches,
    "limits": limits,
    "limits_busy": limits,
    "agent_learning": agent_learning,
    "agent_recipes_before": agent_recipes,
    "agent_recipes": agent_recipes,
    "agent_recipes_word_problems": agent_recipes,
    "agent_framework": agent_framework,
    "openai_endpoint": openai_endpoint,
    "soak": soak,
    "staleness_w1": staleness_w1,
    "agent_tool": agent_tool,
    "logprob_layout": logprob_layout,
    "client_floor": client_floor,
    "client_floor_no_freeze": client_floor,
    "engine_start": engine_start,
    "model_scale": model_scale,
    "model_scale_bfloat16": model_scale,
    "model_scale_mmap0": model_scale,
    "fsdp_rank": fsdp_rank,
    "activation_checkpointing": activation_checkpointing,
    "activation_checkpointing_gpu": activation_checkpointing_gpu,
    "packing": packing,
    "moe_routing_replay": moe_routing_replay,
}


def formatter(stem: str) -> Callable[[dict], list[str]] | None:
    """The renderer of a result file: by name; every `profile*.json` is a `profile_run.py` result."""
    return FORMATTERS.get(stem) or (profile if stem.startswith("profile") else None)

LAYOUT = [
    "readme_results",
    "learning_add", "learning_add_120", "learning_add_packed", "learning_add_w1speed", "learning_add_w1final", "learning_add_informative", "learning_add_compile", "learner_compile", "learning_add_bf16", "learning_add_ready_cap", "learning_add_mb4", "learning_add_mb4_same_lr", "lr_decay", "correction", "dtype", "ready_cap", "staleness_w1", "warm_start_lift",
    "async_speedup", "async_speedup_continue", "limits", "limits_busy", "eval_overlap", "eval_overlap_w1",
    "weight_sync", "weight_sync_0.5b", "weight_sync_collective", "weight_sync_lora", "weight_sync_gpu", "weight_sync_delta", "weight_sync_delta_e2e", "weight_export_0.5b", "lora",
    "moe_routing_replay",
    "install_lock",
    "queue_throughput", "data_scale", "algo_throughput", "fsdp_rank", "megatron", "activation_checkpointing", "activation_checkpointing_gpu", "packing", "storage_checkpoint",
    "profile_before", "profile", "profile_w1_quiet", "profile_w1_quiet_after", "profile_w1_afternoon",
    "profile_w1_ungrouped_1", "profile_w1_grouped_1", "profile_w1_ungrouped_2", "profile_w1_grouped_2",
    "profile_w1_unfrozen_1", "profile_w1_frozen_1", "profile_w1_unfrozen_2", "profile_w1_frozen_2",
    "profile_w1_whole_groups_1", "profile_w1_split_groups_1", "profile_w1_whole_groups_2", "profile_w1_split_groups_2", "profile_w1_threads", "profile_w1_compile", "profile_w1_bf16", "profile_w1_w1speed",
    "rollout_overhead", "client_floor_no_freeze", "client_floor", "logprob_layout", "engine_start", "model_scale", "model_scale_mmap0", "model_scale_bfloat16",
    "agent_learning", "agent_recipes_before", "agent_recipes", "agent_recipes_word_problems", "agent_framework", "agent_tool", "openai_endpoint", "soak", "readme_results_archive",
]  # fmt: skip
"""The sections of RESULTS.md in order (module docstring)."""


def result_section(path: Path) -> list[str]:
    """One result file as markdown: its formatter's lines (or every scalar), then the machine and the source."""
    data = json.loads(path.read_text())
    try:
        render_one = formatter(path.stem)
        lines = render_one(data) if render_one else generic(path.stem, data)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        lines = [f"## {path.stem}", "", f"(could not read {path.name}: {type(e).__name__}: {e})"]
    machine = data.get("machine")
    if isinstance(machine, dict):
        return lines + ["", f"_Machine: {machine.get('cpus', '?')} CPUs, {machine.get('platform', '')}; source `{path.name}`._"]
    return lines + ["", f"_Source `{path.name}`._"]


def read_note(notes: Path, name: str) -> tuple[str | None, list[str]]:
    """(title or None, body lines) of `notes/<name>.md`; (None, []) when there is none."""
    path = notes / f"{name}.md"
    if not path.exists():
        return None, []
    lines = path.read_text().rstrip().splitlines()
    title = lines.pop(0) if lines and lines[0].startswith("## ") else None
    while lines and not lines[0].strip():
        lines.pop(0)
    return title, lines


def layout_section(results: Path, notes: Path, name: str) -> list[str]:
    path = results / f"{name}.json"
    title, body = read_note(notes, name)
    if path.exists():
        lines = result_section(path)
        lines[0] = title or lines[0]
        return lines + ([""] + body if body else [])
    if title is None:
        raise ValueError(f"report.py LAYOUT names {name!r}: there is no {path} and no {notes / (name + '.md')} starting with a '## ' title")
    return [title, ""] + body


def result_files(results: Path) -> list[Path]:
    return sorted(p for p in results.glob("*.json") if not p.stem.endswith("_quick"))


def render(results: Path = RESULTS, notes: Path | None = NOTES, layout: list[str] | None = LAYOUT) -> str:
    """RESULTS.md from `layout` with `notes`; with `layout` None, every result file of `results` alone."""
    sections = ["# asyncrl benchmark results", ""]
    if layout is None:
        parts = [result_section(p) for p in result_files(results)] or [[f"No results in {results} (run `make bench`)."]]
    else:
        parts = [layout_section(results, notes or NOTES, name) for name in layout]
    for lines in parts:
        sections += lines + [""]
    text = "\n".join(sections)
    unnamed = [p.name for p in result_files(results) if f"`{p.name}`" not in text]
    if layout is not None and unnamed:
        sections += ["## Other result files", "", "Runs no section above reads (raw JSON in `benchmarks/results/`): "
                     + ", ".join(f"`{n}`" for n in unnamed) + ".", ""]  # fmt: skip
    return "\n".join(sections).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=None, help="another results folder: every file in it, without the notes")
    args = parser.parse_args()
    print(render() if args.results is None else render(args.results, None, None), end="")


if __name__ == "__main__":
    main()
