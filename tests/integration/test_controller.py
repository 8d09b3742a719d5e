"""The controller with real pools (Ray, one vLLM CPU engine, one FSDP2 rank) on the tiny model.

Covers: engine/learner parity after every weight sync, the staleness bound, conservation, evaluations beside
training (non-blocking, pinned to their versions), the best evaluated policy kept in best_model/, and checkpoint ->
stop -> resume continuing at the same version with the same counters, the learner pool resized on the way (1 -> 2
ranks); the runs read a two-file Parquet dataset, and the resumed one goes on from the checkpointed data position.

The first run and its resume live on a real S3-compatible server (`s3_server`): the model is fetched from it,
the run folder, checkpoints and exports are written there (the server is stopped for a while mid-run), and
the resume starts from the server alone (the local staging copy deleted).
"""

import contextlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.remote import Store, join
from asyncrl.testing import S3_TEST_ENV, SHORT_CONTEXT

OUTAGE_S = 4.0
OUTAGE_CAP_S = 60.0
"""The outage lasts OUTAGE_S and until the run noted a failed upload (a loaded machine may reach no upload in
OUTAGE_S), at most OUTAGE_CAP_S: a run that never tries an upload then fails the test."""

pytestmark = pytest.mark.integration


def _config(tmp_path, **extra):
    overrides = {
        "mode": "streaming",
        "output_dir": str(tmp_path / "run"),
        "model.path": None,
        "model.preset": "tiny-0.3m",
        "model.warm_start_examples": 0,
        "rollout.samples_per_prompt": 4,
        "rollout.max_tokens": 6,
        "rollout.max_model_len": SHORT_CONTEXT,
        "buffer.max_staleness": 1,
        "buffer.filter_zero_variance": False,
        "algorithm.preset": "grpo",
        "learner.prompts_per_step": 4,
        "learner.max_steps": 3,
        "data.eval_prompts": 20,
        "eval.every_steps": 0,
        "weight_sync.parity_probe_every": 1,  # probe (and so wait for) every sync
        "telemetry.progress": False,
        "checkpoint.export_hf": True,
    }
    overrides.update(extra)
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def _run(cfg, model_dir):
    from asyncrl.controller.loop import Controller

    controller = Controller(cfg, model_dir)
    try:
        controller.start()
        summary = controller.run()
        return summary, controller.fleet.queue.check_conservation(), controller.records.history
    finally:
        controller.shutdown()


@contextlib.contextmanager
def _outage_after_the_first_row(server, staging: Path):
    """Stop the S3 server (SIGSTOP) once the run logged its first row, for OUTAGE_S and until the run noted a
    failed upload (OUTAGE_CAP_S at most); -> [when it stopped]."""
    stopped: list[float] = []
    done = threading.Event()
    metrics, events = staging / "metrics.jsonl", staging / "events.jsonl"

    def upload_failed() -> bool:
        return events.is_file() and "retrying in" in events.read_text()

    def outage() -> None:
        while not done.wait(0.1):
            if metrics.is_file() and metrics.read_text().strip():
                server.pause()
                stopped.append(time.monotonic())
                done.wait(OUTAGE_S)
                while not upload_failed() and time.monotonic() - stopped[0] < OUTAGE_CAP_S and not done.wait(0.1):
                    pass
                server.resume()
                return

    thread = threading.Thread(target=outage, daemon=True)
    thread.start()
    try:
        yield stopped
    finally:
        done.set()
        thread.join()
        server.resume()


@pytest.fixture(scope="module")
def first_run(s3_server, ray_cluster, tiny_model_dir, tmp_path_factory):
    from asyncrl.envs.model_dir import ensure_model

    tmp = tmp_path_factory.mktemp("controller")
    store = Store(s3_server.endpoint_url)
    model_uri = s3_server.uri(f"models-{tmp.name}", "tiny")
    store.upload(tiny_model_dir, model_uri)
    # The random tiny model earns no reward, so its advantages are 0: weight decay moves its weights every step,
    # so that best_model/ can tell the steps apart.
    data = {"data.task": "parquet", "data.train_path": str(_add_parquet(tmp / "train", 2, 16)), "data.eval_path": str(_add_parquet(tmp / "eval", 1, 20, heldout=True))}
    cfg = _config(tmp, **{
        "model.path": model_uri, "eval.every_steps": 1, **data, "checkpoint.export_best": True, "learner.weight_decay": 0.01,
        "storage.uri": s3_server.uri("runs"), "storage.endpoint_url": s3_server.endpoint_url,
        "storage.sync_every_s": 0.5, "storage.request_timeout_s": 1, "storage.outage_timeout_s": 120,
    })  # fmt: skip
    model_dir = ensure_model(cfg)  # fetched into this node's cache, as `asyncrl.controller.run` does
    with _outage_after_the_first_row(s3_server, cfg.run_dir()) as stopped:
        result = _run(cfg, model_dir)
    assert stopped, "the run ended before its first row reached the outage watcher"
    return cfg, result, model_dir, store


def _download(first_run, name: str, tmp_path) -> Path:
    cfg, _, _, store = first_run
    return store.download(join(cfg.run_uri(), name), tmp_path / name)


def _read(first_run, name: str) -> str:
    cfg, _, _, store = first_run
    return store.read_text(join(cfg.run_uri(), name))


def test_a_storage_outage_mid_run_is_retried_logged_and_loses_nothing(first_run, tmp_path):
    """The server stopped for OUTAGE_S (and until an upload failed) after the first row: the uploads waited (each failed try noted in
    events.jsonl, naming the operation and the URI), the run went on, and every file reached the server."""
    cfg, (summary, conservation, _), model_dir, store = first_run
    notes = [e["data"]["text"] for e in map(json.loads, _read(first_run, "events.jsonl").splitlines()) if e["kind"] == "note"]
    retried = [n for n in notes if n.startswith(f"storage: upload {cfg.run_uri()}/")]
    assert retried and all("retrying in" in n for n in retried), notes
    assert [json.loads(row)["step"] for row in _read(first_run, "metrics.jsonl").splitlines()] == [1, 2, 3]
    assert summary["steps"] == 3
    assert sorted(store.listdir(join(cfg.run_uri(), "checkpoints"))) == ["step-000003"]
    import pyarrow.parquet as pq

    with store.filesystem(join(cfg.run_uri(), "trajectories.parquet"))[0].open(
        join(cfg.run_uri(), "trajectories.parquet")
    ) as f:
        assert pq.read_table(f).num_rows >= conservation["trained"] == 3 * 4 * 4
    # credentials come from the environment and are written nowhere
    secret = S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"].encode()
    assert not [p for p in store.download(cfg.run_uri(), tmp_path / "all").rglob("*") if p.is_file() and secret in p.read_bytes()]
    # the model was fetched once into this node's cache, and the learner and the engine read that copy
    assert model_dir.parent.name == "shipped" and (model_dir / "config.json").is_file()
    assert sorted(p.name for p in model_dir.iterdir() if p.suffix == ".safetensors") == ["model.safetensors"]


def _add_parquet(folder, files, rows_per_file, heldout=False):
    """`add` prompts in verl-layout Parquet files of row groups of 4 rows (the stream shuffles them per epoch)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncrl.envs import add

    pairs = add.heldout_pairs(files * rows_per_file) if heldout else list(zip(range(1, 99, 3), range(50, 98), strict=False))
    rows = [{"data_source": "add", "prompt": [{"role": "user", "content": add.prompt_text(a, b)}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": i}} for i, (a, b) in enumerate(pairs)]  # fmt: skip
    folder.mkdir(parents=True)
    for f in range(files):
        pq.write_table(pa.Table.from_pylist(rows[f * rows_per_file : (f + 1) * rows_per_file]), folder / f"part-{f}.parquet", row_group_size=4)
    return folder


def test_every_weight_sync_restores_engine_learner_parity(first_run):
    _, (summary, _, history), *_ = first_run
    parities = [row["parity_max_abs_diff"] for row in history]
    assert len(parities) == 3
    assert max(parities) < 1e-5  # fp32 on both sides (invariant 4)
    assert summary["final_version"] == 3


def test_the_run_folder_and_every_file_the_run_wrote_are_private(first_run):
    """`storage.mode: private` (the default): the run folder and its folders 0700, every file 0600, whichever
    process wrote it (the driver's event log, the replay queue's trajectories, the learner's checkpoints)."""
    import os
    import stat

    cfg, *_ = first_run
    out = cfg.run_dir()
    modes = {str(p.relative_to(out)): stat.S_IMODE(os.stat(p).st_mode) for p in [out, *out.rglob("*")]}
    assert {"events.jsonl", "metrics.jsonl", "trajectories.parquet", "checkpoints"} <= set(modes), sorted(modes)
    wrong = {p: oct(m) for p, m in modes.items() if m != (0o700 if (out / p).is_dir() else 0o600)}
    assert wrong == {}


def test_no_trained_sample_exceeds_the_staleness_bound_and_counters_add_up(first_run):
    cfg, (summary, conservation, history), *_ = first_run
    lags = [int(k) for k in summary["staleness_histogram"]]
    assert max(lags) <= cfg.buffer.max_staleness
    assert all(row["staleness_max"] <= cfg.buffer.max_staleness for row in history)
    assert conservation["trained"] == summary["samples_trained"] == 3 * 4 * 4
    failed = sum(v for k, v in conservation.items() if k.startswith(("failed:", "filtered:")))
    assert conservation["dispatched"] == conservation["trained"] + conservation.get("dropped_stale", 0) + failed + conservation["in_flight"]


def _weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def test_the_best_evaluated_policy_is_kept_in_best_model(first_run, tiny_model_dir, tmp_path):
    """Evaluations at steps 0..3; the first with the highest accuracy is the best, and best_model/ holds the policy
    it evaluated: the initial weights at step 0, the final ones at step 3, neither in between."""
    import torch

    cfg, (summary, _, _), *_ = first_run
    evals = summary["evals"]
    assert [e["step"] for e in evals] == [0, 1, 2, 3]
    best = max(evals, key=lambda e: e["accuracy"])  # max keeps the first of equal ones
    assert summary["best_eval"] == {"step": best["step"], "version": best["version"], "samples_trained": best["samples_trained"],
                                    "accuracy": best["accuracy"], "exported": True}  # fmt: skip
    best_model, final_model = _download(first_run, "best_model", tmp_path), _download(first_run, "final_model", tmp_path)
    assert json.loads((best_model / "asyncrl_eval.json").read_text())["step"] == best["step"]
    kept, initial, final = _weights(best_model), _weights(tiny_model_dir), _weights(final_model)
    assert kept.keys() == final.keys()
    same = {name: all(torch.equal(kept[k], other[k]) for k in kept) for name, other in (("initial", initial), ("final", final))}
    assert same == {"initial": best["step"] == 0, "final": best["step"] == 3}


def test_evaluations_beside_training_land_later_pinned_to_the_version_they_started_at(first_run):
    """`eval.blocking: false` (the default): the evaluations of steps 1 and 2 ran while the learner trained the next
    step and were recorded at a later step boundary; the first (before any batch) and the last were waited for.
    Every request of each ran under the version it started at: the publications due meanwhile were held back."""
    _, (summary, _, history), *_ = first_run
    evals = summary["evals"]
    print([(e["step"], e["version"], e["recorded_at_step"], e["eval_s"], e["eval_wait_s"], e["publishes_deferred"]) for e in evals])
    assert [e["blocking"] for e in evals] == [True, False, False, False]
    assert all(e["served_versions"] == [e["version"]] == [e["step"]] and not e["straddled"] for e in evals)
    assert [e["recorded_at_step"] > e["step"] for e in evals[1:3]] == [True, True] and evals[3]["recorded_at_step"] == 3
    assert summary["evals_straddled"] == summary["evals_dropped"] == 0
    assert summary["publishes_deferred"] == sum(e["publishes_deferred"] for e in evals)
    assert summary["eval_wait_s"] == pytest.approx(sum(e["eval_wait_s"] for e in evals), abs=0.05)
    assert evals[0]["eval_wait_s"] == evals[0]["eval_s"]  # waited for whole, its candidate export included
    assert [row["version"] for row in history] == [0, 1, 2]  # each step still published its weights


def test_resume_from_the_server_alone_on_two_learner_ranks_continues_at_the_same_version(first_run, tmp_path):
    """The local staging copy is deleted first, so the resume reads the server alone; the learner pool is resized
    by checkpoint + resume: 2 FSDP2 ranks load the 1-rank checkpoint of step 3 (DCP re-shards it). Version,
    counters, the best-eval record and the data position carry over (a 1-rank resume: tests/faults/test_sigterm.py)."""
    cfg, (summary, _, _), model_dir, store = first_run
    ckpt = json.loads(_read(first_run, "checkpoints/step-000003/extra.json"))
    assert ckpt["version"] == 3 and ckpt["step"] == 3
    shutil.rmtree(cfg.run_dir())
    resumed_cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"max_steps": 5, "num_ranks": 2}),
                                         "checkpoint": cfg.checkpoint.model_copy(update={"resume_from": "latest"})})
    resumed, conservation, history = _run(resumed_cfg, model_dir)
    assert [row["step"] for row in history] == [4, 5]
    assert history[0]["version"] == 3  # the first resumed step trains at the checkpointed version
    assert resumed["final_version"] == 5
    assert max(row["parity_max_abs_diff"] for row in history) < 1e-5  # the re-sharded weights are the same weights
    assert resumed["best_eval"]["accuracy"] >= summary["best_eval"]["accuracy"]  # the record came with the checkpoint
    # The Parquet stream went on from its checkpointed position: rows read (32 an epoch) = prompts drawn, both runs.
    for step in (3, 5):
        extra = json.loads(_read(first_run, f"checkpoints/step-{step:06d}/extra.json"))
        position = extra["data"]
        assert position["epoch"] * 32 + position["cursor"] == extra["prompts_drawn"] and position["prompts_dropped"] == 0
    assert conservation["trained"] == summary["samples_trained"] + 2 * 4 * 4
    lags = [int(k) for k in resumed["staleness_histogram"]]
    assert max(lags) <= cfg.buffer.max_staleness
    # the exported policy of the resumed run loads in transformers
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(_download(first_run, "final_model", tmp_path)) is not None
    # the resumed run appended to its predecessor's rows and wrote its own trajectory log beside the first
    assert [json.loads(row)["step"] for row in _read(first_run, "metrics.jsonl").splitlines()] == [1, 2, 3, 4, 5]
    assert {"trajectories.parquet", "trajectories.1.parquet"} <= set(store.listdir(cfg.run_uri()))


@pytest.mark.parametrize("policy", ["wait", "continue"])
def test_wait_and_continue_train_long_samples_within_the_bound_instead_of_dropping_them(policy, ray_cluster, tiny_model_dir, tmp_path):
    """`buffer.stale_policy: wait` and `continue` on heavy-tailed lengths: every other prompt generates 200 tokens,
    the others 4 (EOS ignored), so short groups overtake long ones. Nothing is aborted or dropped, no lag exceeds
    eta = 1, and the long groups are trained: at least a tenth of the trained samples (p90) are 200 tokens long,
    whatever the timing: admission lets a 4-step run start at most (3 + eta + 1) * 4 = 20 groups, 10 of them short,
    so at least 6 of the 16 trained are long (with every 4th prompt long, 15 short groups and 1 long one could make
    the run, p90 = 4). Under `continue` a long sample's tokens older than the bound are masked instead
    (`stale_tokens_masked`; none under `wait`). `drop` passed too in trial runs (it had nothing to drop): the
    policies' difference is pinned by tests/unit/buffer/test_buffer_stale_policy.py and measured by
    benchmarks/async_speedup.py."""
    from asyncrl.envs.data import write_verl_parquet

    rows = [
        {"data_source": "add", "prompt": [{"role": "user", "content": f"{i % 10}+1="}],
         "reward_model": {"style": "rule", "ground_truth": str(i % 10 + 1)},
         "extra_info": {"index": i, "max_tokens": 200 if i % 2 == 0 else 4, "ignore_eos": True}}
        for i in range(32)
    ]  # fmt: skip
    write_verl_parquet(rows, tmp_path / "train.parquet")
    cfg = _config(tmp_path, **{
        "model.path": str(tiny_model_dir), "data.task": "parquet", "data.train_path": str(tmp_path / "train.parquet"),
        "data.shuffle_window": 0, "buffer.stale_policy": policy, "learner.max_steps": 4, "rollout.max_model_len": 256, "weight_sync.parity_probe": False, "checkpoint.export_hf": False,
    })  # fmt: skip
    summary, conservation, _ = _run(cfg, tiny_model_dir)
    assert conservation["dropped_stale"] == 0 and sum(e.get("stale_aborts", 0) for e in summary["rollout"].values()) == 0
    assert max(int(k) for k in summary["staleness_histogram"]) <= 1
    generated, trained = summary["response_lengths"]["generated"], summary["response_lengths"]["trained"]
    assert trained["count"] == conservation["trained"] == 4 * 4 * 4
    assert trained["p90"] == trained["max"] == 200
    # Every generated sample was trained or is still queued at the end (`in_flight`: ready, never dropped). The trained
    # mean length is not asserted >= the generated one: that held only while admission stayed closed for a whole step
    # after each publication. The batch wait now closes an overlapped sync after 0.1 s, admission reopens, and short
    # groups admitted at the last versions overtake the long ones, which the run's end leaves queued (most under
    # `continue`, which never waits).
    assert trained["count"] <= generated["count"] <= trained["count"] + conservation["in_flight"]
    long = {k: round(v["count"] * (v["mean"] - 4) / 196) for k, v in (("generated", generated), ("trained", trained))}
    assert long["generated"] - long["trained"] <= conservation["in_flight"]  # samples of 200 tokens, the others 4
    if policy == "wait":
        assert conservation["stale_tokens_masked"] == 0
